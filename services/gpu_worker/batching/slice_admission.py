"""Queueing the rows of one caller (a slice of a bundle, or a request of its own) on a lane,
all or none, and forgetting them again: the batching driver's per-row path.

Everything a bundle's slices share (the clock, the executor's busy time, the trace, the
running batch's predicted end) is read once per admission pass (`AdmissionPass`); what one
slice's rows share (deadline, weight, batch keys, trace, the future of its outputs) once per
slice; each row then costs a queued item and the batcher's admission check."""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from services.common.errors import DeadlineExceeded, InvalidInput, Overloaded
from services.common.priority import DEFAULT_PRIORITY, PriorityClass, max_queued_rows
from services.common.tracing import TraceContext
from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.backends.base import Backend, PreparedRow
from services.gpu_worker.batching.forecast import PassBound
from services.gpu_worker.batching.lane import Admission, Lane, Pending
from services.gpu_worker.batching.policy import executor_start_s
from services.gpu_worker.batching.slice_outputs import SliceOutputs
from services.gpu_worker.batching.types import BatchKey, QueuedItem
from services.gpu_worker.metrics import WorkerMetrics


class SliceAsk(NamedTuple):
    """The rows of one caller to queue (`BatchingDriver.admit_slices`): `timeout_s` its time
    left (None: the model's default), `weight` its tenant's fair-share weight (0: the
    worker's configured one), `trace_context` the span its batch links to (None: the
    pass's)."""

    rows: Sequence[PreparedRow]
    timeout_s: float | None
    tenant: str
    priority: PriorityClass = DEFAULT_PRIORITY
    weight: float = 0.0
    trace_context: TraceContext | None = None


class AdmissionPass(NamedTuple):
    """What every slice admitted in one pass shares."""

    #: When the slices arrived, on the driver's clock.
    now: float
    #: The executor's cumulative busy seconds at `now` (Pending.busy_s_at_arrival).
    busy_s: float
    #: The span a slice's batch links to when the slice names none.
    trace_context: TraceContext
    #: When the running batch is predicted to end (None: the executor is idle).
    executor_free_s: float | None
    #: The driver's item ids.
    item_ids: itertools.count[int]
    metrics: WorkerMetrics
    #: The pass's bound on its rows' deadline checks (None: each row is checked alone).
    bound: PassBound | None = None
    #: The pass's refusals a later slice like the refused one meets again (`Refusals`).
    refusals: Refusals | None = None


class _Refused(NamedTuple):
    timeout_s: float | None
    error: Exception
    reason: str


class Refusals:
    """The refusals of one admission pass that a later slice of the same tenant, priority,
    weight and rows' buckets, with no more time, meets again: the queue only grows within a
    pass, so room, a tenant's share and a row's own predicted finish only get worse (the
    batch-mates check, which depends on where in a batch a row lands, is not kept). A flood's
    bundle of 64 like slices is refused with one forecast and one error, not 64: refusing
    costs its event loop less, and the batches it feeds get their turns."""

    __slots__ = ("_refused",)

    def __init__(self) -> None:
        self._refused: dict[tuple[object, ...], _Refused] = {}

    def __bool__(self) -> bool:
        """Whether the pass refused a slice yet."""
        return bool(self._refused)

    @staticmethod
    def _like(ask: SliceAsk) -> tuple[object, ...]:
        return (ask.tenant, ask.priority, ask.weight, *(row.bucket for row in ask.rows))

    def met_again(self, ask: SliceAsk) -> _Refused | None:
        """The refusal a slice like `ask`, with no less time, met earlier in the pass."""
        if not self._refused:  # the pass refused nothing yet: nothing to build
            return None
        refused = self._refused.get(self._like(ask))
        if refused is None or refused.timeout_s is None or ask.timeout_s is None:
            return refused if refused is not None and refused.timeout_s == ask.timeout_s else None
        return refused if ask.timeout_s <= refused.timeout_s else None

    def keep(self, ask: SliceAsk, error: Exception, refusal: Rejected) -> None:
        if refusal.reason is RejectReason.DEADLINE and refusal.detail:
            return
        self._refused[self._like(ask)] = _Refused(ask.timeout_s, error, refusal.reason.value)


