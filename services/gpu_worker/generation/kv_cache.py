"""The paged KV cache: fixed-size blocks of key/value slots, addressed through block tables.

A sequence's keys and values live in whichever physical blocks the block manager gave it, in any
order; its block table maps logical block `p // block_size` to a physical block. Slot `s` of the
flattened cache is `block * block_size + offset`. The cache only stores and gathers; which blocks
belong to whom is the block manager's business.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slots_for(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flattened cache slots of positions [start, end) of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class PagedKVCache:
    """Per layer, K and V tensors shaped `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros rather than empty: a bug that reads an unwritten slot then gives wrong numbers
        # deterministically instead of NaNs that depend on leftover memory.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store keys/values `[N, num_kv_heads, head_dim]` at flattened slots (int64 [N])."""
        self._flat(self.keys[layer]).index_copy_(0, slots, keys)
        self._flat(self.values[layer]).index_copy_(0, slots, values)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at flattened slots (int64 [M]), each `[M, num_kv_heads, head_dim]`."""
        return self._flat(self.keys[layer])[slots], self._flat(self.values[layer])[slots]

    def gather_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks (int64 ids of any shape S), each
        `[*S, block_size, num_kv_heads, head_dim]`: block_size slots copied per index."""
        return self.keys[layer][blocks], self.values[layer][blocks]

    @staticmethod
    def _flat(cache: torch.Tensor) -> torch.Tensor:
        # A view: writes through it land in the paged tensor.
        return cache.view(-1, *cache.shape[2:])
