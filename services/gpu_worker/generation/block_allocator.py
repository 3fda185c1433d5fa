"""Paged KV-cache accounting: which physical blocks are free.

The KV cache is `num_blocks` blocks of `block_size` token slots each; a sequence owns a block
table (a list of block ids) and position p lives in block `table[p // block_size]`. This module
only hands out and takes back block ids; the tensors live with the model runner. Pure: no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` slots needed to hold `num_tokens` token slots (ceil division)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


class BlockAllocator:
    """A free list of KV-cache block ids in [0, num_blocks)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """Raises ValueError unless num_blocks >= 1 and block_size >= 1."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self._num_blocks = num_blocks
        self._block_size = block_size
        # FIFO reuse: a freed block goes to the back, so tables are rarely contiguous and
        # nothing downstream can come to depend on contiguity.
        self._free: deque[int] = deque(range(num_blocks))
        self._is_allocated = [False] * num_blocks

    @property
    def num_blocks(self) -> int:
        """Blocks in the whole cache."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self._block_size

    @property
    def num_free(self) -> int:
        """Blocks not owned by any sequence."""
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        """Blocks handed out and not yet freed; always num_blocks - num_free."""
        return self._num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token slots (ceil division)."""
        return num_blocks_for(num_tokens, self._block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """True if `num_blocks` blocks are free right now."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks. Raises RuntimeError if fewer are free (a caller bug:
        check can_allocate first); nothing is taken then."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"cannot allocate {num_blocks} KV blocks: {self.num_free} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._is_allocated[block] = True
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the free list. Raises ValueError on a block that is not allocated
        (double free, unknown id) or listed twice; nothing is freed then."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block listed twice in free({blocks})")
        for block in blocks:
            if not 0 <= block < self._num_blocks or not self._is_allocated[block]:
                raise ValueError(f"KV block {block} is not allocated (double free?)")
        for block in blocks:
            self._is_allocated[block] = False
            self._free.append(block)
