"""Telemetry shared by every tier: how a metric is defined, the histogram buckets, the registry a
tier exports, and recording helpers (business code only records values)."""

from __future__ import annotations

import asyncio
import bisect
import importlib.metadata
import math
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from services.common.errors import DeadlineExceeded
from services.common.grpc_errors import code_of
from services.common.metric_names import BUILD_INFO

#: Durations from a millisecond to ten seconds: requests, model steps, predicted waits. The
#: dashboard's `$slo` choices are bounds of these too (request latency, time to first token).
#: Bounds every 50-100 ms from 0.1 to 0.5 s, where SLOs lie: a tail just past an SLO is told
#: from one twice it (a quantile interpolates within its bucket).
SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Sub-millisecond work on the request path (validation, tokenization).
FAST_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
#: The worker's row stages (linger, backlog, compute, latency) and batch compute. The
#: dashboard's `$slo` choices are bounds of these: change both together.

_PACKAGE = "inference-fabric"


class MetricFactory:
    """The one way a tier defines a metric: name (from `metric_names`), help text, label names
    and, for histograms, buckets; every metric lands in the tier's own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)


def tier_registry(tier: str) -> CollectorRegistry:
    """A new registry for one tier's `/metrics`: the standard process metrics (resident memory,
    CPU seconds, open file descriptors), the Python runtime's, and `inference_build_info`.

    Each tier instance owns its registry, so several tiers in one process (tests) each register
    these collectors once, on their own registry."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    build = MetricFactory(registry).gauge(
        BUILD_INFO, "Always 1: the version of the fabric this tier runs.", ("tier", "version")
    )
    build.labels(tier, package_version()).set(1)
    return registry


def package_version() -> str:
    try:
        return importlib.metadata.version(_PACKAGE)
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


#: A labelled metric, whose `labels()` returns its own kind of child.
M = TypeVar("M", Counter, Gauge, Histogram)


class Children(dict[tuple[str, ...], M]):
    """A labelled metric's children by their label values, each made once: `labels()` takes a
    lock and checks and joins its values on every call, and the hot paths record per request.
    A child removed from the metric must leave this dict too (RouterMetrics.forget_workers)."""

    __slots__ = ("_metric",)

    def __init__(self, metric: M) -> None:
        super().__init__()
        self._metric: M = metric

    def __missing__(self, values: tuple[str, ...]) -> M:
        child: M = self._metric.labels(*values)
        self[values] = child
        return child

    def remove_from(self, *prefix: str) -> None:
        """Removes every child whose label values begin with `prefix`, here and from the
        metric (its series no longer exported)."""
        for values in [values for values in self if values[: len(prefix)] == prefix]:
            self._metric.remove(*values)
            del self[values]


#: Seconds a retired model version's series stay exported after no one serves it: a rate()
#: or increase() window of a few minutes still closes over its last counts.
RETIRED_SERIES_S = 600.0


def remove_series(metric: Counter | Gauge | Histogram, prefix: tuple[str, ...]) -> None:
    """Removes every series of `metric` whose label values begin with `prefix` (a histogram's
    bucket bound is not one of them). Not for a metric a `Children` indexes: use its
    `remove_from`, which forgets the children too."""
    found = set()
    for family in metric.collect():
        for sample in family.samples:
            values = tuple(v for k, v in sample.labels.items() if k not in ("le", "quantile"))
            if values[: len(prefix)] == prefix:
                found.add(values)
    for values in found:
        metric.remove(*values)


def remove_version_series(holder: object, model: str, version: str) -> None:
    """Removes every series of `model`/`version` from the metrics `holder` keeps as its
    attributes: from its children indexes first (what records is looked up there), then what
    was made without them (`labels()` at a load, gauges bound to a function)."""
    kept = list(vars(holder).values())
    for index in kept:
        if isinstance(index, Children):
            index.remove_from(model, version)
    for metric in kept:
        if isinstance(metric, (Counter, Gauge, Histogram)):
            remove_series(metric, (model, version))


class Retirement:
    """Model versions retired (unloaded, forgotten), whose series are removed once
    `keep_s` has passed, at a later retirement: each rollout left a version's counters and
    histograms in every scrape for as long as the process ran (a review finding). What a
    version has is removed by `remove`; a version served again is `revive`d."""

    def __init__(
        self,
        remove: Callable[[str, str], None],
        clock: Callable[[], float] = time.monotonic,
        keep_s: float = RETIRED_SERIES_S,
    ) -> None:
        self._remove = remove
        self._clock = clock
        self._keep_s = keep_s
        self._at_s: dict[tuple[str, str], float] = {}

    def retire(self, model: str, version: str) -> None:
        now_s = self._clock()
        self._at_s[(model, version)] = now_s
        for key in [k for k, at_s in self._at_s.items() if now_s - at_s > self._keep_s]:
            del self._at_s[key]
            self._remove(*key)

    def revive(self, model: str, version: str) -> None:
        self._at_s.pop((model, version), None)


