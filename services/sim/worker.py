"""One simulated worker: the real `Batcher` and `LatencyModel` of each model it serves, driven
as the async driver (services/gpu_worker/batching/driver.py) drives them, on simulated time.

The worker holds one lane per model (lane.py); the lanes share one executor (one batch runs at
a time on the worker) and one fair-share `ComputeLedger`. The driver's loop, restated: on every
submit, batch completion or wake-up it takes a pass over the lanes, rotated by one each pass and,
with the executor idle, ordered by `by_urgency`; it polls each lane's batcher (`executor_idle`:
nothing running and nothing dispatched earlier in the pass; `force` from `by_urgency`), fails
what expired, hands a `Dispatch` to the executor, and sleeps until the earliest `Wait.until_s`.
A submit queues the request's row in its model's lane with `can_admit` then
`add(..., executor_free_s=<predicted end of the running batch>)`. A finished batch teaches its
lane's latency model its compute time, as the lane's `record_batch` does. The executor's time
is the lane's latency curve (optionally noisy), not the prediction.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from services.common.fair_rows import DEFAULT_WEIGHT
from services.common.metric_names import WORKER_SECONDS_BUCKETS
from services.common.priority import PriorityClass
from services.common.registry_schema import ModelRecord, WorkerRecord
from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.lane_order import by_urgency
from services.gpu_worker.batching.policy import executor_start_s
from services.gpu_worker.batching.slo_shedding import expiry_reason
from services.gpu_worker.batching.types import Dispatch, QueuedItem
from services.sim.curve import LatencyCurve
from services.sim.events import EventLoop
from services.sim.host import SharedHost
from services.sim.lane import ModelSpec, SimLane
from services.sim.traffic import Arrival

__all__ = ["MIN_WAKE_S", "AnswerSink", "ModelSpec", "SimRequest", "SimWorker"]

#: Shortest simulated sleep of the driver's loop. The batcher may answer `Wait(until_s)` with
#: `until_s` at or before now (an item whose expiry instant is now, by float rounding, is kept
#: until its deadline is strictly past); the real loop's clock moves on, the simulated one must.
MIN_WAKE_S = 1e-6


class SimRequest:
    """One request's journey through the simulated fleet."""

    __slots__ = (
        "arrival",
        "cell",
        "deadline_s",
        "num_attempts",
        "reservation_id",
        "tiers_s",
        "tried",
        "upstream_s",
        "worker_id",
    )

    def __init__(self, arrival: Arrival, deadline_s: float) -> None:
        self.arrival = arrival
        self.deadline_s = deadline_s
        self.reservation_id = 0
        self.worker_id = ""
        self.tried: frozenset[str] = frozenset()
        self.num_attempts = 0
        #: The router cell that routes it.
        self.cell = 0
        #: How long its last trip from the router to a worker took.
        self.upstream_s = 0.0
        #: Seconds its last attempt spent in the gateways' and routers' CPU queues before
        #: the router decided (tier_queues.py; 0 without tier costs).
        self.tiers_s = 0.0


class AnswerSink(Protocol):
    def __call__(self, now_s: float, request: SimRequest, outcome: str) -> None: ...