def batch_key(backend: Backend, bucket: int) -> BatchKey:
    """The batch key of `backend`'s rows of `bucket`."""
    return BatchKey(
        model=backend.config.name,
        version=backend.version.version,
        fingerprint=backend.fingerprint,
        bucket=bucket,
    )


def lane_key(lane: Lane, bucket: int) -> BatchKey:
    """The batch key of the lane's rows of `bucket`, built once per lane and bucket."""
    key = lane.keys.get(bucket)
    if key is None:
        key = lane.keys[bucket] = batch_key(lane.backend, bucket)
    return key


def pass_bound(
    lane: Lane, asks: Sequence[SliceAsk], now: float, executor_free_s: float | None
) -> PassBound | None:
    """The bound of a pass admitting `asks` (forecast.PassBound); None for a single row,
    which it would not spare anything."""
    buckets = Counter(row.bucket for ask in asks for row in ask.rows)
    if sum(buckets.values()) < 2:
        return None
    rows = {lane_key(lane, bucket): count for bucket, count in buckets.items()}
    return lane.batcher.pass_bound(rows, now, executor_free_s)


def admit_slice(lane: Lane, ask: SliceAsk, admission: AdmissionPass) -> Admission:
    """Queues every row of one slice or none (synchronous: nothing else is queued between the
    check for room and the rows). A refused row refuses the slice, all its rows rejected; the
    error is raised."""
    if not (math.isfinite(ask.weight) and ask.weight >= 0.0):
        raise InvalidInput(f"tenant weight must be finite and >= 0, got {ask.weight}")
    if ask.timeout_s is not None and ask.timeout_s <= 0.0:
        # Late already (its deadline passed on the way): the deadline's answer, not an
        # overload refusal with a retry hint.
        raise DeadlineExceeded("deadline exceeded before its rows were queued")
    if ask.priority is PriorityClass.BATCH and len(ask.rows) > (
        most := max_queued_rows(ask.priority, lane.backend.config.max_queue_size)
    ):  # refused on an idle worker too: a hint to retry would be retried for good (past the
        # whole queue, a call of any class is refused before it gets here)
        raise InvalidInput(
            f"{len(ask.rows)} rows of a {ask.priority.value}-class call exceed the {most} the "
            "queue takes of one; split it"
        )
    refusals = admission.refusals
    if refusals is not None and (refused := refusals.met_again(ask)) is not None:
        admission.metrics.rejected_total_of[(*lane.labels, refused.reason)].inc(len(ask.rows))
        error = refused.error  # a hint jittered for each caller; no traceback piled up
        raise (
            error.for_one_caller() if isinstance(error, Overloaded) else error.with_traceback(None)
        )
    now, batcher = admission.now, lane.batcher
    future = asyncio.get_running_loop().create_future()  # before a row is queued
    budget_s = lane.shedding.budget_s(now, ask.priority.rank, batcher.num_queued)
    weight = batcher.weight_of(ask.tenant, ask.weight)
    decision = batcher.can_admit(len(ask.rows), tenant=ask.tenant, weight=weight, now_s=now)
    items = slice_items(lane, ask, admission, budget_s, weight, lane.slo_share)
    free_s, bound = admission.executor_free_s, admission.bound
    for count, item in enumerate(items):
        if isinstance(decision, Admitted):
            decision = batcher.add(item, now, executor_free_s=free_s, bound=bound)
        if isinstance(decision, Rejected):
            reason = decision.reason
            admission.metrics.rejected_total_of[(*lane.labels, reason.value)].inc(len(items))
            error = lane.rejection(item, decision, now, executor_start_s(now, free_s))
            if refusals is not None:
                refusals.keep(ask, error, decision)
            for queued in items[:count]:  # refused, not cancelled: no drop counted
                batcher.cancel(queued.item_id)
            raise error
    return pend(lane, ask, items, admission, future)


