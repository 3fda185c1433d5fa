"""One step's inputs, packed on the host and sent to the device in one copy.

A step needs several integer tensors on the device: token ids, positions, the cache slots its
new keys and values go to, the rows whose logits are sampled, the decode tokens' block tables
and context lengths, and the context slots of later prefill chunks. Each built with its own
`torch.tensor(list, device=cuda)` is one pageable host-to-device copy and a synchronization
apiece. Here they are concatenated into one int64 host buffer (pinned on a GPU, reused from
step to step) and copied with one non-blocking copy; the step's tensors are views of it.
Masks are derived on the device from lengths and positions, never copied.

Rows are ordered decode tokens first, then prefill chunks, so every layer's attention reads
the decodes' queries as one slice (no index kernel per layer) and concatenates its outputs.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.gpu_worker.device_busy import current_stream
from services.gpu_worker.generation.block_allocator import num_blocks_for
from services.gpu_worker.generation.kv_cache import slots_for


class StepItem(Protocol):
    """What a step needs of each sequence (the scheduler's `ScheduledSequence`, or a
    `model_runner.SequenceBatchItem` of the warm-up's and the benchmarks' steps)."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def start_position(self) -> int: ...
    @property
    def block_table(self) -> tuple[int, ...]: ...
    @property
    def samples(self) -> bool: ...


def is_decode(item: StepItem) -> bool:
    """One new token of a sequence with cached context: attended with the step's other
    decodes in one batched call."""
    return item.start_position > 0 and len(item.token_ids) == 1


def padded_tables(items: Sequence[StepItem], block_size: int, width: int, filler: int) -> list[int]:
    """Each item's blocks covering its context up to its last new token, then `filler` up to
    `width` blocks, row after row (what attention gathers; the mask hides the filler)."""
    values: list[int] = []
    for item in items:
        needed = num_blocks_for(item.start_position + len(item.token_ids), block_size)
        values.extend(item.block_table[:needed])
        values.extend([filler] * (width - needed))
    return values


@dataclass(frozen=True)
class DecodeInputs:
    """Rows [0, count) of the flattened batch, each attending through whole cached blocks:
    the step's decode tokens (in a graph-replayed step, every row: `paged_rows`)."""

    count: int
    #: Each row's sequence's blocks covering its context, padded to the widest: int64
    #: [count, width]. Attention gathers whole blocks (contiguous runs of block_size slots).
    blocks: torch.Tensor
    #: Each row's context length (its position + 1): int64 [count].
    lengths: torch.Tensor


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill chunk: rows [lo, hi) of the flattened batch."""

    lo: int
    hi: int
    # Cache slots of positions [0, end): None when the chunk is a whole prompt, whose keys and
    # values are exactly the ones computed in this forward (plain causal attention).
    context_slots: torch.Tensor | None
    # Bool [hi - lo, end], True where attention is allowed; None when SDPA needs no mask.
    mask: torch.Tensor | None


@dataclass(frozen=True)
class StepTensors:
    """One step's inputs on the device."""

    token_ids: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N]
    slots: torch.Tensor  # int64 [N]: where each row's key and value are written
    #: Rows whose logits the step returns, in the items' order; None: every row, in row order.
    sample_rows: torch.Tensor | None
    decodes: DecodeInputs | None
    prefills: tuple[PrefillSpan, ...]


def paged_rows(
    items: Sequence[StepItem],
    *,
    rows: int,
    width: int,
    num_seqs: int,
    block_size: int,
    pad_block: int,
) -> list[int]:
    """A step's inputs where every token, a prompt's too, is a row that attends through
    its sequence's cached blocks as a decode token does (its keys and values are written
    first, then its row sees positions up to its own): the layout of a captured graph's
    static inputs (`paged_step`), one shape whatever mix of prompts and decodes fills it.

    Field after field: token ids, positions and each row's item (`rows` each), the rows whose
    logits are sampled (`num_seqs`: each sampling item's last row, in the items' order), then
    each item's block table (`width` blocks; `num_seqs` tables and a last one of `pad_block`
    alone). Rows past the items' tokens are padding: token 0 at position 0 of the last table,
    so written to `pad_block`'s first slot and attending to it alone; unused sample entries
    read row 0. The caller fits the buckets: at most `rows` tokens and `num_seqs` items, and
    contexts within `width` blocks. Per item, not per row: slots, context lengths and each
    row's table are derived on the device."""
    ids: list[int] = []
    positions: list[int] = []
    row_items: list[int] = []
    sampled: list[int] = []
    for index, item in enumerate(items):
        start = item.start_position
        count = len(item.token_ids)
        ids.extend(item.token_ids)
        positions.extend(range(start, start + count))
        row_items.extend([index] * count)
        if item.samples:
            sampled.append(len(ids) - 1)
    extra = rows - len(ids)
    return [
        *ids, *([0] * extra),
        *positions, *([0] * extra),
        *row_items, *([num_seqs] * extra),
        *sampled, *([0] * (num_seqs - len(sampled))),
        *padded_tables(items, block_size, width, pad_block),
        *([pad_block] * ((num_seqs + 1 - len(items)) * width)),
    ]  # fmt: skip