#: A call cancelled this close to its deadline (seconds) was cancelled by it: gRPC's deadline
#: timer and ours are read apart, and a caller's cancel at its own deadline comes a transit
#: earlier or later than the deadline its call's headers set here. At 5 ms, one stream request
#: in eight cut off by its deadline counted CANCELLED beside three busy loops (its caller was
#: told DEADLINE_EXCEEDED); the worker allows 50 ms too (gpu_worker/bundles.py).
DEADLINE_SLACK_S = 0.05


def given_up_in(time_left_s: float | None) -> Callable[[], BaseException] | None:
    """`Outcome`'s `given_up` for a call with `time_left_s` from now (None: no deadline, so a
    cancelled call's caller went away)."""
    if time_left_s is None:
        return None
    return given_up_by(time.monotonic() + time_left_s, DEADLINE_SLACK_S)


def given_up_by(deadline_s: float, slack_s: float) -> Callable[[], BaseException]:
    """`Outcome`'s `given_up` for a call with an absolute `deadline_s` (time.monotonic): one
    cancelled within `slack_s` of it was cancelled by it (gRPC cancels a handler at its
    caller's deadline, maybe before the call's own timer fires: the caller was told
    DEADLINE_EXCEEDED), any other by a caller that went away."""

    def given_up() -> BaseException:
        if time.monotonic() >= deadline_s - slack_s:
            return DeadlineExceeded("deadline exceeded")
        return asyncio.CancelledError()

    return given_up


class Outcome:
    """Counts the enclosed call in `counts` under `labels` plus the gRPC status it ends with
    (OK, or the status its error maps to; CANCELLED when the caller went away), and observes
    its duration in `seconds` (a histogram's child) when given. A cancelled call is counted as
    `given_up()` says when given: a call cancelled by its own deadline's timer is
    DEADLINE_EXCEEDED, not a caller that went away. A class, not a generator: it is entered
    per request."""

    __slots__ = ("_counts", "_given_up", "_labels", "_seconds", "_started")

    def __init__(
        self,
        counts: Children[Counter],
        labels: tuple[str, ...],
        seconds: Histogram | None = None,
        *,
        given_up: Callable[[], BaseException] | None = None,
    ) -> None:
        self._counts = counts
        self._labels = labels
        self._seconds = seconds
        self._given_up = given_up
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # A stream's handler stopped at a `yield` ends with GeneratorExit, at an await with
        # CancelledError: either way its call was cancelled.
        if isinstance(error, asyncio.CancelledError | GeneratorExit) and self._given_up is not None:
            error = self._given_up()
        code = "OK" if error is None else code_of(error).name
        self._counts[(*self._labels, code)].inc()
        if self._seconds is not None:
            self._seconds.observe(time.perf_counter() - self._started)


def observe_counts(histogram: Histogram, counts: Iterable[tuple[float, int]]) -> None:
    """Each (amount, count) of `counts` as `count` observations of `amount`, recorded as that
    many calls of `histogram.observe` would record them (the sum up to the order its float
    additions take), in one write of the sum and one per bucket touched: the rows of one
    slice share their wait, and a batch's slices fall in a few buckets, so the per-row path
    pays for neither a call per row nor one per slice. `histogram` is a labelled child.
    `counts` is read whole before anything is recorded.

    It writes the child's sum and bucket values directly (prometheus_client keeps them as
    `_sum` and `_buckets` beside `_upper_bounds`); tests/unit/test_telemetry.py holds it equal
    to repeated `observe` calls, so an upgrade that moves them fails there."""
    # As `observe` does: a labelled parent is refused (ValueError). prometheus_client leaves
    # this private method untyped.
    histogram._raise_if_not_observable()  # type: ignore[no-untyped-call]
    bounds = histogram._upper_bounds
    total = 0.0
    by_bucket: dict[int, int] = {}
    not_finite: list[tuple[float, int]] = []
    for amount, count in counts:
        if count <= 0:
            continue
        if not math.isfinite(amount):  # NaN falls in no bucket, and bisect cannot place it
            not_finite.append((amount, count))
            continue
        total += amount * count
        index = bisect.bisect_left(bounds, amount)
        by_bucket[index] = by_bucket.get(index, 0) + count
    for amount, count in not_finite:
        for _ in range(count):
            histogram.observe(amount)
    if by_bucket:
        histogram._sum.inc(total)
        for index, count in by_bucket.items():
            histogram._buckets[index].inc(count)