def slice_items(
    lane: Lane,
    ask: SliceAsk,
    admission: AdmissionPass,
    budget_s: float | None,
    weight: float,
    slo_share: Callable[[BatchKey], float],
) -> list[QueuedItem]:
    """The queued items of a slice's rows, not queued yet: `budget_s` its shed budget
    (SloShedding.budget_s), `weight` its resolved one (Batcher.weight_of), `slo_share` by
    key (SloShedding.slo_share). What the rows share is read once, out of their loop (a
    one-row slice is the common caller)."""
    now = admission.now
    deadline_s = now + lane.backend.config.timeout_s_for(ask.timeout_s)
    finish_by_s = None if budget_s is None else now + budget_s
    keys, next_id, rank, tenant = lane.keys, admission.item_ids, ask.priority.rank, ask.tenant
    items: list[QueuedItem] = []
    for row in ask.rows:
        key = keys.get(row.bucket) or lane_key(lane, row.bucket)
        share = 1.0 if finish_by_s is None else slo_share(key)
        items.append(QueuedItem(  # positional: a row's item builds in half the time
            next(next_id), key, tenant, row.num_tokens, now, deadline_s, finish_by_s, rank,
            weight, share,
        ))  # fmt: skip
    return items


def pend(
    lane: Lane,
    ask: SliceAsk,
    items: Sequence[QueuedItem],
    admission: AdmissionPass,
    future: asyncio.Future[list[np.ndarray]],
) -> Admission:
    """The slice's rows pending on the lane (their `items` queued, or about to be in the same
    pass), `future` their outputs' (made before any row is queued: without a running loop the
    slice fails with nothing queued)."""
    outputs = SliceOutputs(future, len(items))
    trace_context = admission.trace_context if ask.trace_context is None else ask.trace_context
    pending, busy_s, rows = lane.pending, admission.busy_s, ask.rows
    item_ids = [item.item_id for item in items]
    for index, item_id in enumerate(item_ids):
        pending[item_id] = Pending(rows[index], outputs, index, busy_s, trace_context)
    # A failed row fails its caller: the caller's rows still queued leave unrun, not counted
    # as drops (the caller is answered the failure).
    outputs.on_failed = functools.partial(
        withdraw_rows, lane, item_ids, admission.metrics, drop=None
    )
    return Admission(lane, item_ids, outputs.future)


def admit_slices(
    lane: Lane, asks: Sequence[SliceAsk], admission: AdmissionPass
) -> list[Admission | Exception]:
    """Each slice of a pass admitted whole or refused alone, its error in its place: those
    `CoveredRows` takes queued together, the others row by row (`admit_slice`)."""
    outcomes: list[Admission | Exception] = []
    covered = None if admission.bound is None else CoveredRows(lane, admission, admission.bound)
    try:
        for ask in asks:
            try:
                if covered is not None:
                    if (taken := covered.admit(ask)) is not None:
                        outcomes.append(taken)
                        continue
                    is_full = covered.is_full  # the row path only fills the queue further
                    covered.flush()  # the row path reads the queues
                    if is_full:
                        covered = None
                outcomes.append(admit_slice(lane, ask, admission))
            except Exception as error:
                outcomes.append(error)
            if covered is not None and admission.refusals:  # like slices meet it on the row path
                covered = None
    finally:
        if covered is not None:
            covered.flush()
    return outcomes