def paged_step(
    inputs: torch.Tensor, *, rows: int, width: int, num_seqs: int, block_size: int
) -> StepTensors:
    """The step laid out by `paged_rows` in `inputs`: views of it, and each row's slot, table
    and context length derived from them by torch ops (inside a graph's capture, part of it)."""
    positions = inputs[rows : 2 * rows]
    samples_end = 3 * rows + num_seqs
    tables = inputs[samples_end : samples_end + (num_seqs + 1) * width].view(-1, width)
    blocks = tables[inputs[2 * rows : 3 * rows]]  # [rows, width]: each row's item's table
    current = blocks.gather(1, (positions // block_size)[:, None])[:, 0]
    return StepTensors(
        token_ids=inputs[:rows],
        positions=positions,
        slots=current * block_size + positions % block_size,
        sample_rows=inputs[3 * rows : samples_end],
        decodes=DecodeInputs(rows, blocks, positions + 1),
        prefills=(),
    )


class HostStaging:
    """One int64 host buffer reused by every step (pinned on a GPU) and its copy to the device.

    A step copies without blocking, then reads its logits back, which waits for the copy; a
    step that failed in between may not have, so the next one waits on the last copy's event
    before it overwrites the buffer."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._is_cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None

    # Inference mode throughout: the buffers are inference tensors (made under it by the
    # steps), which torch lets only inference mode update in place.
    @torch.inference_mode()
    def stage(self, values: list[int]) -> torch.Tensor:
        """`values` in the reused host buffer (a fresh tensor on a CPU device)."""
        # Through an int64 array: torch.tensor(list) takes about 4x as long (5,000 values,
        # a step of 128 sequences with prompts from a graph: 200 us against 55).
        packed = (
            torch.frombuffer(array.array("q", values), dtype=torch.int64)
            if values
            else torch.empty(0, dtype=torch.int64)
        )
        if not self._is_cuda:
            return packed
        if self._copied is not None:
            self._copied.synchronize()
        if self._host.numel() < len(values):
            size = max(len(values), 2 * self._host.numel(), 1024)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
        host = self._host[: len(values)]
        host.copy_(packed)
        return host

    @torch.inference_mode()
    def copy_into(self, device_buffer: torch.Tensor, values: list[int]) -> None:
        """`values` copied into the front of `device_buffer` (a graph's static inputs)."""
        host = self.stage(values)
        device_buffer[: len(values)].copy_(host, non_blocking=True)
        self._record()

    @torch.inference_mode()
    def to_device(self, values: list[int]) -> torch.Tensor:
        """`values` on the device, in one copy."""
        host = self.stage(values)
        if not self._is_cuda:
            return host
        on_device = host.to(self._device, non_blocking=True)
        self._record()
        return on_device

    def _record(self) -> None:
        if self._is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(current_stream())


class StepInputBuilder:
    """Lays out a step's items as rows and packs their inputs (see the module docstring)."""

    def __init__(self, device: torch.device, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.staging = HostStaging(device)
        #: 0..max_model_len-1 on the device, sliced for masks instead of a new arange per step.
        self.arange = torch.arange(max_model_len, device=device)

    def build(self, items: Sequence[StepItem]) -> StepTensors:
        """Items' rows (decodes first), sampled rows in the items' order, on the device."""
        bs = self.block_size
        decodes = [i for i, item in enumerate(items) if is_decode(item)]
        order = decodes + [i for i, item in enumerate(items) if not is_decode(item)]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row = [0] * len(items)
        spans: list[tuple[int, int, StepItem]] = []
        for i in order:
            item = items[i]
            lo, start = len(ids), item.start_position
            end = start + len(item.token_ids)
            ids.extend(item.token_ids)
            positions.extend(range(start, end))
            slots.extend(slots_for(item.block_table, start, end, bs))
            last_row[i] = len(ids) - 1
            if lo >= len(decodes):
                spans.append((lo, len(ids), item))
        sample_rows = [last_row[i] for i, item in enumerate(items) if item.samples]
        every_row = sample_rows == list(range(len(ids)))
        values = [*ids, *positions, *slots, *([] if every_row else sample_rows)]

        width = 0
        if decodes:
            ends = [items[i].start_position + 1 for i in decodes]
            width = max(num_blocks_for(end, bs) for end in ends)
            values.extend(padded_tables([items[i] for i in decodes], bs, width, 0))
            values.extend(ends)
        contexts: list[int] = []  # where each later chunk's context slots start in `values`
        for _, _, item in spans:
            if item.start_position > 0:
                contexts.append(len(values))
                end = item.start_position + len(item.token_ids)
                values.extend(slots_for(item.block_table, 0, end, bs))

        packed = self.staging.to_device(values)
        n = len(ids)
        offset = 3 * n
        rows = None
        if not every_row:
            rows, offset = packed[offset : offset + len(sample_rows)], offset + len(sample_rows)
        decode_inputs = None
        if decodes:
            count = len(decodes)
            blocks = packed[offset : offset + count * width].view(count, width)
            offset += count * width
            decode_inputs = DecodeInputs(count, blocks, packed[offset : offset + count])
        prefills = []
        next_context = iter(contexts)
        for lo, hi, item in spans:
            start = item.start_position
            if start == 0:
                prefills.append(PrefillSpan(lo, hi, None, None))
                continue
            at, end = next(next_context), start + len(item.token_ids)
            # Query i sits at position start + i and sees positions <= it. SDPA's is_causal
            # aligns the diagonal top-left, wrong when keys outnumber queries: a mask.
            mask = self.arange[:end][None, :] <= self.arange[start:end][:, None]
            prefills.append(PrefillSpan(lo, hi, packed[at : at + end], mask))
        return StepTensors(
            token_ids=packed[:n],
            positions=packed[n : 2 * n],
            slots=packed[2 * n : 3 * n],
            sample_rows=rows,
            decodes=decode_inputs,
            prefills=tuple(prefills),
        )
