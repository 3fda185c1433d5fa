"""One simulated worker: the real `Batcher` and `LatencyModel`, driven as the async driver
(services/gpu_worker/batching/driver.py) drives them, on simulated time.

The driver's loop, restated for one lane: on every submit, batch completion or wake-up it polls
the batcher (`executor_idle` = nothing running), fails what expired, hands a `Dispatch` to the
executor, or sleeps until `Wait.until_s`. A submit queues the request's row with
`can_admit` then `add(..., executor_free_s=<predicted end of the running batch>)`. A finished
batch teaches the latency model its compute time, as the lane's `record_batch` does. The
executor's time is the latency curve (optionally noisy), not the prediction.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from services.common.metric_names import WORKER_SECONDS_BUCKETS
from services.common.priority import PriorityClass
from services.common.registry_schema import ModelRecord, WorkerRecord
from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.fairness import DEFAULT_WEIGHT
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.types import BatcherConfig, BatchKey, Dispatch, QueuedItem
from services.sim.curve import LatencyCurve, ServiceTime
from services.sim.events import EventLoop
from services.sim.host import SharedHost
from services.sim.traffic import Arrival

#: Weight of one row in the per-row cost EWMA of load reports (the lane's ROW_COST_ALPHA;
#: lane.py itself imports asyncio, which the simulator must not).
ROW_COST_ALPHA = 0.02

#: Shortest simulated sleep of the driver's loop. The batcher may answer `Wait(until_s)` with
#: `until_s` at or before now (an item whose expiry instant is now, by float rounding, is kept
#: until its deadline is strictly past); the real loop's clock moves on, the simulated one must.
MIN_WAKE_S = 1e-6


@dataclass(frozen=True)
class ModelSpec:
    """The slice of a model's configuration the simulated worker serves it with."""

    name: str
    version: str = "1"
    fingerprint: str = "sim"
    slo_s: float = 0.25
    max_batch_size: int = 64
    max_queue_size: int = 2048
    max_batch_tokens: int = 0
    length_buckets: tuple[int, ...] = (16,)
    shed_past_slo: bool = False
    default_timeout_s: float = 30.0

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest bucket holding `num_tokens` (longer inputs run in the last one: the
        real gateway refuses them, traffic files should not contain them)."""
        return next((b for b in self.length_buckets if b >= num_tokens), self.length_buckets[-1])

    def key(self, bucket: int) -> BatchKey:
        return BatchKey(self.name, self.version, self.fingerprint, bucket)


class SimRequest:
    """One request's journey through the simulated fleet."""

    __slots__ = (
        "arrival",
        "cell",
        "deadline_s",
        "num_attempts",
        "reservation_id",
        "tried",
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


class AnswerSink(Protocol):
    def __call__(self, now_s: float, request: SimRequest, outcome: str) -> None: ...


class SimWorker:
    """A worker process serving one model: its batcher, latency model and executor."""

    def __init__(
        self,
        worker_id: str,
        spec: ModelSpec,
        curve: LatencyCurve,
        driver: DriverConfig,
        loop: EventLoop,
        on_answer: AnswerSink,
        *,
        noise_sigma: float = 0.0,
        rng: random.Random | None = None,
        keep_batches: bool = False,
        host: SharedHost | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.spec = spec
        self._loop = loop
        self._on_answer = on_answer
        keys = {bucket: spec.key(bucket) for bucket in spec.length_buckets}
        self.latency = LatencyModel()
        curve.seed(self.latency, keys)
        self._ledger = ComputeLedger()
        config = _batcher_config(spec, driver)
        self.batcher = Batcher(config, self.latency, self._ledger)
        # Per request, only lookups: the key of each input length (one BatchKey object per
        # bucket, so the policy's dicts find it by identity), each tenant's weight as the
        # batcher would resolve it, and the shedding horizon.
        self._keys = keys
        self._key_of_tokens: dict[int, BatchKey] = {}
        self._tenant_weights = config.tenant_weights
        self._weight_of: dict[str, float] = {}
        self._shed_s = spec.slo_s - driver.upstream_budget_s if spec.shed_past_slo else None
        self._service = ServiceTime(curve.truth(keys), noise_sigma, rng or random.Random(0))
        self._driver = driver
        self._item_ids = itertools.count(1)
        self._requests: dict[int, SimRequest] = {}
        self._running: Dispatch | None = None
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
        #: The cores this worker shares with its tiers, if it shares them (host.py).
        self.host = host
        self.row_cost_s: float | None = None
        #: Every dispatched batch when `keep_batches`: (dispatch time, bucket, item ids, close
        #: reason value).
        self.batches: list[tuple[float, int, tuple[int, ...], str]] = []
        self.batch_sizes: Counter[int] = Counter()
        self.close_reasons: Counter[str] = Counter()
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
        """Queues the request's row as the driver's `_admit` does, then runs the loop once.
        Returns why it was refused, or None."""
        arrival = request.arrival
        decision: Admitted | Rejected = self.batcher.can_admit(1)
        if isinstance(decision, Admitted):
            shed_s = self._shed_s
            item = QueuedItem(
                item_id=next(self._item_ids),
                key=self._key_for(arrival.num_tokens),
                tenant=arrival.tenant,
                num_tokens=arrival.num_tokens,
                arrival_s=now_s,
                deadline_s=request.deadline_s,
                finish_by_s=None if shed_s is None else now_s + shed_s,
                priority=_rank_of(arrival.priority),
                weight=self._weight_for(arrival.tenant),
            )
            decision = self.batcher.add(item, now_s, executor_free_s=self._running_until_s)
        if isinstance(decision, Rejected):
            return decision.reason
        self._requests[item.item_id] = request
        self._busy_at_arrival[item.item_id] = self.busy_s(now_s)
        self._pump(now_s)
        return None

    def _key_for(self, num_tokens: int) -> BatchKey:
        key = self._key_of_tokens.get(num_tokens)
        if key is None:
            key = self._keys[self.spec.bucket_for(num_tokens)]
            self._key_of_tokens[num_tokens] = key
        return key

    def _weight_for(self, tenant: str) -> float:
        """The weight `Batcher.add` gives a row that carries none, as simulated requests do:
        set here, the batcher need not copy the item to fill it in."""
        weight = self._weight_of.get(tenant)
        if weight is None:
            weight = self._weight_of[tenant] = self._tenant_weights.get(tenant, DEFAULT_WEIGHT)
        return weight

    def begin_drain(self, now_s: float) -> None:
        self.batcher.begin_drain()
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
        return lost

    # -- the driver's loop -----------------------------------------------------------------

    def _pump(self, now_s: float) -> None:
        """One pass of the driver's `_loop` (a single lane)."""
        if not self.is_alive:
            return
        poll = self.batcher.poll(now_s, executor_idle=self._running is None)
        for item in poll.expired:
            self._busy_at_arrival.pop(item.item_id, None)
            request = self._requests.pop(item.item_id, None)
            if request is not None:
                self._on_answer(now_s, request, "expired")
        action = poll.action
        if isinstance(action, Dispatch):
            self._dispatch(action, now_s)
        elif action.until_s is not None:
            self._sleep_until(max(action.until_s, now_s + MIN_WAKE_S))

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

    def _dispatch(self, dispatch: Dispatch, now_s: float) -> None:
        size = len(dispatch.items)
        busy_s = self.busy_s(now_s)
        counts = self.queue_wait_counts
        for item in dispatch.items:
            wait_s = now_s - item.arrival_s
            self.queue_wait_s_total += wait_s
            counts[bisect.bisect_left(WORKER_SECONDS_BUCKETS, wait_s)] += 1
            self.backlog_s_total += busy_s - self._busy_at_arrival.pop(item.item_id, busy_s)
        self.rows_dispatched += size
        self._running = dispatch
        self._running_since_s = now_s
        self._predicted_s = self.latency.predict(dispatch.key, size)
        self._running_until_s = now_s + self._predicted_s
        if self._keep_batches:
            ids = tuple(item.item_id for item in dispatch.items)
            self.batches.append((now_s, dispatch.key.bucket, ids, dispatch.reason.value))
        self.batch_sizes[size] += 1
        self.close_reasons[dispatch.reason.value] += 1
        compute_s = self._service.seconds(dispatch.key, size)
        if self.host is not None:
            compute_s *= self.host.compute_stretch(now_s)
        self._loop.at(now_s + compute_s, self._finish, dispatch)

    def _finish(self, now_s: float, dispatch: Dispatch) -> None:
        if not self.is_alive or self._running is not dispatch:
            return
        compute_s = now_s - self._running_since_s
        self.busy_s_total += compute_s
        if self.host is not None:
            self.host.ran(now_s, compute_s)
        self.rows_total += len(dispatch.items)
        self._running = None
        self._running_until_s = None
        for item in dispatch.items:
            request = self._requests.pop(item.item_id, None)
            if request is not None:
                self._on_answer(now_s, request, "ok")
        # The batcher charged the tenants the predicted compute; settle on the real, as the
        # driver does.
        correction_s = (compute_s - self._predicted_s) / len(dispatch.items)
        for item in dispatch.items:
            self._ledger.charge(item.tenant, correction_s, item.weight)
        limit = self.batcher.max_batch_size_for(dispatch.key)
        self._record_row_cost(self.latency.per_item_s(dispatch.key, limit), len(dispatch.items))
        self.latency.observe(dispatch.key, len(dispatch.items), compute_s)
        self._pump(now_s)

    def _record_row_cost(self, per_row_s: float, num_rows: int) -> None:
        if self.row_cost_s is None:
            self.row_cost_s = per_row_s
        else:
            weight = 1.0 - (1.0 - ROW_COST_ALPHA) ** num_rows
            self.row_cost_s += weight * (per_row_s - self.row_cost_s)

    # -- reports ---------------------------------------------------------------------------

    def busy_s(self, now_s: float) -> float:
        """Executor-busy seconds so far, the running batch's share included."""
        running_s = now_s - self._running_since_s if self._running is not None else 0.0
        return self.busy_s_total + running_s

    def record(self, now_s: float, *, is_ready: bool) -> WorkerRecord:
        """The heartbeat, as services/gpu_worker/registry_publisher.py builds it."""
        spec = self.spec
        smallest = self._keys[spec.length_buckets[0]]
        per_row_s = self.row_cost_s
        if per_row_s is None:
            per_row_s = self.latency.per_item_s(smallest, self.batcher.max_batch_size_for(smallest))
        model = ModelRecord(
            name=spec.name,
            version=spec.version,
            fingerprint=spec.fingerprint,
            tokenizer_fingerprint=spec.fingerprint,
            kind="embedding",
            max_batch_size=spec.max_batch_size,
            slo_p99_ms=round(spec.slo_s * 1000),
            per_row_s=per_row_s,
            min_batch_s=self.latency.predict(smallest, 1),
            queued_rows=self.batcher.num_queued,
            is_ready=is_ready and not self.batcher.is_draining,
            shed_past_slo=spec.shed_past_slo,
        )
        return WorkerRecord(
            worker_id=self.worker_id,
            address=self.worker_id,
            is_draining=self.batcher.is_draining,
            sent_at_ms=int(now_s * 1000),
            models=(model,),
        )


def _batcher_config(spec: ModelSpec, driver: DriverConfig) -> BatcherConfig:
    """The batcher's settings, as the driver's `_lane_for` builds them."""
    return BatcherConfig(
        max_batch_size=spec.max_batch_size,
        max_queue_size=spec.max_queue_size,
        slo_s=spec.slo_s,
        upstream_budget_s=driver.upstream_budget_s,
        safety_margin_s=driver.safety_margin_s,
        max_wait_cap_s=driver.max_wait_cap_s,
        max_batch_tokens=spec.max_batch_tokens,
        min_expected_arrivals=driver.min_expected_arrivals,
        tenant_weights=driver.tenant_weights,
    )


@functools.cache
def _rank_of(priority: str) -> int:
    """The batcher's rank of a priority class name (ValueError for an unknown name); cached:
    parsed once per name, not once per request."""
    return PriorityClass.parse(priority).rank
