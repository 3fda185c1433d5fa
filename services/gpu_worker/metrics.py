"""The worker's Prometheus metrics. Business code records values; names carry units.

Each worker instance owns a registry, so several workers can live in one test process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.metric_names import WORKER_SECONDS_BUCKETS
from services.common.telemetry import (
    Children,
    MetricFactory,
    Retirement,
    remove_version_series,
)

_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_MODEL = ("model", "version")
WORK = (names.WORK_ONLINE, names.WORK_BACKFILL)
_BUCKET = (*_MODEL, "bucket")
#: Tenants labelled by name, in the order first seen; later ones share `OTHER_TENANT`. The
#: worker cannot see the gateways' tenant configuration, so this bound is its own: the first
#: 64 tenants seen keep their names.
MAX_LABELLED_TENANTS = 64
OTHER_TENANT = "other"


class WorkerMetrics:
    def __init__(
        self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = registry
        self._retirement = Retirement(partial(remove_version_series, self), clock)
        new = MetricFactory(registry)
        self.requests_total = new.counter(
            names.WORKER_REQUESTS_TOTAL,
            "Infer requests answered, by gRPC status code.",
            (*_MODEL, "code"),
        )
        self.rows_total = new.counter(
            names.WORKER_ROWS_TOTAL,
            "Input rows executed (each request has one or more rows).",
            _MODEL,
        )
        self._define_batches(new)
        self._define_row_stages(new)
        self.tenant_compute_seconds_total = new.counter(
            names.WORKER_TENANT_COMPUTE_SECONDS_TOTAL,
            "Executor seconds spent on each tenant's rows (a batch's compute split evenly over "
            "its rows): the fair-share ledger's measure, as served.",
            ("tenant",),
        )
        self.tenant_tokens_total = new.counter(
            names.WORKER_TENANT_TOKENS_TOTAL,
            "Tokens computed for each tenant's generations (prompt and generated): the "
            "generation scheduler's fair-share measure, as served.",
            ("tenant",),
        )
        self._tenant_labels: set[str] = set()
        self.rejected_total = new.counter(
            names.WORKER_REJECTED_TOTAL, "Rows refused admission, by reason.", (*_MODEL, "reason")
        )
        self.dropped_total = new.counter(
            names.WORKER_DROPPED_TOTAL,
            "Queued rows removed before compute: expired (past their deadline), past_slo (past "
            "the SLO bound admission set, their deadline still allowing them) or cancelled.",
            (*_MODEL, "reason"),
        )
        self.row_failures_total = new.counter(
            names.WORKER_ROW_FAILURES_TOTAL,
            "Rows whose model execution raised (isolated by bisecting the batch).",
            _MODEL,
        )
        self.watchdog_expired_total = new.counter(
            names.WORKER_WATCHDOG_EXPIRED_TOTAL,
            "Model calls that ran past the executor watchdog (the worker then stops serving).",
            _MODEL,
        )
        self.device_lost_total = new.counter(
            names.WORKER_DEVICE_LOST_TOTAL,
            "Batches that failed whole on a device that no longer ran work (a CUDA error that "
            "poisons the context; the worker then stops serving).",
            _MODEL,
        )
        self.model_load_failures_total = new.counter(
            names.WORKER_MODEL_LOAD_FAILURES_TOTAL,
            "Model versions that failed to load at start-up (left out; the rest are served).",
            _MODEL,
        )
        self._define_batcher_state(new)
        self._index_children()

    def _define_batches(self, new: MetricFactory) -> None:
        """Per-batch metrics: how batches close, how full and padded they are, their compute."""
        self.batches_total = new.counter(
            names.WORKER_BATCHES_TOTAL,
            "Batches executed, by bucket and close reason (full, linger, deadline, idle, drain,"
            " fair_share, backfill, backfill_due).",
            (*_BUCKET, "reason"),
        )
        self.batch_size = new.histogram(
            names.WORKER_BATCH_SIZE,
            "Rows per executed batch.",
            _BUCKET,
            buckets=_BATCH_SIZE_BUCKETS,
        )
        self.batch_fill_ratio = new.histogram(
            names.WORKER_BATCH_FILL_RATIO,
            "Rows per batch divided by the batch limit for its bucket.",
            _MODEL,
            buckets=_RATIO_BUCKETS,
        )
        self.mixed_bucket_batches_total = new.counter(
            names.WORKER_MIXED_BUCKET_BATCHES_TOTAL,
            "Batches whose rows, re-bucketed from their own lengths at execution, disagree. "
            "Must stay 0: a non-zero value is a batching bug.",
            _MODEL,
        )
        self.padding_waste_ratio = new.histogram(
            names.WORKER_PADDING_WASTE_RATIO,
            "Share of padded tokens in an executed batch (0 = no padding).",
            _BUCKET,
            buckets=_RATIO_BUCKETS,
        )
        self.compute_seconds = new.histogram(
            names.WORKER_COMPUTE_SECONDS,
            "Executor time of one batch.",
            _BUCKET,
            buckets=WORKER_SECONDS_BUCKETS,
        )
        self.device_busy_seconds_total = new.counter(
            names.WORKER_DEVICE_BUSY_SECONDS_TOTAL,
            "Seconds the device spent on batches: CUDA events around each model call on a "
            "GPU, the call's wall time on a CPU. Its rate, summed over a pod's models, is the "
            "device's duty cycle. work=backfill: batches of batch-class rows only, which fill "
            "idle time and must not scale workers up; online: the rest (generation steps too).",
            (*_MODEL, "work"),
        )

    def _define_row_stages(self, new: MetricFactory) -> None:
        """Per-row stage histograms: linger + backlog + row compute = row latency."""
        self.linger_seconds = new.histogram(
            names.WORKER_LINGER_SECONDS,
            "Deliberate wait to fill a batch while the executor was idle, per row.",
            _MODEL,
            buckets=WORKER_SECONDS_BUCKETS,
        )
        self.backlog_seconds = new.histogram(
            names.WORKER_BACKLOG_SECONDS,
            "Wait while the executor was busy with other batches, per row.",
            _MODEL,
            buckets=WORKER_SECONDS_BUCKETS,
        )
        self.queue_wait_seconds = new.histogram(
            names.WORKER_QUEUE_WAIT_SECONDS,
            "Linger plus backlog, per online row (batch-class rows wait behind them on purpose): "
            "the autoscaling signal.",
            _MODEL,
            buckets=WORKER_SECONDS_BUCKETS,
        )
        self.row_compute_seconds = new.histogram(
            names.WORKER_ROW_COMPUTE_SECONDS,
            "Executor time of the batch a row ran in, per row (the compute stage a request "
            "sees; linger + backlog + this = row latency).",
            _MODEL,
            buckets=WORKER_SECONDS_BUCKETS,
        )
        self.row_latency_seconds = new.histogram(
            names.WORKER_ROW_LATENCY_SECONDS,
            "From a row's admission to its result, per row.",
            _MODEL,
            buckets=WORKER_SECONDS_BUCKETS,
        )

    def _define_batcher_state(self, new: MetricFactory) -> None:
        """Gauges of what the batcher and admission use now."""
        self.max_wait_seconds = new.gauge(
            names.WORKER_MAX_WAIT_SECONDS,
            "Derived linger (max_wait) the batcher uses now, per bucket.",
            _BUCKET,
        )
        self.max_batch_size = new.gauge(
            names.WORKER_MAX_BATCH_SIZE, "Largest batch the batcher forms for a bucket.", _BUCKET
        )
        self.latency_slowdown = new.gauge(
            names.WORKER_LATENCY_SLOWDOWN,
            "Observed / predicted batch compute, smoothed over recent batches: above 1 the "
            "machine runs slower than the latency curve says (contention). Admission "
            "predicts with it plus --prediction-spreads (2 by default) of its spreads "
            "(inference_worker_latency_spread), and, against a row's SLO bound, "
            "--slo-prediction-spreads (2 by default).",
            _MODEL,
        )
        self.latency_spread = new.gauge(
            names.WORKER_LATENCY_SPREAD,
            "How far batches' observed / predicted compute falls from the slowdown, "
            "smoothed over recent batches: wide where the model shares its cores with other "
            "work, near 0 on a device of its own.",
            _MODEL,
        )
        self.queue_depth = new.gauge(
            names.WORKER_QUEUE_DEPTH, "Rows queued and not yet dispatched.", _MODEL
        )
        self.model_failing = new.gauge(
            names.WORKER_MODEL_FAILING,
            "1 while the version's batches all fail on this worker (every row of each failed): "
            "its heartbeat says so, and routers send its calls to other workers.",
            _MODEL,
        )
        self.queue_standing = new.gauge(
            names.WORKER_QUEUE_STANDING,
            "1 while the model's queue stands (dispatch after dispatch for a whole SLO, rows "
            "left queued that had waited above a tenth of it and above the longest linger): "
            "online rows predicted to miss the SLO are then refused.",
            _MODEL,
        )
        self.batch_gap_seconds = new.gauge(
            names.WORKER_BATCH_GAP_SECONDS,
            "How long the executor stands idle between batches while rows wait, smoothed: the "
            "event loop's turns to dispatch the next batch. Well above a batch's compute, this "
            "process's loop, not its device, bounds what it serves.",
        )

    def _index_children(self) -> None:
        """The children each bundle, slice and batch records in, each looked up once."""
        self.requests_total_of = Children(self.requests_total)
        self.tenant_compute_seconds_total_of = Children(self.tenant_compute_seconds_total)
        self.tenant_tokens_total_of = Children(self.tenant_tokens_total)
        self.rejected_total_of = Children(self.rejected_total)
        self.dropped_total_of = Children(self.dropped_total)
        self.rows_total_of = Children(self.rows_total)
        self.row_failures_total_of = Children(self.row_failures_total)
        self.batches_total_of = Children(self.batches_total)
        self.batch_size_of = Children(self.batch_size)
        self.batch_fill_ratio_of = Children(self.batch_fill_ratio)
        self.mixed_bucket_batches_total_of = Children(self.mixed_bucket_batches_total)
        self.padding_waste_ratio_of = Children(self.padding_waste_ratio)
        self.compute_seconds_of = Children(self.compute_seconds)
        self.device_busy_seconds_total_of = Children(self.device_busy_seconds_total)
        self.linger_seconds_of = Children(self.linger_seconds)
        self.backlog_seconds_of = Children(self.backlog_seconds)
        self.queue_wait_seconds_of = Children(self.queue_wait_seconds)
        self.row_compute_seconds_of = Children(self.row_compute_seconds)
        self.row_latency_seconds_of = Children(self.row_latency_seconds)
        self.max_wait_seconds_of = Children(self.max_wait_seconds)
        self.max_batch_size_of = Children(self.max_batch_size)
        self.latency_slowdown_of = Children(self.latency_slowdown)
        self.latency_spread_of = Children(self.latency_spread)

    def charge_tenant(self, tenant: str, *, compute_s: float, num_tokens: int = 0) -> None:
        """Records executor time (and, for generation, tokens) spent on `tenant`'s work."""
        label = self.tenant_label(tenant)
        self.tenant_compute_seconds_total_of[(label,)].inc(compute_s)
        if num_tokens:
            self.tenant_tokens_total_of[(label,)].inc(num_tokens)

    def tenant_label(self, tenant: str) -> str:
        """The bounded label value of `tenant`."""
        if tenant in self._tenant_labels:
            return tenant
        if len(self._tenant_labels) < MAX_LABELLED_TENANTS and tenant != OTHER_TENANT:
            self._tenant_labels.add(tenant)
            return tenant
        return OTHER_TENANT

    def declare_model(self, model: str, version: str) -> None:
        """Creates a model's per-row series at load, so they exist (at zero) before its first
        request: a rate over a window, and the autoscaling signal built on it, is then defined
        at zero load instead of missing."""
        self._retirement.revive(model, version)
        for histogram in (
            self.queue_wait_seconds,
            self.linger_seconds,
            self.backlog_seconds,
            self.row_compute_seconds,
            self.row_latency_seconds,
        ):
            histogram.labels(model, version)
        self.rows_total.labels(model, version)
        for work in WORK:
            self.device_busy_seconds_total.labels(model, version, work)
        self.queue_depth.labels(model, version).set(0)
        self.queue_standing.labels(model, version).set(0)
        self.model_failing.labels(model, version).set(0)

    def forget_queue(self, model: str, version: str) -> None:
        """An unloaded version's queue gauges read 0 again (they read its lane until then), and
        its batcher's gauges (slowdown, spread, linger and batch size by bucket) are removed:
        they said how its lane batched, and stayed at their last values for good (review
        finding). A load made again sets new ones. Its counters and histograms stay
        RETIRED_SERIES_S, then go at a later unload (Retirement)."""
        self.queue_depth.labels(model, version).set_function(lambda: 0)
        self.queue_standing.labels(model, version).set_function(lambda: 0)
        self.model_failing.labels(model, version).set_function(lambda: 0)
        for children in (
            self.latency_slowdown_of,
            self.latency_spread_of,
            self.max_wait_seconds_of,
            self.max_batch_size_of,
        ):
            children.remove_from(model, version)
        self._retirement.retire(model, version)