class SimWorker:
    """A worker process serving one or more models: a lane per model, one executor."""

    def __init__(
        self,
        worker_id: str,
        models: Sequence[tuple[ModelSpec, LatencyCurve]],
        driver: DriverConfig,
        loop: EventLoop,
        on_answer: AnswerSink,
        *,
        noise_sigma: float = 0.0,
        rng: random.Random | None = None,
        keep_batches: bool = False,
        host: SharedHost | None = None,
    ) -> None:
        if not models:
            raise ValueError("a worker serves at least one model")
        self.worker_id = worker_id
        self._loop = loop
        self._on_answer = on_answer
        # One ledger for every lane: fair share across models, and the worker-wide time of
        # the last urgent row (backfill width), as the driver shares its ledger.
        self._ledger = ComputeLedger()
        # The executor's noise is one stream of draws, whichever lane's batch runs.
        service_rng = rng or random.Random(0)
        #: The lanes, in the order the driver's loop starts its rotation from.
        self.lanes = [
            SimLane(spec, curve, driver, self._ledger, noise_sigma=noise_sigma, rng=service_rng)
            for spec, curve in models
        ]
        self._lane_of = {lane.spec.name: lane for lane in self.lanes}
        if len(self._lane_of) != len(self.lanes):
            raise ValueError(f"two lanes of one model: {[lane.spec.name for lane in self.lanes]}")
        # The driver's `turns_taken`: the loop's passes so far (the rotation's start).
        self._num_passes = 0
        # A single lane's every pass: no rotation, no ordering (by_urgency's answer for one).
        self._only_turn = ((self.lanes[0], False),) if len(self.lanes) == 1 else None
        # Each tenant's weight as the batcher would resolve it (the same for every lane).
        self._tenant_weights = driver.tenant_weights
        self._weight_of: dict[str, float] = {}
        self._item_ids = itertools.count(1)
        self._requests: dict[int, SimRequest] = {}
        self._running: Dispatch | None = None
        self._running_lane: SimLane | None = None
        self._running_until_s: float | None = None
        self._predicted_s = 0.0
        self._running_since_s = 0.0
        # The driver's timer: it wakes at `_wake_s` (None: none set). Setting it schedules a
        # loop event only if none of this worker's pending ones is due by then; one due
        # earlier re-arms itself when it runs. `_wake_entries_s`: the pending events' times,
        # each pushed below all the others (the last is the earliest). So a Wait (one per
        # submit while a batch runs) leaves no stale event behind to pop.
        self._wake_s: float | None = None
        self._wake_entries_s: list[float] = []
        self.is_alive = True
        self.is_draining = False
        #: The cores this worker shares with its tiers, if it shares them (host.py).
        self.host = host
        #: Every dispatched batch when `keep_batches`: (dispatch time, bucket, item ids, close
        #: reason value).
        self.batches: list[tuple[float, int, tuple[int, ...], str]] = []
        self.batch_sizes: Counter[int] = Counter()
        self.close_reasons: Counter[str] = Counter()
        #: Rows run to the end of their batch, by model.
        self.rows_by_model: Counter[str] = Counter()
        #: Cumulative executor-busy seconds, rows run and their total queue wait (seconds).
        self.busy_s_total = 0.0
        self.rows_total = 0
        self.queue_wait_s_total = 0.0
        #: Rows by queue wait, in the worker histogram's buckets (+Inf last): what the
        #: deployed HPA's p90 is interpolated from.
        self.queue_wait_counts = [0] * (len(WORKER_SECONDS_BUCKETS) + 1)
        #: Rows dispatched, and the part of their queue wait spent behind other batches (the
        #: driver's backlog: executor-busy seconds between arrival and dispatch). The rest of
        #: the wait is linger, which the batcher chooses and more workers do not shorten.
        self.rows_dispatched = 0
        self.backlog_s_total = 0.0
        self._busy_at_arrival: dict[int, float] = {}
        self._keep_batches = keep_batches

    # -- requests --------------------------------------------------------------------------

    def submit(self, request: SimRequest, now_s: float) -> RejectReason | None:
        """Queues the request's row in its model's lane as the driver's `_admit` does, then
        runs the loop once. Returns why it was refused, or None. KeyError for a model the
        worker does not serve (the router only sends it models it heartbeats)."""
        arrival = request.arrival
        lane = self._lane_of[arrival.model]
        batcher = lane.batcher
        decision: Admitted | Rejected = batcher.can_admit(1, tenant=arrival.tenant, now_s=now_s)
        if isinstance(decision, Admitted):
            priority = _rank_of(arrival.priority)
            shed_s = lane.shedding.budget_s(now_s, priority, batcher.num_queued)
            key = lane.key_for(arrival.num_tokens)
            item = QueuedItem(
                item_id=next(self._item_ids),
                key=key,
                tenant=arrival.tenant,
                num_tokens=arrival.num_tokens,
                arrival_s=now_s,
                deadline_s=request.deadline_s,
                finish_by_s=None if shed_s is None else now_s + shed_s,
                priority=priority,
                weight=self._weight_for(arrival.tenant),
                slo_share=lane.shedding.slo_share(lane.latency, key),
            )
            decision = batcher.add(item, now_s, executor_free_s=self._running_until_s)
        if isinstance(decision, Rejected):
            if decision.reason is RejectReason.DEADLINE:
                start_s = executor_start_s(now_s, self._running_until_s)
                finish_s = batcher.predicted_finish_s(item.key, start_s)
                lane.shedding.refused(now_s, item, finish_s, lane.latency)
            return decision.reason
        self._requests[item.item_id] = request
        self._busy_at_arrival[item.item_id] = self.busy_s(now_s)
        self._pump(now_s)
        return None

    def _weight_for(self, tenant: str) -> float:
        """The weight `Batcher.add` gives a row that carries none, as simulated requests do:
        set here, the batcher need not copy the item to fill it in."""
        weight = self._weight_of.get(tenant)
        if weight is None:
            weight = self._weight_of[tenant] = self._tenant_weights.get(tenant, DEFAULT_WEIGHT)
        return weight

    def begin_drain(self, now_s: float) -> None:
        self.is_draining = True
        for lane in self.lanes:
            lane.batcher.begin_drain()
        self._pump(now_s)

    @property
    def is_drained(self) -> bool:
        return self._running is None and not self._requests

    def kill(self, now_s: float) -> list[SimRequest]:
        """The process dies: returns every request it held (their calls fail UNAVAILABLE)."""
        self.is_alive = False
        self._wake_s = None
        lost = list(self._requests.values())
        self._requests.clear()
        self._busy_at_arrival.clear()
        self._running = None
        self._running_lane = None
        return lost

    # -- the driver's loop -----------------------------------------------------------------

    def _pump(self, now_s: float) -> None:
        """One pass of the driver's `_loop`. A pass that dispatches and waits on no lane
        leaves the timer as it was (an earlier wake-up polls once more, to no effect but a
        Wait); one that waits sets it to the earliest lane's wake-up."""
        if not self.is_alive:
            return
        is_idle = self._running is None
        turns: Sequence[tuple[SimLane, bool]] | None = self._only_turn
        if turns is None:
            lanes = self.lanes
            start = self._num_passes % len(lanes)
            self._num_passes += 1
            rotated = lanes[start:] + lanes[:start]
            turns = by_urgency(rotated, now_s) if is_idle else [(lane, False) for lane in rotated]
        wake_s: float | None = None
        for lane, force in turns:
            poll = lane.batcher.poll(now_s, executor_idle=is_idle, force=force)
            for item in poll.expired:
                self._busy_at_arrival.pop(item.item_id, None)
                request = self._requests.pop(item.item_id, None)
                if request is not None:
                    finish_s = now_s + lane.latency.predict_alone(item.key)
                    self._on_answer(now_s, request, expiry_reason(item, finish_s))
            action = poll.action
            if isinstance(action, Dispatch):
                self._dispatch(lane, action, now_s)
                is_idle = False
            elif action.until_s is not None:
                wake_s = action.until_s if wake_s is None else min(wake_s, action.until_s)
        if wake_s is not None:
            self._sleep_until(max(wake_s, now_s + MIN_WAKE_S))

    def _sleep_until(self, wake_s: float) -> None:
        """Sets the timer (replacing any set before, as the driver's next sleep does)."""
        self._wake_s = wake_s
        entries_s = self._wake_entries_s
        if not entries_s or entries_s[-1] > wake_s:
            entries_s.append(wake_s)
            self._loop.at(wake_s, self._wake)

    def _wake(self, now_s: float, _: object) -> None:
        # Events run in time order, so the one running is this worker's earliest pending.
        self._wake_entries_s.pop()
        wake_s = self._wake_s
        if wake_s is None:
            return
        if now_s < wake_s:
            self._sleep_until(wake_s)
            return
        self._wake_s = None
        self._pump(now_s)

    def _dispatch(self, lane: SimLane, dispatch: Dispatch, now_s: float) -> None:
        size = len(dispatch.items)
        busy_s = self.busy_s(now_s)
        counts = self.queue_wait_counts
        for item in dispatch.items:
            wait_s = now_s - item.arrival_s
            self.queue_wait_s_total += wait_s
            counts[bisect.bisect_left(WORKER_SECONDS_BUCKETS, wait_s)] += 1
            self.backlog_s_total += busy_s - self._busy_at_arrival.pop(item.item_id, busy_s)
        lane.shedding.after_dispatch(now_s, lane.batcher.oldest_urgent_wait_s(now_s))
        self.rows_dispatched += size
        self._running = dispatch
        self._running_lane = lane
        self._running_since_s = now_s
        self._predicted_s = lane.latency.predict(dispatch.key, size)
        self._running_until_s = now_s + self._predicted_s
        if self._keep_batches:
            ids = tuple(item.item_id for item in dispatch.items)
            self.batches.append((now_s, dispatch.key.bucket, ids, dispatch.reason.value))
        self.batch_sizes[size] += 1
        self.close_reasons[dispatch.reason.value] += 1
        compute_s = lane.service.seconds(dispatch.key, size)
        if self.host is not None:
            compute_s *= self.host.compute_stretch(now_s)
        self._loop.at(now_s + compute_s, self._finish, dispatch)

    def _finish(self, now_s: float, dispatch: Dispatch) -> None:
        lane = self._running_lane
        if not self.is_alive or self._running is not dispatch or lane is None:
            return
        compute_s = now_s - self._running_since_s
        self.busy_s_total += compute_s
        num_rows = len(dispatch.items)
        self.rows_total += num_rows
        self.rows_by_model[lane.spec.name] += num_rows
        self._running = None
        self._running_lane = None
        self._running_until_s = None
        for item in dispatch.items:
            request = self._requests.pop(item.item_id, None)
            if request is not None:
                self._on_answer(now_s, request, "ok")
        # The batcher charged the tenants the predicted compute; settle on the real, as the
        # driver does.
        self._ledger.charge_rows(dispatch.items, (compute_s - self._predicted_s) / num_rows)
        limit = lane.batcher.max_batch_size_for(dispatch.key)
        lane.record_row_cost(lane.latency.per_item_s(dispatch.key, limit), num_rows)
        lane.latency.observe(dispatch.key, num_rows, compute_s)
        self._pump(now_s)

    # -- reports ---------------------------------------------------------------------------

    def busy_s(self, now_s: float) -> float:
        """Executor-busy seconds so far, the running batch's share included."""
        running_s = now_s - self._running_since_s if self._running is not None else 0.0
        return self.busy_s_total + running_s

    def record(self, now_s: float, *, is_ready: bool) -> WorkerRecord:
        """The heartbeat, as services/gpu_worker/registry_publisher.py builds it: one model
        record per lane."""
        return WorkerRecord(
            worker_id=self.worker_id,
            address=self.worker_id,
            is_draining=self.is_draining,
            sent_at_ms=int(now_s * 1000),
            models=tuple(self._model_record(lane, is_ready=is_ready) for lane in self.lanes),
        )

    def _model_record(self, lane: SimLane, *, is_ready: bool) -> ModelRecord:
        spec, latency, batcher = lane.spec, lane.latency, lane.batcher
        smallest = lane.keys[spec.length_buckets[0]]
        per_row_s = lane.row_cost_s
        if per_row_s is None:
            per_row_s = latency.per_item_s(smallest, batcher.max_batch_size_for(smallest))
        return ModelRecord(
            name=spec.name,
            version=spec.version,
            fingerprint=spec.fingerprint,
            tokenizer_fingerprint=spec.fingerprint,
            kind="embedding",
            max_batch_size=spec.max_batch_size,
            slo_p99_ms=round(spec.slo_s * 1000),
            per_row_s=per_row_s,
            min_batch_s=latency.predict_alone(smallest),
            queued_rows=batcher.num_queued,
            is_ready=is_ready and not batcher.is_draining,
            shed_past_slo=spec.shed_past_slo,
        )


@functools.cache
def _rank_of(priority: str) -> int:
    """The batcher's rank of a priority class name (ValueError for an unknown name); cached:
    parsed once per name, not once per request."""
    return PriorityClass.parse(priority).rank
