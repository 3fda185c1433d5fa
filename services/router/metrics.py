"""The router's Prometheus metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.telemetry import SECONDS_BUCKETS, Children, MetricFactory

_MODEL = ("model", "version")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        new = MetricFactory(registry)
        self.routed_total = new.counter(
            names.ROUTER_ROUTED_TOTAL,
            "Calls sent to a worker (retries included), by worker.",
            (*_MODEL, "worker"),
        )
        self.rejected_total = new.counter(
            names.ROUTER_REJECTED_TOTAL,
            "Requests refused before reaching a worker, by reason.",
            (*_MODEL, "reason"),
        )
        self.split_bundles_total = new.counter(
            names.ROUTER_SPLIT_BUNDLES_TOTAL,
            "Bundles no worker could take whole in time, routed in parts (each part counts "
            "in routed_total, each part refused in rejected_total).",
            _MODEL,
        )
        self.retries_total = new.counter(
            names.ROUTER_RETRIES_TOTAL,
            "Calls retried on another worker (after UNAVAILABLE, or NOT_FOUND from a worker that "
            "unloaded the version).",
            _MODEL,
        )
        self.retries_given_up_total = new.counter(
            names.ROUTER_RETRIES_GIVEN_UP_TOTAL,
            "Calls a worker could not serve (UNAVAILABLE, or NOT_FOUND after unloading) given "
            "to their callers unretried, by reason: budget_spent, no_attempts_left or "
            "deadline_passed.",
            (*_MODEL, "reason"),
        )
        self.retry_budget_tokens = new.gauge(
            names.ROUTER_RETRY_BUDGET_TOKENS,
            "Retries the router-wide retry budget allows now (below 1: none until calls earn "
            "more).",
        )
        self.responses_total = new.counter(
            names.ROUTER_RESPONSES_TOTAL,
            "Requests answered, by gRPC status code.",
            (*_MODEL, "code"),
        )
        self.predicted_wait_seconds = new.histogram(
            names.ROUTER_PREDICTED_WAIT_SECONDS,
            "Predicted queue wait plus compute on the chosen worker at routing time.",
            _MODEL,
            buckets=SECONDS_BUCKETS,
        )
        self.request_seconds = new.histogram(
            names.ROUTER_REQUEST_SECONDS,
            "Time from receiving a request to answering it (worker time included).",
            _MODEL,
            buckets=SECONDS_BUCKETS,
        )
        self.registry_degraded = new.gauge(
            names.ROUTER_REGISTRY_DEGRADED,
            "1 while Redis is unreachable and routing uses the last good snapshot.",
        )
        self.registry_snapshot_age_seconds = new.gauge(
            names.ROUTER_REGISTRY_SNAPSHOT_AGE_SECONDS, "Age of the registry snapshot routing uses."
        )
        self.live_workers = new.gauge(
            names.ROUTER_LIVE_WORKERS, "Workers with a fresh heartbeat in the snapshot."
        )
        self.worker_links = new.gauge(
            names.ROUTER_WORKER_LINKS,
            "Workers this router holds a channel to: one gone from the registry for 30 s, with "
            "no call on it, is closed.",
        )
        self.rejected_worker_records_total = new.counter(
            names.ROUTER_REJECTED_WORKER_RECORDS_TOTAL,
            "Registry records ignored at a read because their address is outside "
            "--worker-networks (each read counts them again).",
        )
        self.ejections_total = new.counter(
            names.ROUTER_EJECTIONS_TOTAL,
            "Workers taken out of routing because their calls only timed out, by worker.",
            ("worker",),
        )
        # The children each bundle records in, each looked up once.
        self.routed_total_of = Children(self.routed_total)
        self.responses_total_of = Children(self.responses_total)
        self.predicted_wait_seconds_of = Children(self.predicted_wait_seconds)
        self.request_seconds_of = Children(self.request_seconds)
        self.rejected_total_of = Children(self.rejected_total)
        self.retries_given_up_total_of = Children(self.retries_given_up_total)

    def forget_workers(self, worker_ids: set[str]) -> None:
        """Removes the series of workers that left the registry: a worker id is its host and
        process, so every pod restart is a new one, and their series would otherwise pile up
        in every scrape for as long as the router runs."""
        for key in [k for k in self.routed_total_of if k[-1] in worker_ids]:
            del self.routed_total_of[key]
            self.routed_total.remove(*key)
        for worker_id in worker_ids:
            with contextlib.suppress(KeyError):  # never ejected: no series
                self.ejections_total.remove(worker_id)

    @property
    def _per_version(self) -> tuple[Children[Any], ...]:
        """The children labelled by model and version first."""
        return (self.routed_total_of, self.responses_total_of, self.rejected_total_of,
                self.predicted_wait_seconds_of, self.request_seconds_of,
                self.retries_given_up_total_of)  # fmt: skip

    def versions(self) -> set[tuple[str, str]]:
        """The (model, version) of every per-version series kept."""
        return {(values[0], values[1]) for of in self._per_version for values in list(of)}

    def forget_versions(self, versions: Iterable[tuple[str, str]]) -> None:
        """Removes the series of model versions (name, version) no worker serves any more:
        every rollout adds a version's ~50 series (two histograms, codes, reasons, workers),
        which piled up in every scrape for as long as the router ran (review finding)."""
        for name, version in versions:
            for of in self._per_version:
                of.remove_from(name, version)
            for metric in (self.split_bundles_total, self.retries_total):
                with contextlib.suppress(KeyError):  # never split, never retried: no series
                    metric.remove(name, version)
