"""A lane of the batching driver: one loaded model version's batcher, latency model and
queued rows, the load report routers read from it, and its warm-up."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from services.common.errors import DeadlineExceeded, ExecutionFailed, Overloaded, Unavailable
from services.common.priority import PriorityClass
from services.common.telemetry import observe_counts
from services.common.tracing import TraceContext
from services.gpu_worker.admission import Rejected, RejectReason
from services.gpu_worker.backends.base import Backend, PreparedRow
from services.gpu_worker.batching.failure_streak import FailureStreak
from services.gpu_worker.batching.lane_order import by_urgency
from services.gpu_worker.batching.latency_model import LatencyModel, folded_row_cost
from services.gpu_worker.batching.policy import Batcher, executor_start_s
from services.gpu_worker.batching.slice_outputs import SliceOutputs
from services.gpu_worker.batching.slo_shedding import PAST_SLO, SloShedding, expiry_reason
from services.gpu_worker.batching.types import BATCH_RANK, BatchKey, Dispatch, QueuedItem
from services.gpu_worker.execution import MODEL_THREADS, BatchThreads, describe_failure, note_batch
from services.gpu_worker.metrics import WorkerMetrics
from services.gpu_worker.thread_choice import ThreadChoice

__all__ = [
    "Admission",
    "BatchTotals",
    "Lane",
    "LoadReport",
    "Pending",
    "by_urgency",
]

#: Rows at this priority rank or more urgent are online traffic; the rest is `batch` backlog.
_URGENT_RANK = PriorityClass.INTERACTIVE.rank
#: Most seconds between refreshes of a key's linger and batch-size gauges while it serves.
GAUGE_PERIOD_S = 0.1


@dataclass(slots=True)
class Pending:
    """Driver-side state of one queued row (slotted: one is built per queued row)."""

    row: PreparedRow
    #: The outputs of the row's caller, and the row's place among them.
    outputs: SliceOutputs
    index: int
    #: Cumulative executor-busy seconds when the row was queued; the difference at dispatch is
    #: the row's backlog, the rest of its wait is linger.
    busy_s_at_arrival: float
    #: The submitting request's span, which the batch span running this row links to.
    trace_context: TraceContext

    @property
    def is_answered(self) -> bool:
        return self.outputs.is_answered(self.index)


@dataclass
class BatchTotals:
    """A lane's cumulative figures since the worker started (Triton's model statistics)."""

    executions: int = 0
    rows: int = 0
    #: Sum over dispatched rows of their wait in the queue (linger + backlog), seconds.
    queue_s: float = 0.0
    #: Sum over batches of their compute, seconds.
    compute_s: float = 0.0

    def record_batch(self, num_rows: int, compute_s: float) -> None:
        self.executions += 1
        self.rows += num_rows
        self.compute_s += compute_s

    def copy(self) -> BatchTotals:
        return dataclasses.replace(self)


@dataclass(frozen=True)
class LoadReport:
    """What routers need to predict a version's wait on this worker (sent in heartbeats)."""

    #: Rows queued above priority `batch` (what an online arrival waits behind).
    queued_rows: int
    #: Predicted compute per row at full batches, averaged over recent traffic's buckets: the
    #: marginal cost of queued work.
    per_row_s: float
    #: Predicted compute of one row of the smallest bucket alone: the floor of any request's
    #: latency.
    min_batch_s: float
    totals: BatchTotals = field(default_factory=BatchTotals)
    #: Rows of priority `batch` queued (only `batch` arrivals wait behind them).
    queued_batch_rows: int = 0
    #: Its batches all fail here lately (failure_streak.py): routers prefer other workers.
    is_failing: bool = False


class Admission(NamedTuple):
    """The rows of one request queued on the driver (`BatchingDriver.admit`). A named tuple:
    one is built per caller, and a frozen dataclass builds three times as slowly."""

    lane: Lane
    item_ids: list[int]
    #: The rows' outputs, in the request's order (SliceOutputs).
    future: asyncio.Future[list[np.ndarray]]


