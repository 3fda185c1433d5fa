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
from collections.abc import Sequence
from typing import NamedTuple

from services.common.errors import DeadlineExceeded, InvalidInput, Overloaded
from services.common.priority import DEFAULT_PRIORITY, PriorityClass
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
    refusals = admission.refusals
    if refusals is not None and (refused := refusals.met_again(ask)) is not None:
        admission.metrics.rejected_total_of[(*lane.labels, refused.reason)].inc(len(ask.rows))
        error = refused.error  # a hint jittered for each caller; no traceback piled up
        raise (
            error.for_one_caller() if isinstance(error, Overloaded) else error.with_traceback(None)
        )
    now, batcher, rank = admission.now, lane.batcher, ask.priority.rank
    shed_budget_s = lane.shedding.budget_s(now, rank, batcher.num_queued)
    deadline_s = now + lane.backend.config.timeout_s_for(ask.timeout_s)
    finish_by_s = None if shed_budget_s is None else now + shed_budget_s
    weight = batcher.weight_of(ask.tenant, ask.weight)
    trace_context = admission.trace_context if ask.trace_context is None else ask.trace_context
    rows, tenant = ask.rows, ask.tenant
    decision = batcher.can_admit(len(rows), tenant=tenant, weight=weight, now_s=now)
    item_ids: list[int] = []
    outputs = SliceOutputs(asyncio.get_running_loop().create_future(), len(rows))
    # One pass per row, each row a queued item and a pending entry: what the pass and the
    # slice share is read once, out of the loop (a one-row slice is the common caller).
    keys, pending, next_id, busy_s = lane.keys, lane.pending, admission.item_ids, admission.busy_s
    free_s, bound = admission.executor_free_s, admission.bound
    for index, row in enumerate(rows):
        key = keys.get(row.bucket) or lane_key(lane, row.bucket)
        slo_share = 1.0 if finish_by_s is None else lane.shedding.slo_share(lane.latency, key)
        item = QueuedItem(  # positional: a row's item builds in half the time
            next(next_id), key, tenant, row.num_tokens, now, deadline_s, finish_by_s, rank,
            weight, slo_share,
        )  # fmt: skip
        if isinstance(decision, Admitted):
            decision = batcher.add(item, now, executor_free_s=free_s, bound=bound)
        if isinstance(decision, Rejected):
            reason = decision.reason
            admission.metrics.rejected_total_of[(*lane.labels, reason.value)].inc(len(rows))
            start_s = executor_start_s(now, free_s)
            error = lane.rejection(item, decision, now, start_s)
            if refusals is not None:
                refusals.keep(ask, error, decision)
            # Refused, not cancelled: no drop counted.
            withdraw_rows(lane, item_ids, admission.metrics, drop=None)
            raise error
        pending[item.item_id] = Pending(row, outputs, index, busy_s, trace_context)
        item_ids.append(item.item_id)
    # A failed row fails its caller: the caller's rows still queued leave unrun, not counted
    # as drops (the caller is answered the failure).
    outputs.on_failed = functools.partial(
        withdraw_rows, lane, item_ids, admission.metrics, drop=None
    )
    return Admission(lane, item_ids, outputs.future)


def admit_slices(
    lane: Lane, asks: Sequence[SliceAsk], admission: AdmissionPass
) -> list[Admission | Exception]:
    """Each slice of a pass admitted whole or refused alone, its error in its place."""
    outcomes: list[Admission | Exception] = []
    for ask in asks:
        try:
            outcomes.append(admit_slice(lane, ask, admission))
        except Exception as error:
            outcomes.append(error)
    return outcomes


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
