"""The simulator's p90 queue wait, read as the deployed HPA reads the worker's histogram."""

from __future__ import annotations

import math

import pytest

from services.common.metric_names import WORKER_SECONDS_BUCKETS
from services.sim.results import histogram_quantile

pytestmark = pytest.mark.unit


def _counts(**by_bound: int) -> list[int]:
    """Counts per bucket, keyed like `le_0_01=3`; `inf` for the +Inf bucket."""
    counts = [0] * (len(WORKER_SECONDS_BUCKETS) + 1)
    for name, count in by_bound.items():
        index = (
            len(WORKER_SECONDS_BUCKETS)
            if name == "inf"
            else WORKER_SECONDS_BUCKETS.index(float(name[3:].replace("_", ".")))
        )
        counts[index] = count
    return counts


def test_the_quantile_interpolates_within_its_bucket_as_prometheus_does() -> None:
    # 10 rows in (0.01, 0.025]: the p90 rank 9 is 9/10 of the way through that bucket.
    assert histogram_quantile(0.9, _counts(le_0_025=10)) == pytest.approx(0.01 + 0.015 * 0.9)
    # 80 rows at most 5 ms, 20 in (0.05, 0.1]: rank 90 is half-way through the second bucket.
    quantile = histogram_quantile(0.9, _counts(le_0_005=80, le_0_1=20))
    assert quantile == pytest.approx(0.05 + 0.05 * 0.5)


def test_a_quantile_in_the_overflow_bucket_is_the_highest_bound() -> None:
    assert histogram_quantile(0.9, _counts(le_0_01=1, inf=9)) == WORKER_SECONDS_BUCKETS[-1]


def test_no_rows_give_no_quantile() -> None:
    assert math.isnan(histogram_quantile(0.9, _counts()))
