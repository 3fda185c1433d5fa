"""Runs one engine step: a batch of prefill chunks and decode tokens through the model.

All items' tokens are flattened into one batch so embeddings, projections and MLPs run as a few
large matmuls. Only attention is per sequence: each item's queries attend to its own keys and
values, gathered from the paged KV cache through its block table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.gpu_worker.device_busy import device_section
from services.gpu_worker.generation.block_allocator import num_blocks_for
from services.gpu_worker.generation.kv_cache import PagedKVCache, slots_for
from services.gpu_worker.generation.llama import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class SequenceBatchItem:
    """One sequence's share of a step."""

    # New tokens to process: a prefill chunk, or the one token sampled last step (decode).
    token_ids: tuple[int, ...]
    # Position of token_ids[0] = number of this sequence's tokens already in the KV cache.
    start_position: int
    # Physical blocks covering positions [0, start_position + len(token_ids)), in logical order.
    block_table: tuple[int, ...]

    @property
    def end_position(self) -> int:
        """One past the position of the last token processed in this step."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class _ItemPlan:
    """Where one item's tokens sit in the flattened batch, and what they attend to."""

    lo: int
    hi: int
    # Cache slots of positions [0, end): None when the item is a whole prompt in one chunk, whose
    # keys and values are exactly the ones computed in this forward.
    context_slots: torch.Tensor | None
    # Bool [num_new, end], True where attention is allowed; None when SDPA needs no mask.
    mask: torch.Tensor | None
    is_causal: bool


@dataclass(frozen=True)
class _DecodePlan:
    """Every decode token of a step (one new token of a sequence with cached context)."""

    #: Their rows in the flattened batch, int64 [n].
    rows: torch.Tensor
    #: Each sequence's block table, padded with block 0 to the longest: int64 [n, max_blocks].
    #: Attention gathers whole blocks (contiguous runs of block_size slots), not slots.
    blocks: torch.Tensor
    #: True where a gathered position is the sequence's own (below its end, not padding):
    #: bool [n, 1, 1, max_blocks * block_size].
    mask: torch.Tensor


