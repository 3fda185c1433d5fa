"""The job runner's Prometheus metrics (names in services.common.metric_names).

Throughput is `rate(inference_jobs_items_total[1m])` summed over runners; the backlog is
`inference_jobs_queue_entries{state="queued"}` (chunks no runner has claimed) and its age
`inference_jobs_oldest_entry_age_seconds`. The queue gauges are read from Redis by every
runner, so aggregate them with max(), not sum().
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.job_policy import ItemStatus
from services.common.telemetry import SECONDS_BUCKETS, MetricFactory

#: Chunk durations reach tens of seconds when an item retries.
CHUNK_SECONDS_BUCKETS = (*SECONDS_BUCKETS, 30.0, 60.0, 120.0)


class RunnerMetrics(MetricFactory):
    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.items = self.counter(
            names.JOBS_ITEMS_TOTAL,
            "Items this runner finished, by status (each item once over all runners: one"
            " another runner recorded first is not counted)",
            ["status"],
        )
        for status in ItemStatus:  # each from 0: FabricJobsStalled reads its increase()
            self.items.labels(status.value)
        self.items_running = self.gauge(
            names.JOBS_ITEMS_RUNNING, "Items this runner is running now (claimed, not recorded)"
        )
        self.queue_entries = self.gauge(
            names.JOBS_QUEUE_ENTRIES,
            "Queue entries (chunks): queued = never claimed, claimed = claimed, not acknowledged",
            ["state"],
        )
        self.oldest_entry_age = self.gauge(
            names.JOBS_OLDEST_ENTRY_AGE_SECONDS, "Age of the oldest entry still in the queue"
        )
        self.chunk_seconds = self.histogram(
            names.JOBS_CHUNK_SECONDS,
            "Time from claiming a chunk to recording its results",
            buckets=CHUNK_SECONDS_BUCKETS,
        )
        self.retries = self.counter(
            names.JOBS_RETRIES_TOTAL, "Predict calls retried, by code", ["code"]
        )
        self.chunks_left = self.counter(
            names.JOBS_CHUNKS_LEFT_TOTAL,
            "Chunks left pending for a later round, by reason: runner_refused (the gateway"
            " refused the runner's key: every job waits until it is mended), fleet_unavailable,"
            " store_unreachable (Redis)",
            ["reason"],
        )
        for reason in (
            names.CHUNK_LEFT_RUNNER_REFUSED,
            names.CHUNK_LEFT_FLEET_UNAVAILABLE,
            names.CHUNK_LEFT_STORE_UNREACHABLE,
        ):  # each series from 0, so that increase() sees its first chunk
            self.chunks_left.labels(reason)
        self.chunks_held_for_room = self.gauge(
            names.JOBS_CHUNKS_HELD_FOR_ROOM,
            "Chunks whose results this runner holds, their calls run, while Redis at its memory"
            " cap refuses to record them",
        )
