"""One `/metrics` for a group of processes serving one port: a gateway group's supervisor
(services.gateway.process_group) and a worker's engine with its fronts
(services.gpu_worker.fronts). Each member process serves its own `/metrics` on a port of its
own; the group's scrape reads every member's and serves them with its own series."""

from __future__ import annotations

import http.client
import urllib.request
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

#: How long a scrape waits for one process's /metrics.
SCRAPE_TIMEOUT_S = 2.0


class MetricsSources(Protocol):
    """Where the group's processes serve their own /metrics."""

    scrape_host: str

    def metrics_ports(self) -> dict[int, int]:
        """Each ready process's metrics port, by index."""
        ...


class GroupMetrics(CollectorRegistry):
    """The group's /metrics: the series of the collectors registered here (the supervisor's
    own) and each ready process's, labelled `label="<index>"`, merged into one family per
    name (the text format allows each name once)."""

    def __init__(self, group: MetricsSources, label: str) -> None:
        super().__init__(auto_describe=True)
        self._group = group
        self._label = label

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for family in super().collect():
            families[family.name] = family
        for index, port in self._group.metrics_ports().items():
            url = f"http://{self._group.scrape_host}:{port}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
                    text = response.read().decode()
                parsed = list(text_string_to_metric_families(text))
            except (OSError, http.client.HTTPException, ValueError):
                # Restarting, or killed mid-answer (a body cut short, or one that does not
                # parse): its series are missing from this scrape only, not the group's.
                continue
            for family in parsed:
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                merged.samples.extend(
                    Sample(s.name, {**s.labels, self._label: str(index)}, s.value, s.timestamp)
                    for s in family.samples
                )
        yield from families.values()


class RegistryCollector:
    """Another registry's series, as one collector (a tier's own, under its group's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
