"""Runs one engine step: a batch of prefill chunks and decode tokens through the model.

All items' tokens are flattened into one batch so embeddings, projections and MLPs run as a few
large matmuls. Only attention is per sequence: each item's queries attend to its own keys and
values, gathered from the paged KV cache through its block table. The step's inputs reach the
device in one packed copy (`step_inputs`); its attention runs on a chosen set of SDPA kernels
(`attention_backends`); on a GPU, steps replay CUDA graphs (`step_graphs`), prompts and
decodes alike, where one holds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.gpu_worker.device_busy import device_section
from services.gpu_worker.generation.attention_backends import (
    CANDIDATES,
    fastest,
)
from services.gpu_worker.generation.block_allocator import num_blocks_for
from services.gpu_worker.generation.kv_cache import PagedKVCache
from services.gpu_worker.generation.llama import LlamaConfig, LlamaForCausalLM
from services.gpu_worker.generation.step_graphs import StepGraphs
from services.gpu_worker.generation.step_inputs import StepInputBuilder, StepItem, StepTensors


@dataclass(frozen=True)
class SequenceBatchItem:
    """One sequence's share of a step."""

    # New tokens to process: a prefill chunk, or the one token sampled last step (decode).
    token_ids: tuple[int, ...]
    # Position of token_ids[0] = number of this sequence's tokens already in the KV cache.
    start_position: int
    # Physical blocks covering positions [0, start_position + len(token_ids)), in logical order.
    block_table: tuple[int, ...]
    # Whether the caller samples from this item's last token (a prompt's last chunk, a decode);
    # the step computes logits only for items that do.
    samples: bool = True

    @property
    def end_position(self) -> int:
        """One past the position of the last token processed in this step."""
        return self.start_position + len(self.token_ids)


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
        #: Blocks a sequence of max_model_len positions covers: the widest decode block table.
        self.max_blocks_per_seq = num_blocks_for(self.max_model_len, block_size)
        # One block more than the allocator hands out: a CUDA graph's padding rows write their
        # keys and values there and attend to it, never to a sequence's blocks.
        self.pad_block = num_blocks
        self.kv_cache = PagedKVCache(
            num_layers=self.config.num_hidden_layers,
            num_blocks=num_blocks + 1,
            block_size=block_size,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.inputs = StepInputBuilder(device, block_size, self.max_blocks_per_seq * block_size)
        #: The SDPA kernels every step may use (`choose_attention` measures them on a GPU).
        self.attention = CANDIDATES[0]
        #: Steps replayed from CUDA graphs, once captured (`capture_graphs`).
        self.graphs: StepGraphs | None = None
        #: Steps run so far from a graph, and eagerly (for benchmarks and logs).
        self.num_replayed_steps = 0
        self.num_eager_steps = 0
        #: Called after each forward (eager, timed or captured): how a watch over work that runs
        #: many (a hot load's warm-up) sees it progress. Host-side only: it must never touch
        #: the device (inside a graph's capture, a sync would break it), so it marks a forward
        #: launched; a hung kernel shows at the next step's copy, one bound later.
        self.on_forward: Callable[[], None] | None = None
        #: Called, on the step's thread, once a step's device work is launched and only the
        #: wait for its logits is left (a GPU's, or the stand-in's): the engine streams the
        #: step before's tokens meanwhile (`StepExecutor.execute`'s `while_running`).
        self.on_launched: Callable[[], None] | None = None

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + generated tokens) the model has positions for."""
        return self.config.max_position_embeddings

    @torch.inference_mode()
    def execute(self, items: Sequence[StepItem]) -> torch.Tensor:
        """Process every item's new tokens in one forward, writing their keys and values to the
        cache; returns float32 logits of the last token of each item that samples, in the
        items' order, `[number sampling, vocab]`, on CPU.

        Raises ValueError for malformed items (a caller bug: nothing is written in that case).
        """
        if not items:
            return torch.empty((0, self.config.vocab_size), dtype=torch.float32)
        self._check_all(items)
        if self.graphs is not None and (logits := self.graphs.replay(items)) is not None:
            self.num_replayed_steps += 1
            return logits
        self.num_eager_steps += 1
        tensors = self.inputs.build(items)
        with self.attention.enabled(), device_section():
            logits = self.forward(tensors)
        self.launched()  # on a GPU the forward's kernels are queued, not run: the copy waits
        return logits.cpu()

    def launched(self) -> None:
        """Tells `on_launched` (if set) that the step's device work is launched."""
        if self.on_launched is not None:
            self.on_launched()

    def forward(self, step: StepTensors) -> torch.Tensor:
        """The step's float32 logits on the device (eager, or inside a graph's capture)."""

        decodes = step.decodes
        # Which gathered positions each decode token sees: the same for every layer, so built
        # once a step. [n, 1 (kv heads), 1 (queries), positions], broadcast.
        decode_mask = None
        if decodes is not None:
            positions = self.inputs.arange[: decodes.blocks.shape[1] * self.block_size]
            decode_mask = (positions[None, :] < decodes.lengths[:, None])[:, None, None, :]

        def attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            self.kv_cache.write(layer, step.slots, k, v)
            parts = []
            if decodes is not None and decode_mask is not None:
                parts.append(
                    self._attend_decodes(layer, q[: decodes.count], decodes.blocks, decode_mask)
                )
            for span in step.prefills:
                if span.context_slots is None:
                    keys, values = k[span.lo : span.hi], v[span.lo : span.hi]
                else:
                    keys, values = self.kv_cache.gather(layer, span.context_slots)
                # SDPA wants [batch, heads, tokens, head_dim]; enable_gqa shares each KV head
                # across its group of query heads without materializing copies.
                attended = F.scaled_dot_product_attention(
                    q[span.lo : span.hi].transpose(0, 1)[None],
                    keys.transpose(0, 1)[None],
                    values.transpose(0, 1)[None],
                    attn_mask=span.mask,
                    is_causal=span.mask is None and span.hi - span.lo > 1,
                    enable_gqa=True,
                )
                parts.append(attended[0].transpose(0, 1))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        hidden = self.model(step.token_ids, step.positions, attention)
        if step.sample_rows is not None:
            hidden = hidden[step.sample_rows]
        logits = self.model.compute_logits(hidden).float()
        if self.on_forward is not None:
            self.on_forward()
        return logits

    def _attend_decodes(
        self, layer: int, q: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention of n decode tokens (`q`: [n, heads, head_dim]) over their sequences'
        cached keys and values (whole `blocks`, [n, width], of which `mask` hides padding and
        the unwritten tail of each last block), in one block gather and one SDPA call.

        The query heads that share a KV head attend as that head's queries (grouped-query
        attention without repeating keys and values, which SDPA's `enable_gqa` would do
        outside its fused kernels)."""
        num_seqs, heads, head_dim = q.shape
        keys, values = self.kv_cache.gather_blocks(layer, blocks)
        # [n, width, block_size, kv_heads, head_dim] -> [n, kv_heads, positions, head_dim]
        keys = keys.view(num_seqs, -1, *keys.shape[3:]).transpose(1, 2)
        values = values.view(num_seqs, -1, *values.shape[3:]).transpose(1, 2)
        kv_heads = keys.shape[1]
        # Query head h reads KV head h // group (Hugging Face's repeat_kv): consecutive heads.
        grouped = q.view(num_seqs, kv_heads, heads // kv_heads, head_dim)
        attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
        return attended.reshape(num_seqs, heads, head_dim)

    def choose_attention(self, steps: Sequence[Sequence[StepItem]]) -> dict[str, float]:
        """On a GPU, the fastest kernel set (`attention_backends.CANDIDATES`) over `steps`
        (representative steps, whose keys and values are written to the blocks they name),
        kept in `self.attention`; returns each set's seconds. A CPU keeps the first set
        unmeasured (returns {})."""
        if self.device.type != "cuda":
            return {}
        for items in steps:
            self._check_all(items)

        def time_steps() -> float:
            for items in steps:  # once to build each kernel's state, then timed
                self._eager(items)
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                started = time.perf_counter()
                for items in steps:
                    self._eager(items)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - started)
            return best

        self.attention, times = fastest(CANDIDATES, time_steps)
        return times

    @torch.inference_mode()
    def _eager(self, items: Sequence[StepItem]) -> torch.Tensor:
        return self.forward(self.inputs.build(items))

    def capture_graphs(
        self, max_num_seqs: int, max_model_len: int | None = None, max_step_tokens: int = 0
    ) -> int:
        """On a GPU, captures the steps' CUDA graphs (`step_graphs`) for up to `max_num_seqs`
        sequences and `max_step_tokens` tokens a step (0: decode-only steps of `max_num_seqs`)
        of up to `max_model_len` positions (default: the model's) under the chosen kernels;
        returns how many (0 on a CPU, where graphs are off)."""
        if self.device.type != "cuda":
            return 0
        longest = self.max_model_len if max_model_len is None else max_model_len
        graphs = StepGraphs(self, max_num_seqs, longest, max_step_tokens)
        with self.attention.enabled():
            graphs.capture()
        self.graphs = graphs
        return graphs.count

    def _check_all(self, items: Sequence[StepItem]) -> None:
        for item in items:
            self._check(item)

    def _check(self, item: StepItem) -> None:
        # min/max rather than a generator over every id: this runs for every item of every step.
        if not item.token_ids:
            raise ValueError("a batch item needs at least one token")
        end_position = item.start_position + len(item.token_ids)
        if item.start_position < 0:
            raise ValueError(f"start_position must be >= 0, got {item.start_position}")
        if end_position > self.max_model_len:
            raise ValueError(
                f"positions up to {end_position} exceed max_model_len {self.max_model_len}"
            )
        needed = num_blocks_for(end_position, self.block_size)
        if len(item.block_table) < needed:
            raise ValueError(
                f"block table has {len(item.block_table)} blocks, "
                f"{end_position} positions need {needed}"
            )
        table = item.block_table[:needed]
        if table and (min(table) < 0 or max(table) >= self.num_blocks):
            raise ValueError(
                f"block table {item.block_table} has ids outside [0, {self.num_blocks})"
            )
        if min(item.token_ids) < 0 or max(item.token_ids) >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
