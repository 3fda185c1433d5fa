"""CUDA graphs for whole engine steps, captured at warm-up, as vLLM does.

A step of a small model is all launch overhead: about a hundred kernels, each a few
microseconds of the host's time and less of the device's. Captured once into a CUDA graph, the
step is one launch. A graph's shapes are fixed, so a step is laid out as rows that every graph
can hold (`step_inputs.paged_rows`): each token, a prompt's as much as a decode's, attends
through its sequence's cached blocks up to its own position, so a step mixing prompts and
decodes has the shape of a decode-only step with more rows. There is one graph per bucket: the
rows padded up to 1, 2, 4, 8 ... (up to the step's most tokens, `max_num_batched_tokens`), and
the block tables' width up to a power of two of blocks (up to a sequence of max_model_len).
Each graph reads one static int64 input buffer that a step fills with one copy (per row its
token, position and item; per item its block table: slots, context lengths and the rows'
tables are derived inside the graph), and leaves float32 logits for its sampled rows (at most
one per sequence, `max_num_seqs`) in a static output. Padding rows decode token 0 at position
0: they write their keys and values to the runner's pad block, which no sequence is given,
and attend to its first slot alone.

A prompt's row gathers its whole context where eager attention reads the prompt's own keys
(`PrefillSpan`), so graphs of many rows and wide tables are captured only within
GATHER_BUDGET positions a layer; decode-only buckets (rows up to `max_num_seqs`) always are.
Steps no graph holds run eagerly. The graphs share one memory pool, captured largest first so
the smaller ones reuse its blocks. Graphs are off on a CPU: the runner captures none there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.gpu_worker.device_busy import device_section
from services.gpu_worker.generation.block_allocator import num_blocks_for
from services.gpu_worker.generation.step_inputs import StepItem, is_decode, paged_rows, paged_step

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from services.gpu_worker.generation.model_runner import ModelRunner

#: Cached positions a captured step may gather a layer (rows x width x block_size) past the
#: decode-only buckets: 512 rows of 512 positions (tiny-llama's largest step and context).
#: Gathered keys and values take this times 2 x kv_heads x head_dim elements, briefly.
GATHER_BUDGET = 512 * 512


def buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `limit`, then `limit`."""
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return (*sizes, limit)


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    #: Static int64 inputs laid out by `paged_rows`.
    inputs: torch.Tensor
    #: Static float32 logits [min(rows, max_num_seqs), vocab], rewritten by each replay.
    logits: torch.Tensor


class StepGraphs:
    """One model runner's captured steps."""

    def __init__(
        self,
        runner: ModelRunner,
        max_num_seqs: int,
        max_model_len: int,
        max_step_tokens: int | None = None,
    ) -> None:
        """Buckets up to `max_step_tokens` rows with at most `max_num_seqs` sampled, of up to
        `max_model_len` positions (the engine's, which may be far below the checkpoint's;
        never wider than the cache). Without `max_step_tokens`, decode-only steps alone, of
        up to `max_num_seqs` (the engine before steps with prompts replayed, which the
        benchmarks run beside it)."""
        self._runner = runner
        self._max_num_seqs = max_num_seqs
        self._is_decode_only = not max_step_tokens
        # max_num_seqs itself is a bucket (a full decode step's), whatever powers of two of
        # rows follow it: a decode bucket past it would be held only within the gather budget.
        rows = {*buckets(max_num_seqs), *buckets(max(max_num_seqs, max_step_tokens or 0))}
        self.batch_sizes = tuple(sorted(rows))
        widest = min(num_blocks_for(max_model_len, runner.block_size), runner.num_blocks)
        self.widths = buckets(widest)
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def count(self) -> int:
        return len(self._graphs)

    def holds(self, rows: int, width: int) -> bool:
        """Whether the bucket of `rows` rows and `width` blocks is captured."""
        gathered = rows * width * self._runner.block_size
        return rows <= self._max_num_seqs or gathered <= GATHER_BUDGET

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket's graph; call on the thread that runs the steps, under the kernels
        they use."""
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.batch_sizes):
            for width in reversed(self.widths):
                if self.holds(rows, width):
                    self._graphs[rows, width] = self._capture(rows, width, pool)

    def _capture(self, rows: int, width: int, pool: _POOL_HANDLE) -> _Graph:
        runner = self._runner
        layout = {"rows": rows, "width": width, "num_seqs": min(rows, self._max_num_seqs)}
        padding = paged_rows((), **layout, block_size=runner.block_size, pad_block=runner.pad_block)
        inputs = torch.tensor(padding, dtype=torch.int64, device=runner.device)

        def forward() -> torch.Tensor:
            # The rows' slots, tables and lengths are derived inside: part of the graph.
            return runner.forward(paged_step(inputs, **layout, block_size=runner.block_size))

        # Lazy initialization (cuBLAS workspaces, kernel choice) happens outside the capture,
        # on a side stream as torch's documentation asks.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another model's work on another thread does not break this capture.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = forward()
        return _Graph(graph, inputs, logits)

    def bucket(self, items: Sequence[StepItem]) -> tuple[int, int] | None:
        """The (rows, width) bucket of the graph that holds the step, or None when none does:
        more tokens than the largest bucket, more items than `max_num_seqs`, a context wider
        than the widest, a bucket past the gather budget, or a prompt where graphs are for
        decode-only steps."""
        rows = sum(len(item.token_ids) for item in items)
        if rows > self.batch_sizes[-1] or len(items) > self._max_num_seqs:
            return None
        if self._is_decode_only and not all(map(is_decode, items)):
            return None
        end = max(item.start_position + len(item.token_ids) for item in items)
        widest = num_blocks_for(end, self._runner.block_size)
        if widest > self.widths[-1]:
            return None
        batch = next(size for size in self.batch_sizes if size >= rows)
        width = next(size for size in self.widths if size >= widest)
        return (batch, width) if self.holds(batch, width) else None

    def layout(self, items: Sequence[StepItem], rows: int, width: int) -> list[int]:
        """The static inputs of the (`rows`, `width`) bucket's graph for `items`."""
        return paged_rows(
            items,
            rows=rows,
            width=width,
            num_seqs=min(rows, self._max_num_seqs),
            block_size=self._runner.block_size,
            pad_block=self._runner.pad_block,
        )

    @torch.inference_mode()
    def replay(self, items: Sequence[StepItem]) -> torch.Tensor | None:
        """The step's logits (as `ModelRunner.execute` returns them) from its bucket's graph,
        or None when no graph holds it (`bucket`)."""
        if (bucket := self.bucket(items)) is None:
            return None
        if (graph := self._graphs.get(bucket)) is None:
            return None  # not captured (yet)
        self._runner.inputs.staging.copy_into(graph.inputs, self.layout(items, *bucket))
        with device_section():
            graph.graph.replay()
        self._runner.launched()
        return graph.logits[: sum(1 for item in items if item.samples)].cpu()
