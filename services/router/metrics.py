"""The router's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.routed_total = Counter(
            "inference_router_routed_total",
            "Calls sent to a worker (retries included), by worker.",
            ["model", "version", "worker"],
            registry=registry,
        )
        self.rejected_total = Counter(
            "inference_router_rejected_total",
            "Requests refused before reaching a worker, by reason.",
            ["model", "version", "reason"],
            registry=registry,
        )
        self.retries_total = Counter(
            "inference_router_retries_total",
            "Calls retried on another worker after UNAVAILABLE.",
            ["model", "version"],
            registry=registry,
        )
        self.responses_total = Counter(
            "inference_router_responses_total",
            "Requests answered, by gRPC status code.",
            ["model", "version", "code"],
            registry=registry,
        )
        self.predicted_wait_seconds = Histogram(
            "inference_router_predicted_wait_seconds",
            "Predicted queue wait plus compute on the chosen worker at routing time.",
            ["model", "version"],
            buckets=_SECONDS,
            registry=registry,
        )
        self.request_seconds = Histogram(
            "inference_router_request_seconds",
            "Time from receiving a request to answering it (worker time included).",
            ["model", "version"],
            buckets=_SECONDS,
            registry=registry,
        )
        self.registry_degraded = Gauge(
            "inference_router_registry_degraded",
            "1 while Redis is unreachable and routing uses the last good snapshot.",
            registry=registry,
        )
        self.registry_snapshot_age_seconds = Gauge(
            "inference_router_registry_snapshot_age_seconds",
            "Age of the registry snapshot routing uses.",
            registry=registry,
        )
        self.live_workers = Gauge(
            "inference_router_live_workers",
            "Workers with a fresh heartbeat in the snapshot.",
            registry=registry,
        )
