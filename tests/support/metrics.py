"""Read a service's Prometheus metrics the way Prometheus does: scrape and parse."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


@contextlib.contextmanager
def serving(registry: CollectorRegistry) -> Iterator[int]:
    """Serves `registry` at `/metrics` on a free loopback port, as a tier's `__main__` does, and
    yields the port."""
    server, thread = start_http_server(0, "127.0.0.1", registry)
    try:
        yield int(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


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
