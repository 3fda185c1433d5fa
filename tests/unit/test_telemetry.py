"""Recording helpers shared by the tiers (services.common.telemetry)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.common import metric_names as names
from services.common.errors import InvalidInput
from services.common.telemetry import (
    RETIRED_SERIES_S,
    Children,
    Outcome,
    given_up_in,
    observe_counts,
)
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.metrics import WorkerMetrics
from tests.support.clock import FakeClock

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
    observe_counts(at_once.labels("m"), [(amount, count)])
    observe_counts(at_once.labels("m"), [(0.05, 1)])
    for _ in range(count):
        one_by_one.labels("m").observe(amount)
    one_by_one.labels("m").observe(0.05)
    renamed = {(n.replace("one_by_one", "at_once"), le): v for (n, le), v in
               _samples(one_by_one).items()}  # fmt: skip
    assert _samples(at_once) == renamed


def test_a_batch_of_slices_at_once_equals_each_observation_alone() -> None:
    """Several (amount, count) pairs, two in one bucket, one past every bound, one not a
    number: the buckets and count as one observe call per row, the sum as close as float
    addition order allows."""
    pairs = [(0.0005, 3), (0.0007, 2), (0.05, 1), (0.05, 4), (2.5, 2), (math.inf, 1), (0.3, 0)]
    at_once = Histogram("at_once", "", buckets=BUCKETS, registry=None)
    one_by_one = Histogram("at_once", "", buckets=BUCKETS, registry=None)
    observe_counts(at_once, pairs)
    for amount, count in pairs:
        for _ in range(count):
            one_by_one.observe(amount)
    got, want = _samples(at_once), _samples(one_by_one)
    assert {k: v for k, v in got.items() if k[0] != "at_once_sum"} == {
        k: v for k, v in want.items() if k[0] != "at_once_sum"
    }
    assert got[("at_once_count", "")] == 13
    assert got[("at_once_sum", "")] == want[("at_once_sum", "")] == math.inf
    finite = [(a, c) for a, c in pairs if math.isfinite(a)]
    finite_at_once = Histogram("f", "", buckets=BUCKETS, registry=None)
    observe_counts(finite_at_once, finite)
    assert _samples(finite_at_once)[("f_sum", "")] == pytest.approx(sum(a * c for a, c in finite))


def test_a_not_a_number_observation_counts_in_no_bucket_as_observe_does() -> None:
    at_once = Histogram("nan", "", buckets=BUCKETS, registry=None)
    one_by_one = Histogram("nan", "", buckets=BUCKETS, registry=None)
    observe_counts(at_once, [(math.nan, 2), (0.5, 1)])
    for amount in (math.nan, math.nan, 0.5):
        one_by_one.observe(amount)
    got, want = _samples(at_once), _samples(one_by_one)
    assert math.isnan(got[("nan_sum", "")]) and math.isnan(want[("nan_sum", "")])
    del got[("nan_sum", "")], want[("nan_sum", "")]
    assert got == want
    assert got[("nan_count", "")] == 1


def test_a_labelled_parent_is_refused_as_observe_refuses_it() -> None:
    parent = Histogram("parent", "", ("model",), buckets=BUCKETS, registry=None)
    with pytest.raises(ValueError):
        observe_counts(parent, [(0.5, 1)])


def test_counts_that_fail_midway_record_nothing() -> None:
    histogram = Histogram("partial", "", buckets=BUCKETS, registry=None)

    def counts() -> Iterator[tuple[float, int]]:
        yield (0.5, 2)
        yield (math.inf, 1)
        raise RuntimeError("the caller's generator failed")

    with pytest.raises(RuntimeError):
        observe_counts(histogram, counts())
    assert all(v == 0 for v in _samples(histogram).values())


def test_no_observation_records_nothing() -> None:
    histogram = Histogram("none", "", buckets=BUCKETS, registry=None)
    observe_counts(histogram, [(0.5, 0)])
    observe_counts(histogram, [])
    assert all(v == 0 for v in _samples(histogram).values())


def _counts(counter: Counter) -> dict[tuple[str, ...], float]:
    (metric,) = counter.collect()
    return {tuple(s.labels.values()): s.value for s in metric.samples if s.name.endswith("_total")}


def test_a_child_is_looked_up_once_and_records_in_the_exported_series() -> None:
    counter = Counter("calls", "", ("model", "code"), registry=CollectorRegistry())
    children = Children(counter)
    children[("m", "OK")].inc()
    children[("m", "OK")].inc(2)
    children[("n", "OK")].inc()
    assert children[("m", "OK")] is counter.labels("m", "OK")
    assert len(children) == 2
    assert _counts(counter) == {("m", "OK"): 3.0, ("n", "OK"): 1.0}


def test_an_outcome_counts_each_call_by_the_status_it_ends_with_and_times_it() -> None:
    registry = CollectorRegistry()
    counter = Counter("calls", "", ("model", "code"), registry=registry)
    histogram = Histogram("call_seconds", "", ("model",), buckets=BUCKETS, registry=registry)
    counts, seconds = Children(counter), histogram.labels("m")
    with Outcome(counts, ("m",), seconds):
        pass
    with pytest.raises(InvalidInput), Outcome(counts, ("m",), seconds):
        raise InvalidInput("bad row")  # raised on: the outcome counts, never swallows
    with pytest.raises(asyncio.CancelledError), Outcome(counts, ("m",)):
        raise asyncio.CancelledError  # the caller went away
    assert _counts(counter) == {
        ("m", "OK"): 1.0,
        ("m", "INVALID_ARGUMENT"): 1.0,
        ("m", "CANCELLED"): 1.0,
    }
    # Only the calls given `seconds` are timed.
    assert _samples(histogram)[("call_seconds_count", "")] == 2.0


@pytest.mark.parametrize("stopped_by", [asyncio.CancelledError, GeneratorExit])
def test_a_call_cancelled_at_its_deadline_counts_as_its_given_up_says(
    stopped_by: type[BaseException],
) -> None:
    """Cancelled at an await (CancelledError) or, a stream's handler, at a `yield`
    (GeneratorExit): past its deadline it counts DEADLINE_EXCEEDED, before it CANCELLED
    (`given_up_in`). A stream stopped at a `yield` counted CANCELLED whatever the time."""
    registry = CollectorRegistry()
    counter = Counter("calls", "", ("model", "code"), registry=registry)
    counts = Children(counter)
    for time_left_s in (-1.0, 60.0):
        with pytest.raises(stopped_by), Outcome(counts, ("m",), given_up=given_up_in(time_left_s)):
            raise stopped_by
    assert _counts(counter) == {("m", "DEADLINE_EXCEEDED"): 1.0, ("m", "CANCELLED"): 1.0}


def test_an_unloaded_versions_batcher_gauges_leave_the_scrape_and_come_back_on_a_load() -> None:
    """Its slowdown, spread, linger and batch size by bucket stayed at their last values for
    good once the version was unloaded (review finding); another version's stay."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    for version in ("1", "2"):
        metrics.latency_slowdown_of[("m", version)].set(3.0)
        metrics.latency_spread_of[("m", version)].set(0.5)
        for bucket in ("16", "32"):
            metrics.max_wait_seconds_of[("m", version, bucket)].set(0.02)
            metrics.max_batch_size_of[("m", version, bucket)].set(64)
    families = (
        names.WORKER_LATENCY_SLOWDOWN,
        names.WORKER_LATENCY_SPREAD,
        names.WORKER_MAX_WAIT_SECONDS,
        names.WORKER_MAX_BATCH_SIZE,
    )

    def series(version: str) -> int:
        lines = generate_latest(registry).decode().splitlines()
        tag = f'version="{version}"'
        return sum(line.startswith(families) and tag in line for line in lines)

    assert series("1") == series("2") == 6
    metrics.forget_queue("m", "1")
    assert series("1") == 0 and series("2") == 6
    metrics.latency_slowdown_of[("m", "1")].set(1.0)  # loaded again: its series anew
    assert series("1") == 1


