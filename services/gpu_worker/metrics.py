"""The worker's Prometheus metrics. Business code records values; names carry units.

Each worker instance owns a registry, so several workers can live in one test process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        model = ["model", "version"]
        self.requests_total = Counter(
            "inference_worker_requests_total",
            "Infer requests answered, by gRPC status code.",
            [*model, "code"],
            registry=registry,
        )
        self.rows_total = Counter(
            "inference_worker_rows_total",
            "Input rows executed (each request has one or more rows).",
            model,
            registry=registry,
        )
        self.batches_total = Counter(
            "inference_worker_batches_total",
            "Batches executed, by bucket and close reason (full, linger, deadline, idle, drain).",
            [*model, "bucket", "reason"],
            registry=registry,
        )
        self.batch_size = Histogram(
            "inference_worker_batch_size",
            "Rows per executed batch.",
            [*model, "bucket"],
            buckets=_BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_fill_ratio = Histogram(
            "inference_worker_batch_fill_ratio",
            "Rows per batch divided by the batch limit for its bucket.",
            model,
            buckets=_RATIO_BUCKETS,
            registry=registry,
        )
        self.mixed_bucket_batches_total = Counter(
            "inference_worker_mixed_bucket_batches_total",
            "Batches whose rows, re-bucketed from their own lengths at execution, disagree. "
            "Must stay 0: a non-zero value is a batching bug.",
            model,
            registry=registry,
        )
        self.padding_waste_ratio = Histogram(
            "inference_worker_padding_waste_ratio",
            "Share of padded tokens in an executed batch (0 = no padding).",
            [*model, "bucket"],
            buckets=_RATIO_BUCKETS,
            registry=registry,
        )
        self.linger_seconds = Histogram(
            "inference_worker_linger_seconds",
            "Deliberate wait to fill a batch while the executor was idle, per row.",
            model,
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.backlog_seconds = Histogram(
            "inference_worker_backlog_seconds",
            "Wait while the executor was busy with other batches, per row.",
            model,
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.queue_wait_seconds = Histogram(
            "inference_worker_queue_wait_seconds",
            "Linger plus backlog, per row: the autoscaling signal.",
            model,
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.row_compute_seconds = Histogram(
            "inference_worker_row_compute_seconds",
            "Executor time of the batch a row ran in, per row (the compute stage a request "
            "sees; linger + backlog + this = row latency).",
            model,
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.row_latency_seconds = Histogram(
            "inference_worker_row_latency_seconds",
            "From a row's admission to its result, per row.",
            model,
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.compute_seconds = Histogram(
            "inference_worker_compute_seconds",
            "Executor time of one batch.",
            [*model, "bucket"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.rejected_total = Counter(
            "inference_worker_rejected_total",
            "Rows refused admission, by reason.",
            [*model, "reason"],
            registry=registry,
        )
        self.dropped_total = Counter(
            "inference_worker_dropped_total",
            "Queued rows removed before compute: expired (deadline) or cancelled.",
            [*model, "reason"],
            registry=registry,
        )
        self.row_failures_total = Counter(
            "inference_worker_row_failures_total",
            "Rows whose model execution raised (isolated by bisecting the batch).",
            model,
            registry=registry,
        )
        self.max_wait_seconds = Gauge(
            "inference_worker_max_wait_seconds",
            "Derived linger (max_wait) the batcher uses now, per bucket.",
            [*model, "bucket"],
            registry=registry,
        )
        self.max_batch_size = Gauge(
            "inference_worker_max_batch_size",
            "Largest batch the batcher forms for a bucket.",
            [*model, "bucket"],
            registry=registry,
        )
        self.latency_slowdown = Gauge(
            "inference_worker_latency_slowdown",
            "Observed / predicted batch compute, smoothed over recent batches: above 1 the "
            "machine runs slower than the latency curve says (contention), and admission "
            "predicts with it.",
            model,
            registry=registry,
        )
        self.queue_depth = Gauge(
            "inference_worker_queue_depth",
            "Rows queued and not yet dispatched.",
            model,
            registry=registry,
        )

    def declare_model(self, model: str, version: str) -> None:
        """Creates a model's per-row series at load, so they exist (at zero) before its first
        request: a rate over a window, and the autoscaling signal built on it, is then defined
        at zero load instead of missing."""
        for histogram in (
            self.queue_wait_seconds,
            self.linger_seconds,
            self.backlog_seconds,
            self.row_compute_seconds,
            self.row_latency_seconds,
        ):
            histogram.labels(model, version)
        self.rows_total.labels(model, version)
        self.queue_depth.labels(model, version).set(0)
