"""The async driver around the pure batching policy.

One `BatchingDriver` per device. It owns one executor thread (the event loop never blocks on
compute), one `Batcher` + `LatencyModel` per loaded model version (a "lane"), and the futures
of queued rows. Its loop: ask each lane's batcher what to do, fail what expired, hand at most one
batch to the executor, sleep until the batcher's wake-up time or the next event. A batch that
holds the executor past the watchdog bound (batching.watchdog) stops the driver for good."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from services.common.errors import NotFound, Unavailable
from services.common.priority import DEFAULT_PRIORITY, PriorityClass
from services.common.tracing import batch_span, current_span_context
from services.common.wakeup import Wakeup
from services.gpu_worker.backends.base import Backend, PreparedRow
from services.gpu_worker.batching import watchdog
from services.gpu_worker.batching.batch_gap import BatchGap
from services.gpu_worker.batching.between_batches import BetweenBatches
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.lane import Admission, Lane, LoadReport, by_urgency
from services.gpu_worker.batching.lane_changes import new_lane, settle
from services.gpu_worker.batching.slice_admission import (
    AdmissionPass,
    Refusals,
    SliceAsk,
    admit_slices,
    batch_key,
    pass_bound,
    withdraw_slice,
)
from services.gpu_worker.batching.types import Dispatch
from services.gpu_worker.batching.warm_up import warm_up_each, warm_up_lane
from services.gpu_worker.device_busy import DeviceBusy
from services.gpu_worker.execution import MODEL_THREADS, DeviceLost, batch_threads, run_on_threads
from services.gpu_worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

__all__ = ["Admission", "BatchingDriver", "DriverConfig"]


class BatchingDriver:
    def __init__(
        self,
        backends: Sequence[Backend],
        config: DriverConfig,
        metrics: WorkerMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._clock = clock
        # One fair-share ledger for every model, version and bucket on the worker.
        self._ledger = ComputeLedger()
        self._lanes = {id(b): new_lane(b, config, metrics, self._ledger) for b in backends}
        self._order = list(self._lanes.values())
        for lane in self._order:
            lane.bind_queue_gauges(metrics, clock)
        self._executor = watchdog.DaemonExecutor("executor")
        #: The bound on one model call in force (seconds); raised after warm-up for slow models.
        self.watchdog_s = config.watchdog_s
        # Set once a call ran past the watchdog: the loop stops with it (see `_supervised`).
        self._wedged: Unavailable | None = None
        self._item_ids = itertools.count(1)
        self._wake = Wakeup()
        self._running: asyncio.Task[None] | None = None
        self._between = BetweenBatches(self._executor, self._wake, clock)
        self._gap = BatchGap(metrics.batch_gap_seconds)
        self._busy_s_total = 0.0
        self._busy_since: float | None = None
        # When the running batch is predicted to end (None: the executor is idle).
        self._running_until_s: float | None = None
        self._draining = False
        self._loop_task: asyncio.Task[None] | None = None
        self._refusal = Unavailable("worker is draining", is_not_started=True)  # once draining

    def now(self) -> float:  # the driver's clock (monotonic seconds)
        return self._clock()

    def executor_free_s(self, now: float) -> float | None:  # predicted (None: free now)
        return self._between.free_s(now, self._running_until_s)

    def warm_up(self) -> list[tuple[Backend, Exception]]:
        """Warms every lane up (warm_up_lane) on the batches' executor thread, its libraries'
        caches too; a lane whose warm-up fails is dropped, returned with its error. Blocking."""
        lanes = list(self._order)
        return self._executor.submit(warm_up_each, lanes, self._warm_up_lane, self._forget).result()

    def _warm_up_lane(self, lane: Lane, progress: watchdog.CallProgress | None = None) -> None:
        """Warms one lane up (on the executor thread) and raises the watchdog bound to suit it."""
        warm_up_lane(lane, self._metrics, progress)
        self.watchdog_s = watchdog.bound_for_lanes(self._config.watchdog_s, (*self._order, lane))
        log.info("warmed up %s/%s; executor watchdog %.1fs", *lane.labels, self.watchdog_s)

    async def add_backend(self, backend: Backend) -> None:
        """Starts batching a version loaded while serving: warmed up on the executor thread,
        between batches (warm-up and serving never share the device at once), then admitted.
        A warm-up call past WARMUP_MULTIPLE x the watchdog (a new version's calls may be slower
        than any batch served) wedges the worker as a batch's would (Unavailable)."""
        if self._wedged is not None:  # its warm-up would wait behind the wedged call for good
            raise self._wedged
        lane = new_lane(backend, self._config, self._metrics, self._ledger)
        calls = watchdog.CallProgress()
        bound_s = watchdog.WARMUP_MULTIPLE * self.watchdog_s
        try:
            await self.between_batches(self._warm_up_lane, lane, calls, watch=(bound_s, calls))
        except watchdog.WatchdogExpired:
            raise self._wedge(lane.labels, bound_s) from None
        self._lanes[id(backend)] = lane
        self._order.append(lane)  # and the bound again: a lane forgotten meanwhile left it out
        self.watchdog_s = watchdog.bound_for_lanes(self._config.watchdog_s, self._order)
        # Only now: a gauge bound to a lane whose warm-up failed would keep its model alive.
        lane.bind_queue_gauges(self._metrics, self._clock)

    async def remove_backend(self, backend: Backend) -> None:
        """Unloads a version's lane: refuses its new rows, returns once every row it admitted
        is answered, then forgets it (the caller releases its memory once it drops it too)."""
        lane = self._lanes[id(backend)]
        lane.batcher.begin_drain()
        self._wake.set()
        await settle(lane)
        self._forget(lane)

    def _forget(self, lane: Lane) -> None:  # and its queue's metric series
        del self._lanes[id(lane.backend)]
        self._order.remove(lane)
        self._metrics.forget_queue(*lane.labels)
        self.watchdog_s = watchdog.bound_for_lanes(self._config.watchdog_s, self._order)

    async def between_batches(
        self, work: Callable[..., object], *args: object, watch: watchdog.Watch | None = None
    ) -> None:
        """Runs `work` on the executor between batches (BetweenBatches.run)."""
        if self._wedged is not None:  # it would wait behind the wedged call for good
            raise self._wedged
        await self._between.run(lambda: self._running, work, *args, watch=watch)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, on_fatal: Callable[[Exception], None] | None = None) -> None:
        """Runs the batching loop. Should it die (a bug, or a model call past the watchdog; a
        failed batch fails its rows only), queued rows fail UNAVAILABLE, new ones are refused,
        and `on_fatal` is told."""
        self._loop_task = asyncio.create_task(self._supervised(on_fatal), name="batcher")

    async def _supervised(self, on_fatal: Callable[[Exception], None] | None) -> None:
        try:
            await self._loop()
        except Exception as error:
            log.critical("batching stopped: %s", error, exc_info=self._wedged is None)
            self._refusal = Unavailable(f"batching stopped here ({error})", is_not_started=True)
            self.begin_drain()
            for lane in self._order:
                lane.fail_pending(self._refusal)
            if on_fatal is not None:
                on_fatal(error)

    def begin_drain(self) -> None:  # stop admitting; queued rows dispatch at once (drain)
        self._draining = True
        for lane in self._order:
            lane.batcher.begin_drain()
        self._wake.set()

    async def drain(self) -> None:
        """Begins draining; returns once every admitted row is answered. Cancelled (the grace
        ran out), it answers the rows still waiting UNAVAILABLE (retried elsewhere now, not when
        the server closes their calls) and stops the loop."""
        self.begin_drain()
        if self._loop_task is not None and not self._loop_task.done():
            try:
                await asyncio.shield(self._loop_task)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and not task.cancelling():
                    return  # another drain, cut short, stopped the loop: nothing left to wait for
                self._refusal = Unavailable("worker stopping; retry elsewhere", is_not_started=True)
                for lane in self._order:
                    lane.fail_pending(self._refusal)
                self._loop_task.cancel()
                raise
        # A loop that died leaves work between batches (a cancelled load's warm-up) running:
        # it ends first, or the shutdown would join its thread from the event loop.
        while self._between.count and self._wedged is None:
            self._wake.clear()
            await self._wake.wait()
        # A wedged call never returns: leave its (daemon) thread behind rather than hang.
        self._executor.shutdown(wait=self._wedged is None)

    def _wedge(self, labels: tuple[str, str], bound_s: float, lost: object = None) -> Unavailable:
        """A model call of `labels` ran past `bound_s`, or its device was `lost`: the loop stops
        (counted either way: FabricWorkerWedged reads both counters)."""
        if isinstance(lost, DeviceLost):
            self._metrics.device_lost_total.labels(*labels).inc()
        else:
            self._metrics.watchdog_expired_total.labels(*labels).inc()
            lost = Unavailable(watchdog.wedged_message(labels, bound_s))
        self._wedged = lost
        self._wake.set()
        return lost

    def load_report(self, backend: Backend) -> LoadReport:
        smallest = batch_key(backend, backend.buckets[0])
        return self._lanes[id(backend)].load_report(smallest, self._clock())

    @property
    def is_executing(self) -> bool:  # a batch is on the executor now
        return self._running is not None

    @property
    def num_in_flight(self) -> int:  # admitted rows not yet answered
        return sum(not p.is_answered for lane in self._order for p in lane.pending.values())

    # -- requests --------------------------------------------------------------------------
    async def submit(
        self,
        backend: Backend,
        rows: Sequence[PreparedRow],
        *,
        timeout_s: float | None,
        tenant: str,
        priority: PriorityClass = DEFAULT_PRIORITY,
        weight: float = 0.0,
    ) -> list[np.ndarray]:
        """Queues one request's rows, all or none, and waits for their outputs, in order, by the
        caller's remaining time (else the model's default_timeout_ms) and, for a `shed_past_slo`
        model, its SLO; rows still queued are withdrawn if the caller goes away or a row fails.
        `priority` and the fair-share `weight` (0: the worker's configured one) order them."""
        admission = self.admit(
            backend, rows, timeout_s=timeout_s, tenant=tenant, priority=priority, weight=weight
        )
        try:
            return await admission.future
        finally:
            self.withdraw(admission)

    def admit(
        self,
        backend: Backend,
        rows: Sequence[PreparedRow],
        *,
        timeout_s: float | None,
        tenant: str,
        priority: PriorityClass = DEFAULT_PRIORITY,
        weight: float = 0.0,
    ) -> Admission:
        """`submit` without the wait: queues the rows (raises as `submit` does) and returns the
        future of their outputs; the caller `withdraw`s the admission once it stops waiting."""
        ask = SliceAsk(rows, timeout_s, tenant, priority, weight)
        (outcome,) = self.admit_slices(backend, [ask])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def admit_slices(
        self, backend: Backend, asks: Sequence[SliceAsk], *, arrival_s: float | None = None
    ) -> list[Admission | Exception]:
        """`admit` for a bundle's slices in one pass, what they share read once: each queued
        whole or refused alone (its error in its place). Raises what refuses all (open_lane)."""
        lane = self.open_lane(backend)
        now = self._clock() if arrival_s is None else arrival_s
        free_s = self.executor_free_s(now)
        admission = AdmissionPass(
            now=now,
            busy_s=self._busy_s(now),
            trace_context=current_span_context(),
            executor_free_s=free_s,
            item_ids=self._item_ids,
            metrics=self._metrics,
            bound=pass_bound(lane, asks, now, free_s),
            refusals=Refusals() if len(asks) > 1 else None,
        )
        outcomes = admit_slices(lane, asks, admission)
        self._wake.set()
        return outcomes

    def withdraw(self, admission: Admission) -> None:  # its rows still queued leave unrun
        withdraw_slice(admission, self._metrics)

    def open_lane(self, backend: Backend) -> Lane:
        """`backend`'s lane; NOT_FOUND once it was unloaded or while it unloads (a router tries
        another worker, and keeps this one for its other models), UNAVAILABLE while it drains."""
        lane = self._lanes.get(id(backend))
        if lane is None:
            raise NotFound(f"{backend.config.name}/{backend.version.version} was unloaded")
        if self._draining:
            raise Unavailable(str(self._refusal), is_not_started=self._refusal.is_not_started)
        if lane.batcher.is_draining:
            raise NotFound(f"{backend.config.name}/{backend.version.version} is unloading")
        return lane

    # -- the loop --------------------------------------------------------------------------
    def _busy_s(self, now: float) -> float:
        return self._busy_s_total + (0.0 if self._busy_since is None else now - self._busy_since)

    async def _loop(self) -> None:
        turns_taken = itertools.count()  # lanes come and go: rotate modulo their number now
        while True:
            if self._wedged is not None:
                raise self._wedged
            self._wake.clear()
            now = self._clock()
            is_idle = self._running is None and not self._between.count
            wake_at = self._take_turns(next(turns_taken), now, is_idle)
            is_idle = self._running is None and not self._between.count  # after a dispatch
            if self._draining and is_idle and self.num_in_flight == 0:
                return
            timeout_s = None if wake_at is None else max(0.0, wake_at - self._clock())
            # Under 1 ms waits 1 ms: uvloop's timers count whole ms (passes would spin).
            await self._wake.wait(timeout_s and max(timeout_s, 0.001))

    def _take_turns(self, turn: int, now: float, is_idle: bool) -> float | None:
        """One pass over the lanes; returns when to look again. A frame of its own: no lane
        outlives it in the sleeping loop's, where an unloaded version could not be freed."""
        start = turn % max(1, len(self._order))
        rotated = self._order[start:] + self._order[:start]
        turns = by_urgency(rotated, now) if is_idle else [(lane, False) for lane in rotated]
        wake_at: float | None = None
        for lane, force in turns:
            poll = lane.batcher.poll(now, executor_idle=is_idle, force=force)
            # The batch's rows first: an expired row fails its caller's rows still pending, and
            # a caller's rows of two buckets may have one in the batch (it then runs for no one).
            if isinstance(poll.action, Dispatch):
                self._dispatch(lane, poll.action, now)
                is_idle = False
            elif (until_s := poll.action.until_s) is not None:
                wake_at = until_s if wake_at is None else min(wake_at, until_s)
            lane.fail_expired(poll.expired, now, self.executor_free_s(now), self._metrics)
            if (gauges_at := lane.refresh_gauges(self._metrics, now)) is not None:
                wake_at = gauges_at if wake_at is None else min(wake_at, gauges_at)
        return wake_at

    def _dispatch(self, lane: Lane, dispatch: Dispatch, now: float) -> None:
        rows = lane.take_rows(dispatch, now, self._busy_s(now), self._metrics)
        self._busy_since = now
        predicted_s = lane.latency.predict(dispatch.key, len(rows))
        self._running_until_s = now + predicted_s
        self._running = asyncio.get_running_loop().create_task(
            self._execute(lane, dispatch, rows, started=now, predicted_s=predicted_s)
        )

    async def _execute(
        self,
        lane: Lane,
        dispatch: Dispatch,
        rows: list[PreparedRow],
        *,
        started: float,
        predicted_s: float,
    ) -> None:
        """Runs one batch, timed from its dispatch (`started`): a row's linger + backlog + compute
        is its latency exactly."""
        loop = asyncio.get_running_loop()
        contexts = [p.trace_context for i in dispatch.items if (p := lane.pending.get(i.item_id))]
        device_busy = DeviceBusy(lane.backend.run, lane.backend.device, self._clock)
        idle = not any(other.batcher.num_queued for other in self._order)  # explore only then
        threads = MODEL_THREADS  # till chosen: a choice that fails fails its rows, not the loop
        try:
            threads = batch_threads(
                lane.threads, dispatch, len(rows), self._config.backfill_threads,
                self._ledger.last_urgent_s, started, may_explore=idle)  # fmt: skip
            with batch_span(key=dispatch.key, close_reason=dispatch.reason.value,
                            num_rows=len(rows), requests=contexts):  # fmt: skip
                running = loop.run_in_executor(self._executor, run_on_threads, threads.count,
                                               device_busy, rows, lane.backend.device)  # fmt: skip
                results = await watchdog.within_watchdog(running, self.watchdog_s, device_busy)
        except (watchdog.WatchdogExpired, DeviceLost) as stopped:
            results = [self._wedge(lane.labels, self.watchdog_s, stopped)] * len(rows)
        except Exception as error:
            # The executor gone (shutdown), or a failed choice of threads or telemetry: each row
            # fails alone, the bookkeeping below frees the executor (UNAVAILABLE: not the model's).
            log.exception("batch of %d rows could not run", len(rows))
            refused = Unavailable(f"the batch could not run here ({type(error).__name__})")
            results = [refused] * len(rows)
        finished = self._clock()
        compute_s = finished - started
        self._busy_s_total += compute_s
        self._busy_since = self._running_until_s = self._running = None
        try:
            lane.answer(dispatch, results)  # first: nothing after it may leave a caller waiting
            self._gap.ran(device_busy, dispatch, self._order)
            busy = self._metrics.device_busy_seconds_total_of[(*lane.labels, dispatch.work)]
            busy.inc(device_busy.seconds)
            lane.record_batch(
                self._metrics, dispatch, rows, results, finished, compute_s,
                threads=threads, num_calls=device_busy.num_calls, ran_s=device_busy.ran_s,
            )  # fmt: skip
            # The batcher charged the rows' tenants the predicted compute; settle on what ran.
            self._ledger.charge_rows(dispatch.items, (device_busy.ran_s - predicted_s) / len(rows))
            lane.export_gauges_due(self._metrics, dispatch.key, finished)
        finally:
            self._wake.set()
