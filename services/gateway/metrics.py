"""The gateway's Prometheus metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.telemetry import (
    FAST_SECONDS_BUCKETS,
    SECONDS_BUCKETS,
    Children,
    MetricFactory,
    Outcome,
    given_up_in,
)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        new = MetricFactory(registry)
        self.requests_total = new.counter(
            names.GATEWAY_REQUESTS_TOTAL,
            "Requests answered, by API (v1 or kserve_v2) and gRPC status code.",
            ("api", "model", "code"),
        )
        self.inputs_total = new.counter(
            names.GATEWAY_INPUTS_TOTAL,
            "Input rows of requests answered OK (forwarded and served).",
            ("model", "version"),
        )
        self.validate_seconds = new.histogram(
            names.GATEWAY_VALIDATE_SECONDS,
            "Cheap checks and model resolution, per request.",
            buckets=FAST_SECONDS_BUCKETS,
        )
        self.tokenize_seconds = new.histogram(
            names.GATEWAY_TOKENIZE_SECONDS,
            "Tokenization of the texts of a bundle's callers (one call per bundle).",
            ("model",),
            buckets=FAST_SECONDS_BUCKETS,
        )
        self.request_seconds = new.histogram(
            names.GATEWAY_REQUEST_SECONDS,
            "Time from receiving a request to answering it.",
            ("api", "model"),
            buckets=SECONDS_BUCKETS,
        )
        self.bundle_slices = new.histogram(
            names.GATEWAY_BUNDLE_SLICES,
            "Callers' slices per bundle sent to a router (concurrent calls for one model "
            "version travel together): its count is the calls downstream, its sum the callers.",
            ("model",),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self.bundle_hold_seconds = new.histogram(
            names.GATEWAY_BUNDLE_HOLD_SECONDS,
            "How long a ready bundle waited for its key's bundle downstream to be answered, "
            "gathering calls meanwhile (the bundle clock; bundles that did not wait are not "
            "counted).",
            ("model",),
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.05, 0.1),
        )
        self.throttled_total = new.counter(
            names.GATEWAY_THROTTLED_TOTAL,
            "Requests refused here by adaptive throttling (downstream was refusing work).",
            ("model",),
        )
        self.model_ready_versions = new.gauge(
            names.GATEWAY_MODEL_READY_VERSIONS,
            "Versions of each model of this gateway's repository that a ready live worker"
            " serves, as the router last listed them (0: its calls fail, no worker serves it).",
            ("model",),
        )
        self.throttle_probability = new.gauge(
            names.GATEWAY_THROTTLE_PROBABILITY,
            "Share of a model's requests adaptive throttling refuses now.",
            ("model",),
        )
        self.router_retries_total = new.counter(
            names.GATEWAY_ROUTER_RETRIES_TOTAL,
            "Calls resent after a router refused them unstarted (draining) or none could be "
            "reached, and a bundle's slices resent after a worker refused them unstarted "
            "while serving the rest, by RPC (predict or generate).",
            ("rpc",),
        )
        self._define_tenants(new)
        # The children the request path records in, each looked up once (`labels()` per
        # request was a lock and a join per metric).
        self.requests_total_of = Children(self.requests_total)
        self.request_seconds_of = Children(self.request_seconds)
        self.inputs_total_of = Children(self.inputs_total)
        self.throttle_probability_of = Children(self.throttle_probability)
        self.tenant_requests_total_of = Children(self.tenant_requests_total)
        self.tenant_rows_total_of = Children(self.tenant_rows_total)
        self.tenant_request_seconds_of = Children(self.tenant_request_seconds)
        self.bundle_slices_of = Children(self.bundle_slices)
        self.bundle_hold_seconds_of = Children(self.bundle_hold_seconds)
        self.throttled_total_of = Children(self.throttled_total)
        self.tenant_refused_total_of = Children(self.tenant_refused_total)

    def _define_tenants(self, new: MetricFactory) -> None:
        """Per tenant: configured tenants by name, everyone else as `other` (bounded labels)."""
        self.tenant_requests_total = new.counter(
            names.GATEWAY_TENANT_REQUESTS_TOTAL,
            "Inference calls per tenant and priority class, by gRPC status code.",
            ("tenant", "priority", "code"),
        )
        self.tenant_rows_total = new.counter(
            names.GATEWAY_TENANT_ROWS_TOTAL,
            "Input rows forwarded per tenant (texts, tensors or prompts).",
            ("tenant",),
        )
        self.tenant_refused_total = new.counter(
            names.GATEWAY_TENANT_REFUSED_TOTAL,
            "Calls refused at the gateway per tenant, by reason (requests_per_s, rows_per_s, "
            "max_concurrency, throttled, priority).",
            ("tenant", "reason"),
        )
        self.unauthenticated_total = new.counter(
            names.GATEWAY_UNAUTHENTICATED_TOTAL,
            "Calls refused UNAUTHENTICATED (HTTP 401), by reason (missing_key, unknown_key).",
            ("reason",),
        )
        self.keys_file_refused = new.gauge(
            names.GATEWAY_KEYS_FILE_REFUSED,
            "1 while the keys file is missing or its version does not read: the keys in force "
            "are an older version's (a key revoked since is still valid); 0 otherwise.",
        )
        self.tenant_request_seconds = new.histogram(
            names.GATEWAY_TENANT_REQUEST_SECONDS,
            "Time from receiving an inference call to answering it, per tenant.",
            ("tenant",),
            buckets=SECONDS_BUCKETS,
        )
        self.tenant_quota_share = new.gauge(
            names.GATEWAY_TENANT_QUOTA_SHARE,
            "Fraction of the tenant's fleet-wide quotas this gateway enforces.",
            ("tenant",),
        )

    def follow_throttle(self, model: str, highest: Callable[[str, float], float]) -> None:
        """Makes `model`'s throttle gauge read, at each scrape, the highest refusal probability
        of its online keys (`highest`: AdaptiveThrottle.highest_probability); once per model."""
        if (model,) not in self.throttle_probability_of:
            child = self.throttle_probability_of[(model,)]
            child.set_function(lambda: highest(model, time.monotonic()))

    def observe_request(self, api: str, model: str, time_left_s: float | None = None) -> Outcome:
        """Counts the request by its final status and times it (the whole stream, for
        streaming calls): enter it around the call. `model` must be a bounded label value;
        `time_left_s`, the caller's (None: no deadline): a call cancelled at its deadline
        counts DEADLINE_EXCEEDED, as its caller was told, not CANCELLED."""
        labels = (api, model)
        return Outcome(self.requests_total_of, labels, self.request_seconds_of[labels],
                       given_up=given_up_in(time_left_s))  # fmt: skip