@dataclass
class Lane:
    backend: Backend
    batcher: Batcher
    latency: LatencyModel
    #: When new rows must finish within the SLO, not just their deadline (slo_shedding.py).
    shedding: SloShedding
    #: Whether its batches all fail lately (told routers in `load_report`).
    failures: FailureStreak
    pending: dict[int, Pending] = field(default_factory=dict)
    #: The batch key of each bucket (its backend's), built at the bucket's first row.
    keys: dict[int, BatchKey] = field(default_factory=dict)
    #: EWMA over dispatched rows of the predicted per-row cost of their key at full batches:
    #: the marginal cost of a row of this lane's traffic mix, for load reports. None until the
    #: first batch.
    row_cost_s: float | None = None
    #: Compute of the lane's costliest warm-up shape, seconds (the faster of its runs, as the
    #: latency model is seeded): the scale of the executor watchdog's bound.
    slowest_warmup_s: float = 0.0
    totals: BatchTotals = field(default_factory=BatchTotals)
    #: The torch threads of each batch, measured per size (execution.batch_threads); None
    #: where their count is not the lane's to choose (a GPU, a stand-in, one thread).
    threads: ThreadChoice | None = None
    #: When each key's linger and batch-size gauges are next refreshed (`export_gauges_due`).
    gauges_due_s: dict[BatchKey, float] = field(default_factory=dict)
    #: Keys whose last batch skipped the refresh: refreshed when due (`refresh_gauges`).
    stale_gauges: set[BatchKey] = field(default_factory=set)

    @functools.cached_property
    def labels(self) -> tuple[str, str]:
        """(model, version): the lane's backend never changes."""
        return (self.backend.config.name, self.backend.version.version)

    def fail_pending(self, error: Exception) -> None:
        """Fails every row still waiting for its output with `error`."""
        for pending in list(self.pending.values()):  # a failed caller's rows leave it
            pending.outputs.fail(error)

    def fail_expired(
        self,
        expired: Sequence[QueuedItem],
        now_s: float,
        executor_free_s: float | None,
        metrics: WorkerMetrics,
    ) -> None:
        """Answers rows the batcher dropped unrun at `now_s` (the executor predicted free at
        `executor_free_s`, None: idle): past their deadline DEADLINE_EXCEEDED; past the SLO
        bound admission set, their deadline still allowing them, RESOURCE_EXHAUSTED with a
        retry hint, as admission refuses."""
        for item in expired:
            alone_s = self.latency.predict_alone(item.key)
            reason = expiry_reason(item, now_s + alone_s)
            pending = self.pending.get(item.item_id)
            if pending is not None and not pending.is_answered:
                if reason == PAST_SLO:
                    start_s = executor_start_s(now_s, executor_free_s)
                    finish_s = self.batcher.predicted_finish_s(
                        item.key, start_s, rank=item.priority, of=item
                    )
                    error: Exception = Overloaded(
                        f"{item.key.model}/{item.key.version}: could no longer finish within"
                        f" its SLO (run alone, {alone_s * 1000:.0f} ms from now at the"
                        " soonest); not run",
                        retry_after_s=finish_s - now_s,
                    )
                else:
                    error = DeadlineExceeded("deadline cannot be met; the request was not run")
                pending.outputs.fail(error)
            metrics.dropped_total_of[(*self.labels, reason)].inc()

    def record_row_cost(self, per_row_s: float, num_rows: int) -> None:
        """Folds a dispatched batch into `row_cost_s` (a batch of n rows weighs n rows)."""
        self.row_cost_s = folded_row_cost(self.row_cost_s, per_row_s, num_rows)

    def slo_share(self, key: BatchKey) -> float:
        """The share of its SLO a new row of `key` may fill (SloShedding.slo_share)."""
        return self.shedding.slo_share(self.latency, key)

    def rejection(
        self, item: QueuedItem, refusal: Rejected, now_s: float, start_s: float
    ) -> Exception:
        """The error a row refused so gets; `start_s` is when the executor frees. A row
        refused as predicted late is told to the lane's SLO shedding, where it may hold a
        standing queue (SloShedding.refused). The refusal's detail, when it has one, says
        which limit or room refused it."""
        key, reason = item.key, refusal.reason
        if reason is RejectReason.DRAINING:
            return Unavailable("worker is draining")
        max_batch_size = self.batcher.max_batch_size_for(key)
        backlog_s = self.latency.per_item_s(key, max_batch_size) * self.batcher.num_queued
        if reason is RejectReason.TENANT_SHARE:
            # Unnamed: a bundle refused whole gives its first caller's refusal to every caller.
            return Overloaded(
                f"{key.model}/{key.version}: the queue is contended and this call's tenant, or"
                " that of a call bundled with it, already holds its fair share of it",
                retry_after_s=backlog_s,
            )
        if reason is RejectReason.DEADLINE:
            # As its refusal priced it: the rows that run before it (batch-class rows run
            # after an online one), its fair share of other tenants'.
            finish_s = self.batcher.predicted_finish_s(key, start_s, rank=item.priority, of=item)
            self.shedding.refused(now_s, item, finish_s, self.latency)
            if refusal.detail:  # a limit not the row's own (policy.PAST_BATCH_MATES)
                past = refusal.detail
            elif item.is_slo_bound:
                past = f"past its SLO (admitted within {item.admission_limit_s - now_s:.3f}s)"
            else:
                past = "past the request's deadline"
            return Overloaded(
                f"{key.model}/{key.version}: predicted to finish {finish_s - now_s:.3f}s from"
                f" now, {past}",
                retry_after_s=finish_s - now_s,
            )
        why = f": {refusal.detail}" if refusal.detail else ""
        return Overloaded(
            f"{key.model}/{key.version} queue is full ({self.batcher.num_queued} rows){why}",
            retry_after_s=backlog_s,
        )

    def load_report(self, smallest: BatchKey, now_s: float) -> LoadReport:
        """What routers read of this lane at `now_s`; `smallest` is its smallest bucket's key."""
        per_row_s = self.row_cost_s
        if per_row_s is None:
            per_row_s = self.latency.per_item_s(smallest, self.batcher.max_batch_size_for(smallest))
        urgent_rows = self.batcher.queued_at_most(_URGENT_RANK)
        return LoadReport(
            queued_rows=urgent_rows,
            per_row_s=per_row_s,
            min_batch_s=self.latency.predict_alone(smallest),
            totals=self.totals.copy(),
            queued_batch_rows=self.batcher.num_queued - urgent_rows,
            is_failing=self.failures.is_failing(now_s),
        )

    def export_gauges_due(self, metrics: WorkerMetrics, key: BatchKey, now_s: float) -> None:
        """`export_gauges` after a batch of `key` at `now_s`, at most every GAUGE_PERIOD_S:
        a scrape every few seconds reads them, and each costs a worker of many small batches
        two predictions a batch."""
        if now_s >= self.gauges_due_s.get(key, now_s):
            self.gauges_due_s[key] = now_s + GAUGE_PERIOD_S
            self.stale_gauges.discard(key)
            self.export_gauges(metrics, key)
        else:
            self.stale_gauges.add(key)

    def refresh_gauges(self, metrics: WorkerMetrics, now_s: float) -> float | None:
        """Refreshes the gauges a batch skipped once they are due (a burst's last batches
        must not leave them stale until the key's next batch, maybe hours later); returns
        when the next still stale one is due (None: none is)."""
        if not self.stale_gauges:
            return None
        for key in [k for k in self.stale_gauges if now_s >= self.gauges_due_s[k]]:
            self.export_gauges_due(metrics, key, now_s)
        return min((self.gauges_due_s[k] for k in self.stale_gauges), default=None)

    def export_gauges(self, metrics: WorkerMetrics, key: BatchKey) -> None:
        """The linger and batch size the batcher allows `key` now."""
        labels = (*self.labels, str(key.bucket))
        metrics.max_wait_seconds_of[labels].set(self.batcher.max_wait_s(key))
        metrics.max_batch_size_of[labels].set(self.batcher.max_batch_size_for(key))

    def take_rows(
        self, dispatch: Dispatch, now_s: float, busy_s: float, metrics: WorkerMetrics
    ) -> list[PreparedRow]:
        """The rows of a batch being dispatched, each one's wait observed: its backlog (the
        executor's busy time since it arrived) and its linger (the rest). The rows of one
        slice arrived together and share their wait: it is counted once per slice, for each of
        its rows, and each histogram is written once for the batch. The queue wait, the
        autoscaling signal, is online rows': `batch` rows wait behind them on purpose, and
        must not scale workers up (their backlog is `queued_batch_rows`)."""
        rows = []
        # (arrival, executor busy seconds at arrival, whether batch-class) -> rows: per slice.
        arrivals: dict[tuple[float, float, bool], int] = {}
        for item in dispatch.items:
            pending = self.pending[item.item_id]
            arrival = (item.arrival_s, pending.busy_s_at_arrival, item.priority >= BATCH_RANK)
            arrivals[arrival] = arrivals.get(arrival, 0) + 1
            rows.append(pending.row)
        backlogs, lingers, waits = [], [], []
        for (arrival_s, busy_s_at_arrival, is_batch), count in arrivals.items():
            backlog_s = busy_s - busy_s_at_arrival
            wait_s = now_s - arrival_s
            backlogs.append((backlog_s, count))
            lingers.append((max(0.0, wait_s - backlog_s), count))
            if not is_batch:
                waits.append((wait_s, count))
            self.totals.queue_s += wait_s * count
        labels = self.labels
        observe_counts(metrics.backlog_seconds_of[labels], backlogs)
        observe_counts(metrics.linger_seconds_of[labels], lingers)
        observe_counts(metrics.queue_wait_seconds_of[labels], waits)
        self.shedding.after_dispatch(now_s, self.batcher.oldest_urgent_wait_s(now_s))
        return rows

    def bind_queue_gauges(self, metrics: WorkerMetrics, clock: Callable[[], float]) -> None:
        """Rows queued, whether the queue stands (only while rows are queued) and whether the
        version is failing (by `clock`), read when metrics are scraped: nothing on the per-row
        path keeps them up to date."""
        metrics.queue_depth.labels(*self.labels).set_function(lambda: self.batcher.num_queued)
        metrics.queue_standing.labels(*self.labels).set_function(lambda: self._stands(clock()))
        failing = metrics.model_failing.labels(*self.labels)
        failing.set_function(lambda: int(self.failures.is_failing(clock())))

    def _stands(self, now_s: float) -> int:
        """Whether the queue stands as shedding reads it (StandingQueue.stands_at), with rows."""
        return int(self.shedding.queue.stands_at(now_s) and self.batcher.num_queued > 0)

    def answer(self, dispatch: Dispatch, results: Sequence[np.ndarray | Exception]) -> None:
        """Hands each row of a finished batch its output or its failure, and forgets the row
        (a slice all of whose rows are answered so has nothing left to withdraw)."""
        for item, result in zip(dispatch.items, results, strict=True):
            pending = self.pending.pop(item.item_id, None)
            if pending is None:
                continue  # the caller went away while the batch ran
            if isinstance(result, Unavailable):
                pending.outputs.fail(result)
            elif isinstance(result, Exception):
                pending.outputs.fail(ExecutionFailed(describe_failure(result)))
            else:
                pending.outputs.answer(pending.index, result)

    def record_batch(
        self,
        metrics: WorkerMetrics,
        dispatch: Dispatch,
        rows: list[PreparedRow],
        results: list[np.ndarray | Exception],
        finished: float,
        compute_s: float,
        *,
        threads: BatchThreads = MODEL_THREADS,
        num_calls: int = 1,
        ran_s: float | None = None,
    ) -> None:
        """Folds a finished batch into the lane's totals, latency model, thread choice and
        `metrics`: `compute_s` from its dispatch to the loop's reading of its end (what its rows
        waited), `ran_s` its time on the executor (DeviceBusy.ran_s; None: `compute_s`), what the
        latency model and the thread choice learn from. A batch that ran on a count of threads other
        than the lane's usual one (`threads.teaches_latency` False: a backfill held short, a sample
        or an exploration of a count other than the cheapest so far) teaches the latency model
        nothing: its time says nothing of how the lane's batches run. Nor does one bisected
        (`num_calls` model calls, not one), even if every row then succeeded (a failure of its size,
        out of memory at full width)."""
        labels, lane = self.labels, self
        lane.totals.record_batch(len(rows), compute_s)
        row_share_s = compute_s / len(rows)
        observe_counts(metrics.row_compute_seconds_of[labels], ((compute_s, len(rows)),))
        rows_by_tenant: dict[str, int] = {}
        rows_by_arrival: dict[float, int] = {}
        for item in dispatch.items:
            rows_by_tenant[item.tenant] = rows_by_tenant.get(item.tenant, 0) + 1
            rows_by_arrival[item.arrival_s] = rows_by_arrival.get(item.arrival_s, 0) + 1
        observe_counts(  # one pair per slice of the batch
            metrics.row_latency_seconds_of[labels],
            ((finished - arrival_s, count) for arrival_s, count in rows_by_arrival.items()),
        )
        for tenant, count in rows_by_tenant.items():  # once per tenant of the batch
            metrics.charge_tenant(tenant, compute_s=row_share_s * count)
        limit = lane.batcher.max_batch_size_for(dispatch.key)
        lane.record_row_cost(lane.latency.per_item_s(dispatch.key, limit), len(rows))
        bucket = str(dispatch.key.bucket)
        failures = sum(isinstance(r, Exception) for r in results)
        note_batch(lane.failures, labels, results, failures, finished)
        if failures == 0 and num_calls == 1:
            # A bisected batch's time says nothing about the model's normal cost.
            taught_s = compute_s if ran_s is None else ran_s
            threads.record(taught_s)
            if threads.teaches_latency:
                lane.latency.observe(dispatch.key, len(rows), taught_s)
                metrics.latency_slowdown_of[labels].set(lane.latency.slowdown(dispatch.key))
                metrics.latency_spread_of[labels].set(lane.latency.spread(dispatch.key))
        else:
            metrics.row_failures_total_of[labels].inc(failures)
        tokens = [row.num_tokens for row in rows]
        # Buckets grow with length: the shortest and longest rows tell whether buckets mixed.
        if lane.backend.bucket_for(min(tokens)) != lane.backend.bucket_for(max(tokens)):
            metrics.mixed_bucket_batches_total_of[labels].inc()
        real_tokens = sum(tokens)
        padded_tokens = max(tokens) * len(rows)
        by_bucket = (*labels, bucket)
        metrics.batches_total_of[(*by_bucket, dispatch.reason.value)].inc()
        metrics.batch_size_of[by_bucket].observe(len(rows))
        metrics.batch_fill_ratio_of[labels].observe(len(rows) / limit)
        metrics.padding_waste_ratio_of[by_bucket].observe(1.0 - real_tokens / padded_tokens)
        metrics.compute_seconds_of[by_bucket].observe(compute_s)
        metrics.rows_total_of[labels].inc(len(rows))
