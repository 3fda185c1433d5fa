"""A lane of the batching driver: one loaded model version's batcher, latency model and
queued rows, the load report routers read from it, and its warm-up."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import Overloaded, Unavailable
from services.common.tracing import TraceContext
from services.gpu_worker.admission import RejectReason
from services.gpu_worker.backends.base import Backend, PreparedRow
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.types import BatchKey

#: Weight of one row in the lane's per-row cost EWMA (a batch of n rows weighs about n rows).
ROW_COST_ALPHA = 0.02
#: Warm-up runs of each (bucket, batch size); the fastest seeds the latency model.
WARMUP_RUNS_PER_SHAPE = 2


@dataclass
class Pending:
    """Driver-side state of one queued row."""

    row: PreparedRow
    future: asyncio.Future[np.ndarray]
    #: Cumulative executor-busy seconds when the row was queued; the difference at dispatch is
    #: the row's backlog, the rest of its wait is linger.
    busy_s_at_arrival: float
    #: The submitting request's span, which the batch span running this row links to.
    trace_context: TraceContext


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

    queued_rows: int
    #: Predicted compute per row at full batches, averaged over recent traffic's buckets: the
    #: marginal cost of queued work.
    per_row_s: float
    #: Predicted compute of one row of the smallest bucket alone: the floor of any request's
    #: latency.
    min_batch_s: float
    totals: BatchTotals = field(default_factory=BatchTotals)


@dataclass
class Lane:
    backend: Backend
    batcher: Batcher
    latency: LatencyModel
    pending: dict[int, Pending] = field(default_factory=dict)
    #: EWMA over dispatched rows of the predicted per-row cost of their key at full batches:
    #: the marginal cost of a row of this lane's traffic mix, for load reports. None until the
    #: first batch.
    row_cost_s: float | None = None
    #: Compute of the lane's costliest warm-up shape, seconds (the faster of its runs, as the
    #: latency model is seeded): the scale of the executor watchdog's bound.
    slowest_warmup_s: float = 0.0
    totals: BatchTotals = field(default_factory=BatchTotals)

    @property
    def labels(self) -> tuple[str, str]:
        return (self.backend.config.name, self.backend.version.version)

    def fail_pending(self, error: Exception) -> None:
        """Fails every row still waiting for its output with `error`."""
        for pending in self.pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)

    def record_row_cost(self, per_row_s: float, num_rows: int) -> None:
        """Folds a dispatched batch into `row_cost_s` (a batch of n rows weighs n rows)."""
        if self.row_cost_s is None:
            self.row_cost_s = per_row_s
        else:
            weight = 1.0 - (1.0 - ROW_COST_ALPHA) ** num_rows
            self.row_cost_s += weight * (per_row_s - self.row_cost_s)

    def rejection(
        self, key: BatchKey, reason: RejectReason, now_s: float, start_s: float
    ) -> Exception:
        """The error a row refused for `reason` gets; `start_s` is when the executor frees."""
        if reason is RejectReason.DRAINING:
            return Unavailable("worker is draining")
        if reason is RejectReason.DEADLINE:
            finish_s = self.batcher.predicted_finish_s(key, start_s)
            limit = "its SLO" if self.backend.config.shed_past_slo else "the request's deadline"
            return Overloaded(
                f"{key.model}/{key.version}: predicted to finish {finish_s - now_s:.3f}s from"
                f" now, past {limit}",
                retry_after_s=finish_s - now_s,
            )
        max_batch_size = self.batcher.max_batch_size_for(key)
        retry_after_s = self.latency.per_item_s(key, max_batch_size) * self.batcher.num_queued
        return Overloaded(
            f"{key.model}/{key.version} queue is full ({self.batcher.num_queued} rows)",
            retry_after_s=retry_after_s,
        )


def warm_up_lane(lane: Lane, key_for: Callable[[Backend, int], BatchKey]) -> None:
    """Runs every (bucket, power-of-two batch size) the lane may form, seeding its latency model
    with the faster of `WARMUP_RUNS_PER_SHAPE` runs per shape. Stops a bucket at the first size
    past the batch compute budget: bigger batches of it are never formed. Blocking."""
    backend = lane.backend
    backend.warm_up()
    for bucket in backend.buckets:
        key = key_for(backend, bucket)
        limit = lane.batcher.shape_limit(key)
        for size in sorted({*(1 << i for i in range(limit.bit_length())), limit}):
            rows = backend.warmup_rows(bucket, size)
            runs_s = []
            for _ in range(WARMUP_RUNS_PER_SHAPE):
                start = time.perf_counter()
                backend.run(rows)
                runs_s.append(time.perf_counter() - start)
            lane.latency.observe(key, size, min(runs_s))
            lane.slowest_warmup_s = max(lane.slowest_warmup_s, min(runs_s))
            if min(runs_s) > lane.batcher.batch_compute_budget_s:
                break
