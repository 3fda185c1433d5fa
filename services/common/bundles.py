"""Bundles: the rows of several callers in one internal call (worker.proto's `Slice`).

A gateway coalesces concurrent calls for one model version into one bundle
(services.gateway.coalescer), the router routes and reserves it once, and the worker admits,
times out, cancels and answers each slice on its own (services.gpu_worker.bundles). What the
three tiers share lives here: the packed columns, each slice's time left, and the relay of a
slice's cancellation from the gateway through the router to the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from services.common.errors import InvalidInput

#: Token ids and row lengths travel as little-endian int32.
_INT32 = np.dtype("<i4")


def pack_token_rows(rows: Sequence[np.ndarray]) -> tuple[bytes, bytes]:
    """(token_ids, row_lengths) of PackedRows for `rows` of token ids."""
    lengths = np.fromiter((len(r) for r in rows), dtype=_INT32, count=len(rows))
    ids = np.concatenate(rows).astype(_INT32, copy=False) if rows else np.empty(0, _INT32)
    return ids.tobytes(), lengths.tobytes()


def unpack_token_rows(token_ids: bytes, row_lengths: bytes, num_rows: int) -> list[np.ndarray]:
    """The rows of PackedRows' token columns; INVALID_ARGUMENT when they do not add up."""
    ends = token_row_ends(token_ids, row_lengths, num_rows)
    return split_at(np.frombuffer(token_ids, dtype=_INT32), ends.tolist())


def token_row_ends(token_ids: bytes, row_lengths: bytes, num_rows: int) -> np.ndarray:
    """Where each row of PackedRows' token columns ends (in token ids, int64); INVALID_ARGUMENT
    when the columns do not make `num_rows` rows of at least one token each."""
    if len(token_ids) % 4 or len(row_lengths) % 4:
        raise InvalidInput("packed token_ids and row_lengths must be little-endian int32")
    lengths = np.frombuffer(row_lengths, dtype=_INT32)
    num_ids = len(token_ids) // 4
    if len(lengths) != num_rows:
        raise InvalidInput(f"packed rows: {len(lengths)} row lengths for {num_rows} rows")
    if len(lengths) and int(lengths.min()) < 1:
        raise InvalidInput("packed rows: every row needs at least one token")
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if total != num_ids:
        raise InvalidInput(f"packed rows: row lengths add up to {total}, not {num_ids} ids")
    return ends


def split_at(flat: np.ndarray, ends: list[int]) -> list[np.ndarray]:
    """`flat` cut into rows ending at `ends` (views): what np.split does, at a slice's cost."""
    starts = [0, *ends][: len(ends)]
    return [flat[start:end] for start, end in zip(starts, ends, strict=True)]


def slice_time_left_s(call_time_left_s: float | None, earlier_us: int) -> float | None:
    """A slice's time left at this hop (Slice.earlier_us): the call's, less the margin by which
    the slice's deadline comes before the call's. None: no deadline."""
    if call_time_left_s is None:
        return None
    return max(0.0, call_time_left_s - earlier_us / 1e6)


class SliceCancels:
    """The slices of one bundle in flight whose callers stopped waiting, and whoever must hear
    of each: the stream carrying the bundle on to the next hop, or the worker's slice that
    withdraws its rows. A listener added late still hears of the slices cancelled before."""

    __slots__ = ("_listeners", "cancelled")

    def __init__(self) -> None:
        self.cancelled: set[int] = set()
        self._listeners: list[Callable[[int], None]] = []

    def cancel(self, index: int) -> None:
        if index in self.cancelled:
            return
        self.cancelled.add(index)
        for listener in list(self._listeners):
            listener(index)

    def listen(self, listener: Callable[[int], None]) -> Callable[[], None]:
        """Calls `listener(index)` for each cancelled slice, past and future; returns the
        function that stops it."""
        self._listeners.append(listener)
        for index in sorted(self.cancelled):
            listener(index)
        return lambda: self._listeners.remove(listener)