def test_a_retired_versions_series_leave_the_scrape_after_their_grace_and_not_before() -> None:
    """Each rollout left a version's counters and histograms in every scrape for as long as
    the worker ran (review finding): they stay RETIRED_SERIES_S after its unload (a last
    rate window closes over them), then go at a later unload; a version loaded again keeps
    its series, and the tenants' are not a version's."""
    registry = CollectorRegistry()
    clock = FakeClock()
    metrics = WorkerMetrics(registry, clock=clock)

    def series(version: str) -> int:
        lines = generate_latest(registry).decode().splitlines()
        tags = ('model="m"', f'version="{version}"')
        return sum(not line.startswith("#") and all(t in line for t in tags) for line in lines)

    for version in ("1", "2", "3"):
        metrics.declare_model("m", version)
        metrics.rows_total_of[("m", version)].inc(4)
        metrics.batches_total_of[("m", version, "16", "full")].inc()
        metrics.compute_seconds_of[("m", version, "16")].observe(0.01)
    metrics.charge_tenant("acme", compute_s=0.5)
    before = series("1")
    assert before > 20 and series("2") == series("3") == before

    metrics.forget_queue("m", "1")
    clock.now_s += RETIRED_SERIES_S
    metrics.forget_queue("m", "2")  # not yet past the first's grace
    assert series("1") == series("2") == before
    metrics.declare_model("m", "2")  # loaded again: never removed
    clock.now_s += 1.0
    metrics.forget_queue("m", "3")
    assert series("1") == 0
    assert series("2") == series("3") == before
    assert registry.get_sample_value(
        names.WORKER_TENANT_COMPUTE_SECONDS_TOTAL, {"tenant": "acme"}
    ) == pytest.approx(0.5)

    clock.now_s += RETIRED_SERIES_S + 1.0
    metrics.forget_queue("m", "4")
    assert series("3") == 0 and series("2") == before
    metrics.rows_total_of[("m", "1")].inc()  # served again: its series anew, recorded
    assert registry.get_sample_value(
        names.WORKER_ROWS_TOTAL, {"model": "m", "version": "1"}
    ) == pytest.approx(1.0)


def test_a_retired_generation_versions_series_leave_the_scrape_after_their_grace() -> None:
    registry = CollectorRegistry()
    clock = FakeClock()
    metrics = GenerationMetrics(registry, clock=clock)
    for version in ("1", "2"):
        metrics.bind(("g", version))
        metrics.ttft_seconds.labels("g", version).observe(0.1)

    def has(version: str) -> bool:
        labels = {"model": "g", "version": version}
        return registry.get_sample_value(names.GENERATION_TTFT_SECONDS + "_count", labels) == 1

    metrics.forget("g", "1")
    assert has("1")
    clock.now_s += RETIRED_SERIES_S + 1.0
    metrics.forget("g", "2")
    assert not has("1") and has("2")
