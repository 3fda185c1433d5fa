"""A process group's /metrics (a gateway group's, a worker's fronts'): each process's series
scraped over HTTP, labelled with its index and merged into one family per name; a process that
does not answer is left out."""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.common.group_metrics import GroupMetrics
from services.common.processes import reserve_port
from services.gateway.process_group import PROCESS_LABEL
from tests.support.metrics import samples, serving

pytestmark = pytest.mark.integration


@dataclass
class Ports:
    """What GroupMetrics reads of its supervisor: where each process serves its metrics."""

    ports: dict[int, int] = field(default_factory=dict)
    scrape_host: str = "127.0.0.1"

    def metrics_ports(self) -> dict[int, int]:
        return self.ports


def process_registry(num_requests: int) -> CollectorRegistry:
    """What one gateway process exports: a counter, a gauge and a histogram."""
    registry = CollectorRegistry()
    requests = Counter("demo_requests", "Requests", ["model"], registry=registry)
    requests.labels("minilm").inc(num_requests)
    Gauge("demo_share", "Share", registry=registry).set(num_requests / 10)
    latency = Histogram("demo_seconds", "Latency", buckets=(0.1, 1.0), registry=registry)
    for _ in range(num_requests):
        latency.observe(0.05)
    return registry


def test_processes_series_are_labelled_and_merged_into_one_family_each() -> None:
    with (
        serving(process_registry(3)) as first,
        serving(process_registry(5)) as second,
        # Bound, never listening, held through the scrape: refused, and no other process
        # (another xdist worker) can take the port meanwhile.
        closing(reserve_port("127.0.0.1", 0)) as closed,
    ):
        group = Ports({0: first, 1: second, 2: closed.getsockname()[1]})
        text = generate_latest(GroupMetrics(group, PROCESS_LABEL)).decode()
    by_process = {
        labels[PROCESS_LABEL]: value for labels, value in samples(text, "demo_requests_total")
    }
    # The process whose port is closed (restarting) is missing from this scrape only.
    assert by_process == {"0": 3.0, "1": 5.0}
    counts = samples(text, "demo_seconds_count")
    assert sorted((labels[PROCESS_LABEL], value) for labels, value in counts) == [
        ("0", 3.0),
        ("1", 5.0),
    ]
    type_lines = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(type_lines) == len(set(type_lines))
    assert {"demo_requests_total", "demo_share", "demo_seconds"} <= set(type_lines)
