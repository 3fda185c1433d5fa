"""Recording helpers shared by the tiers (services.common.telemetry)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from services.common.telemetry import observe_many

pytestmark = pytest.mark.unit

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    (metric,) = histogram.collect()
    return {
        (s.name, s.labels.get("le", "")): s.value
        for s in metric.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize(
    ("amount", "count"),
    [(0.0, 5), (0.001, 3), (0.0011, 7), (0.5, 64), (1.0, 2), (3.0, 4), (math.inf, 2), (0.2, 1)],
)
def test_many_observations_at_once_equal_as_many_single_ones(amount: float, count: int) -> None:
    at_once = Histogram("at_once", "", ("model",), buckets=BUCKETS, registry=CollectorRegistry())
    one_by_one = Histogram("one_by_one", "", ("model",), buckets=BUCKETS, registry=None)
    observe_many(at_once.labels("m"), amount, count)
    observe_many(at_once.labels("m"), 0.05, 1)
    for _ in range(count):
        one_by_one.labels("m").observe(amount)
    one_by_one.labels("m").observe(0.05)
    renamed = {(n.replace("one_by_one", "at_once"), le): v for (n, le), v in
               _samples(one_by_one).items()}  # fmt: skip
    assert _samples(at_once) == renamed


def test_no_observation_records_nothing() -> None:
    histogram = Histogram("none", "", buckets=BUCKETS, registry=None)
    observe_many(histogram, 0.5, 0)
    assert all(v == 0 for v in _samples(histogram).values())
