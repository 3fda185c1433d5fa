"""CUDA graphs for decode-only steps, captured at warm-up, as vLLM does.

A decode step of a small model is all launch overhead: about a hundred kernels, each a few
microseconds of the host's time and less of the device's. Captured once into a CUDA graph, the
step is one launch. A graph's shapes are fixed, so there is one per bucket: the batch padded up
to 1, 2, 4, 8, 16, 32 ... sequences (up to `max_num_seqs`), and the decode block tables'
width up to a power of two of blocks (up to a sequence of max_model_len). Each graph reads one
static int64 input buffer (ids, positions, slots, context lengths, block tables) that a step
fills with one copy, and leaves float32 logits in a static output. Padding rows decode token 0
at position 0: they write their keys and values to the runner's pad block, which no sequence
is given, and attend to its first slot alone.

Steps with a prefill chunk stay eager (their shapes are the prompts'). The graphs share one
memory pool, captured largest first so the smaller ones reuse its blocks. Graphs are off on a
CPU: the runner captures none there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.gpu_worker.device_busy import device_section
from services.gpu_worker.generation.block_allocator import num_blocks_for
from services.gpu_worker.generation.kv_cache import slots_for
from services.gpu_worker.generation.step_inputs import (
    DecodeInputs,
    StepItem,
    StepTensors,
    is_decode,
    padded_tables,
)

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from services.gpu_worker.generation.model_runner import ModelRunner


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
    #: Static int64 inputs [4 * batch + batch * width]: ids, positions, slots, lengths, blocks.
    inputs: torch.Tensor
    #: Static float32 logits [batch, vocab], rewritten by each replay.
    logits: torch.Tensor


class DecodeGraphs:
    """One model runner's captured decode steps."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> None:
        """Buckets up to `max_num_seqs` sequences of up to `max_model_len` positions (the
        engine's, which may be far below the checkpoint's; never wider than the cache)."""
        self._runner = runner
        self.batch_sizes = buckets(max_num_seqs)
        widest = min(num_blocks_for(max_model_len, runner.block_size), runner.num_blocks)
        self.widths = buckets(widest)
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def count(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket's graph; call on the thread that runs the steps, under the kernels
        they use."""
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.batch_sizes):
            for width in reversed(self.widths):
                self._graphs[batch, width] = self._capture(batch, width, pool)

    def _capture(self, batch: int, width: int, pool: _POOL_HANDLE) -> _Graph:
        runner = self._runner
        padding = self._padding(batch, width)
        inputs = torch.tensor(padding, dtype=torch.int64, device=runner.device)
        step = StepTensors(
            token_ids=inputs[:batch],
            positions=inputs[batch : 2 * batch],
            slots=inputs[2 * batch : 3 * batch],
            sample_rows=None,
            decodes=DecodeInputs(
                batch, inputs[4 * batch :].view(batch, width), inputs[3 * batch : 4 * batch]
            ),
            prefills=(),
        )
        # Lazy initialization (cuBLAS workspaces, kernel choice) happens outside the capture,
        # on a side stream as torch's documentation asks.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                runner.forward(step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another model's work on another thread does not break this capture.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = runner.forward(step)
        return _Graph(graph, inputs, logits)

    def _padding(self, rows: int, width: int) -> list[int]:
        """The static inputs of `rows` padding rows, field by field (see `_Graph.inputs`)."""
        pad = self._runner.pad_block
        return [
            *([0] * rows),  # token 0
            *([0] * rows),  # at position 0
            *([pad * self._runner.block_size] * rows),  # written to the pad block's first slot
            *([1] * rows),  # which alone it attends to
            *([pad] * (rows * width)),
        ]

    @torch.inference_mode()
    def replay(self, items: Sequence[StepItem]) -> torch.Tensor | None:
        """The step's logits (as `ModelRunner.execute` returns them) from its bucket's graph,
        or None when it has a prefill chunk, more sequences than the largest bucket or a
        context longer than the widest."""
        count = len(items)
        if count > self.batch_sizes[-1] or not all(is_decode(item) for item in items):
            return None
        bs, pad = self._runner.block_size, self._runner.pad_block
        ends = [item.start_position + 1 for item in items]
        widest = num_blocks_for(max(ends), bs)
        if widest > self.widths[-1]:
            return None
        batch = next(size for size in self.batch_sizes if size >= count)
        width = next(size for size in self.widths if size >= widest)
        graph = self._graphs[batch, width]
        extra = batch - count
        values = [item.token_ids[0] for item in items]
        values.extend([0] * extra)
        values.extend(item.start_position for item in items)
        values.extend([0] * extra)
        for item, end in zip(items, ends, strict=True):
            values.extend(slots_for(item.block_table, item.start_position, end, bs))
        values.extend([pad * bs] * extra)
        values.extend(ends)
        values.extend([1] * extra)
        values.extend(padded_tables(items, bs, width, pad))
        values.extend([pad] * (extra * width))
        self._runner.inputs.staging.copy_into(graph.inputs, values)
        with device_section():
            graph.graph.replay()
        logits = graph.logits[:count].cpu()
        if all(item.samples for item in items):
            return logits
        return logits[[i for i, item in enumerate(items) if item.samples]]
