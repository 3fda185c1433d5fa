"""Read a service's Prometheus metrics the way Prometheus does: scrape and parse."""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def samples(text: str, name: str, **labels: str) -> list[tuple[Mapping[str, str], float]]:
    """All samples called `name` whose labels include `labels`."""
    found = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                found.append((sample.labels, sample.value))
    return found


def total(text: str, name: str, **labels: str) -> float:
    return sum(value for _, value in samples(text, name, **labels))
