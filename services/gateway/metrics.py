"""The gateway's Prometheus metrics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.telemetry import count_outcome

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_SLOW = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests_total = Counter(
            "inference_gateway_requests_total",
            "Requests answered, by API (v1 or kserve_v2) and gRPC status code.",
            ["api", "model", "code"],
            registry=registry,
        )
        self.inputs_total = Counter(
            "inference_gateway_inputs_total",
            "Input rows forwarded to the router.",
            ["model", "version"],
            registry=registry,
        )
        self.validate_seconds = Histogram(
            "inference_gateway_validate_seconds",
            "Cheap checks and model resolution, per request.",
            buckets=_FAST,
            registry=registry,
        )
        self.tokenize_seconds = Histogram(
            "inference_gateway_tokenize_seconds",
            "Tokenization of a request's texts.",
            ["model"],
            buckets=_FAST,
            registry=registry,
        )
        self.request_seconds = Histogram(
            "inference_gateway_request_seconds",
            "Time from receiving a request to answering it.",
            ["api", "model"],
            buckets=_SLOW,
            registry=registry,
        )

        self.throttled_total = Counter(
            "inference_gateway_throttled_total",
            "Requests refused here by adaptive throttling (downstream was refusing work).",
            ["model"],
            registry=registry,
        )
        self.throttle_probability = Gauge(
            "inference_gateway_throttle_probability",
            "Share of a model's requests adaptive throttling refuses now.",
            ["model"],
            registry=registry,
        )

    @contextlib.contextmanager
    def observe_request(self, api: str, model: str) -> Iterator[None]:
        """Counts the request by its final status and times it (the whole stream, for
        streaming calls). `model` must be a bounded label value."""
        started = time.perf_counter()
        try:
            with count_outcome(self.requests_total, api, model):
                yield
        finally:
            self.request_seconds.labels(api, model).observe(time.perf_counter() - started)