class ModelRunner:
    """A Llama model and its paged KV cache on one device."""

    def __init__(
        self,
        model_dir: Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
    ) -> None:
        self.device = device
        self.model = LlamaForCausalLM.from_pretrained(model_dir, device=device, dtype=dtype)
        self.config: LlamaConfig = self.model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_cache = PagedKVCache(
            num_layers=self.config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + generated tokens) the model has positions for."""
        return self.config.max_position_embeddings

    @torch.inference_mode()
    def execute(self, items: Sequence[SequenceBatchItem]) -> torch.Tensor:
        """Process every item's new tokens in one forward, writing their keys and values to the
        cache; returns float32 logits of each item's last token, `[len(items), vocab]`, on CPU.

        Raises ValueError for malformed items (a caller bug: nothing is written in that case).
        """
        if not items:
            return torch.empty((0, self.config.vocab_size), dtype=torch.float32)
        for item in items:
            self._check(item)

        input_ids: list[int] = []
        positions: list[int] = []
        new_slots: list[int] = []
        plans: list[_ItemPlan] = []
        decodes: list[tuple[int, SequenceBatchItem]] = []
        last_rows: list[int] = []
        for item in items:
            lo = len(input_ids)
            input_ids.extend(item.token_ids)
            positions.extend(range(item.start_position, item.end_position))
            new_slots.extend(
                slots_for(item.block_table, item.start_position, item.end_position, self.block_size)
            )
            last_rows.append(len(input_ids) - 1)  # the row whose logits the caller samples
            if item.start_position > 0 and len(item.token_ids) == 1:
                decodes.append((lo, item))  # attended together, below
            else:
                plans.append(self._plan(item, lo, len(input_ids)))

        def on_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        new_slots_t = on_device(new_slots)
        decode = self._decode_plan(decodes)

        def attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            self.kv_cache.write(layer, new_slots_t, k, v)
            out = torch.empty_like(q)
            if decode is not None:
                out[decode.rows] = self._attend_decodes(layer, q[decode.rows], decode)
            for plan in plans:
                if plan.context_slots is None:
                    keys, values = k[plan.lo : plan.hi], v[plan.lo : plan.hi]
                else:
                    keys, values = self.kv_cache.gather(layer, plan.context_slots)
                # SDPA wants [batch, heads, tokens, head_dim]; enable_gqa shares each KV head
                # across its group of query heads without materializing copies.
                attended = F.scaled_dot_product_attention(
                    q[plan.lo : plan.hi].transpose(0, 1)[None],
                    keys.transpose(0, 1)[None],
                    values.transpose(0, 1)[None],
                    attn_mask=plan.mask,
                    is_causal=plan.is_causal,
                    enable_gqa=True,
                )
                out[plan.lo : plan.hi] = attended[0].transpose(0, 1)
            return out

        token_ids, token_positions, last = (
            on_device(input_ids),
            on_device(positions),
            on_device(last_rows),
        )
        with device_section():
            hidden = self.model(token_ids, token_positions, attention)
            logits = self.model.compute_logits(hidden[last]).float()
        return logits.cpu()

    def _decode_plan(self, decodes: Sequence[tuple[int, SequenceBatchItem]]) -> _DecodePlan | None:
        """One padded block table for every decode token of the step: row i holds sequence i's
        blocks covering positions [0, end), padded with block 0 up to the longest; the mask
        hides padding and the unwritten tail of each last block. Built from block ids, not
        positions: its cost grows with blocks, not with every token of every context."""
        if not decodes:
            return None
        num_blocks = [num_blocks_for(item.end_position, self.block_size) for _, item in decodes]
        width = max(num_blocks)
        tables = [
            [*item.block_table[:n], *([0] * (width - n))]
            for (_, item), n in zip(decodes, num_blocks, strict=True)
        ]
        lengths = torch.tensor([item.end_position for _, item in decodes], dtype=torch.int64)
        mask = torch.arange(width * self.block_size)[None, :] < lengths[:, None]
        return _DecodePlan(
            rows=torch.tensor([lo for lo, _ in decodes], dtype=torch.int64, device=self.device),
            blocks=torch.tensor(tables, dtype=torch.int64, device=self.device),
            # [n, 1 (heads), 1 (query), positions]: broadcast over every head.
            mask=mask[:, None, None, :].to(self.device),
        )

    def _attend_decodes(self, layer: int, q: torch.Tensor, plan: _DecodePlan) -> torch.Tensor:
        """Attention of n decode tokens (`q`: [n, heads, head_dim]) over their sequences'
        cached keys and values, in one block gather and one SDPA call for the layer."""
        num_seqs = plan.blocks.shape[0]
        keys, values = self.kv_cache.gather_blocks(layer, plan.blocks)
        # [n, max_blocks, block_size, kv_heads, head_dim] -> [n, kv_heads, positions, head_dim]
        keys = keys.view(num_seqs, -1, *keys.shape[3:]).transpose(1, 2)
        values = values.view(num_seqs, -1, *values.shape[3:]).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q[:, :, None, :], keys, values, attn_mask=plan.mask, enable_gqa=True
        )
        return attended[:, :, 0, :]

    def _plan(self, item: SequenceBatchItem, lo: int, hi: int) -> _ItemPlan:
        start, end = item.start_position, item.end_position
        if start == 0:
            # The whole context is new: plain causal attention over this forward's keys.
            return _ItemPlan(lo, hi, None, None, is_causal=hi - lo > 1)
        context = torch.tensor(
            slots_for(item.block_table, 0, end, self.block_size),
            dtype=torch.int64,
            device=self.device,
        )
        # A later prefill chunk: query i sits at position start + i and sees positions <= it.
        # SDPA's is_causal aligns the diagonal top-left, which is wrong when keys outnumber
        # queries, hence an explicit mask.
        key_positions = torch.arange(end, device=self.device)
        query_positions = torch.arange(start, end, device=self.device)
        mask = key_positions[None, :] <= query_positions[:, None]
        return _ItemPlan(lo, hi, context, mask, is_causal=False)

    def _check(self, item: SequenceBatchItem) -> None:
        # min/max rather than a generator over every id: this runs for every item of every step.
        if not item.token_ids:
            raise ValueError("a batch item needs at least one token")
        if item.start_position < 0:
            raise ValueError(f"start_position must be >= 0, got {item.start_position}")
        if item.end_position > self.max_model_len:
            raise ValueError(
                f"positions up to {item.end_position} exceed max_model_len {self.max_model_len}"
            )
        needed = num_blocks_for(item.end_position, self.block_size)
        if len(item.block_table) < needed:
            raise ValueError(
                f"block table has {len(item.block_table)} blocks, "
                f"{item.end_position} positions need {needed}"
            )
        table = item.block_table[:needed]
        if table and (min(table) < 0 or max(table) >= self.num_blocks):
            raise ValueError(
                f"block table {item.block_table} has ids outside [0, {self.num_blocks})"
            )
        if min(item.token_ids) < 0 or max(item.token_ids) >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