class CoveredRows:
    """The slices of one admission pass that no check of `Batcher.add` could refuse, queued
    together at the pass's end (`flush`), before any slice of it takes the row path: every
    row covered by the pass's bound alone (PassBound.fits_whole), the queue within the room
    no check of room or share reads (Batcher.unchecked_room), the lane not idle, nothing
    refused earlier in the pass. Their checks read nothing of what the pass queued before
    them but its count and the bound, which move as each row is taken, so a bundle of 16
    one-row callers moves the queue's counts, the fair-share ledger and the arrival
    estimate once, not 16 times, and what the pass shares (the shed budget by class, the
    weight by tenant, the SLO share by key) is read once. Same decisions as the row path's,
    the same state once flushed (`integration/test_covered_rows.py`)."""

    __slots__ = ("_admission", "_bound", "_budgets", "_items", "_lane", "_margin_s", "_room",
                 "_shares", "_weights")  # fmt: skip

    def __init__(self, lane: Lane, admission: AdmissionPass, bound: PassBound) -> None:
        self._lane, self._admission, self._bound = lane, admission, bound
        self._margin_s = lane.batcher.safety_margin_s
        self._items: list[QueuedItem] = []
        self._budgets: dict[int, float | None] = {}
        self._weights: dict[tuple[str, float], float] = {}
        self._shares: dict[BatchKey, float] = {}
        #: Batcher.unchecked_room at the last flush (None: not read since).
        self._room: int | None = None

    def admit(self, ask: SliceAsk) -> Admission | None:
        """The slice taken, its rows queued at the flush; None where it takes the row path
        (which refuses it, or checks it against the queues)."""
        admission, lane, queued = self._admission, self._lane, self._items
        batcher = lane.batcher
        if self._room is None:  # the row path may have queued rows since the last flush
            self._room = batcher.unchecked_room
        if (not (math.isfinite(ask.weight) and ask.weight >= 0.0)
                or (ask.timeout_s is not None and ask.timeout_s <= 0.0)
                or len(ask.rows) > self._room - len(queued)):  # fmt: skip
            return None
        num_queued = batcher.num_queued + len(queued)
        if admission.executor_free_s is None and num_queued == 0:
            return None  # an idle lane's first row is priced alone (Batcher.add)
        rank = ask.priority.rank
        if rank not in self._budgets:  # the queue's state moves at dispatches, not in a pass
            self._budgets[rank] = lane.shedding.budget_s(admission.now, rank, num_queued)
        weight = self._weights.get((ask.tenant, ask.weight))
        if weight is None:
            weight = batcher.weight_of(ask.tenant, ask.weight)
            self._weights[(ask.tenant, ask.weight)] = weight
        items = slice_items(lane, ask, admission, self._budgets[rank], weight, self._share)
        bound, margin_s = self._bound, self._margin_s
        earliest_s = bound.earliest_limit_s
        for item in items:  # each row after those before it, as the row path checks them
            if not bound.fits_whole(item.admission_limit_s, margin_s, earliest_s):
                return None  # the bound not told of any row: the row path tells it of its own
            earliest_s = min(earliest_s, item.queue_limit_s)
        taken = pend(lane, ask, items, admission, asyncio.get_running_loop().create_future())
        for item in items:
            bound.admitted(item.key, item.queue_limit_s)
        queued.extend(items)
        return taken

    def _share(self, key: BatchKey) -> float:
        share = self._shares.get(key)
        if share is None:
            share = self._shares[key] = self._lane.slo_share(key)
        return share

    @property
    def is_full(self) -> bool:
        """Whether the room no check reads is taken (Batcher.unchecked_room)."""
        return self._room is not None and self._room <= len(self._items)

    def flush(self) -> None:
        """Queues the slices taken so far."""
        if self._items:
            self._lane.batcher.push_admitted(self._items, self._admission.now)
            self._items = []
        self._room = None


def withdraw_slice(admission: Admission, metrics: WorkerMetrics) -> None:
    """Forgets an admitted slice's rows; still-queued ones leave unrun, counted cancelled. A
    slice answered whole has none left: each of its rows ran and was forgotten as answered
    (Lane.answer)."""
    future = admission.future
    if not (future.done() and not future.cancelled() and future.exception() is None):
        withdraw_rows(admission.lane, admission.item_ids, metrics)


def withdraw_rows(
    lane: Lane, item_ids: list[int], metrics: WorkerMetrics, *, drop: str | None = "cancelled"
) -> None:
    """Forgets a slice's rows; still-queued ones leave the batcher (never run) as `drop`."""
    for item_id in item_ids:
        if (pending := lane.pending.pop(item_id, None)) is None:
            continue
        if lane.batcher.cancel(item_id) and drop is not None:
            metrics.dropped_total_of[(*lane.labels, drop)].inc()
        pending.outputs.future.cancel()
