"""Pure statistics of a rate sweep: percentiles, per-window figures, the pass rule and the
goodput search. No I/O and no clock, so every rule here is unit-tested on made-up numbers.

Goodput is the highest offered rate at which at least 99% of requests succeed within the SLO
(bench method, docs/benchmarks.md). A rate is measured in several windows; figures are
reported as the median and min-max over windows, and the pass rule pools every window (a 1%
threshold needs every request it can get), the rate void when more than 1% of its sends left
late.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.fabric.loadgen import MAX_LATE_FRACTION, Outcome

#: Share of requests that must succeed within the SLO for a rate to count as served.
GOOD_FRACTION = 0.99


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), numpy's (linear interpolation between order statistics);
    None for no values, which JSON writes as null instead of NaN."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside 0..100")
    if not values:
        return None
    return float(np.percentile(values, q))


@dataclass(frozen=True)
class WindowStats:
    """One measured window at one offered rate."""

    duration_s: float
    sent: int
    ok: int
    #: OK and within the SLO.
    good: int
    late: int
    statuses: dict[str, int]
    #: Latency percentiles of the accepted (OK) requests; None when none was accepted.
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None

    @property
    def good_fraction(self) -> float:
        return self.good / self.sent if self.sent else 0.0

    @property
    def late_fraction(self) -> float:
        return self.late / self.sent if self.sent else 0.0

    @property
    def is_valid(self) -> bool:
        """False when more than 1% of sends left late: it measured the load generator."""
        return self.sent > 0 and self.late_fraction <= MAX_LATE_FRACTION

    @property
    def offered_per_s(self) -> float:
        return self.sent / self.duration_s

    @property
    def goodput_per_s(self) -> float:
        return self.good / self.duration_s


def window_stats(outcomes: Sequence[Outcome], slo_s: float, duration_s: float) -> WindowStats:
    accepted = [o.response_s for o in outcomes if o.ok]
    return WindowStats(
        duration_s=duration_s,
        sent=len(outcomes),
        ok=len(accepted),
        good=sum(1 for latency in accepted if latency <= slo_s),
        late=sum(1 for o in outcomes if o.late),
        statuses=dict(Counter(o.status for o in outcomes)),
        p50_s=percentile(accepted, 50),
        p90_s=percentile(accepted, 90),
        p99_s=percentile(accepted, 99),
    )


def _median_span(values: Iterable[float | None]) -> dict[str, float | None]:
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


@dataclass
class RateResult:
    """Every window measured at one offered rate, and whether the rate was served."""

    rate_per_s: float
    windows: list[WindowStats]
    #: Anything measured beside the windows (metrics breakdown, CPU seconds), for the report.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def valid_windows(self) -> list[WindowStats]:
        return [w for w in self.windows if w.is_valid]

    @property
    def is_valid(self) -> bool:
        """At most 1% of the run's sends late (BENCHMARKS.md: otherwise the run is discarded,
        the generator, not the server, set the pace). Judged on most windows valid, a run passed
        on the rest once its void window, most often its worst, was left out (bench review)."""
        sent = sum(w.sent for w in self.windows)
        return sent > 0 and sum(w.late for w in self.windows) <= MAX_LATE_FRACTION * sent

    @property
    def good_fraction(self) -> float:
        """Pooled over every window."""
        sent = sum(w.sent for w in self.windows)
        return sum(w.good for w in self.windows) / sent if sent else 0.0

    @property
    def passed(self) -> bool:
        return self.is_valid and self.good_fraction >= GOOD_FRACTION

    def statuses(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for window in self.windows:
            total.update(window.statuses)
        return dict(total)

    def figure(self, name: str) -> dict[str, float | None]:
        """Median and min-max over the valid windows (every window if none is valid)."""
        windows = self.valid_windows or self.windows
        return _median_span(getattr(w, name) for w in windows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "offered_rate_per_s": self.rate_per_s,
            "passed": self.passed,
            "valid": self.is_valid,
            "good_fraction": self.good_fraction,
            "windows": len(self.windows),
            "valid_windows": len(self.valid_windows),
            "late_fraction": self.figure("late_fraction"),
            "measured_rate_per_s": self.figure("offered_per_s"),
            "goodput_per_s": self.figure("goodput_per_s"),
            "p50_s": self.figure("p50_s"),
            "p90_s": self.figure("p90_s"),
            "p99_s": self.figure("p99_s"),
            "statuses": self.statuses(),
            **self.extra,
        }


def summarize_rate(
    rate_per_s: float, windows: Sequence[Sequence[Outcome]], slo_s: float, window_s: float
) -> RateResult:
    return RateResult(rate_per_s, [window_stats(w, slo_s, window_s) for w in windows])


class GoodputSearch:
    """Finds the highest passing rate with few probes: grow (or shrink) geometrically from a
    starting guess until one rate passes and one fails, then bisect geometrically until the
    bracket is within `rel_tol`. Pure: the caller measures `next_rate()` and `record()`s it.

    Noise can make a rate pass above one that failed; the bracket then keeps the lowest
    failure and only passes below it, so the answer errs low, never high."""

    def __init__(
        self,
        start_rate: float,
        *,
        growth: float = 1.25,
        rel_tol: float = 0.05,
        max_probes: int = 8,
        min_rate: float = 1.0,
        max_rate: float = math.inf,
    ) -> None:
        if start_rate <= 0 or growth <= 1 or rel_tol <= 0:
            raise ValueError("start_rate > 0, growth > 1 and rel_tol > 0 are required")
        self.start_rate = min(max(start_rate, min_rate), max_rate)
        self.growth = growth
        self.rel_tol = rel_tol
        self.max_probes = max_probes
        self.min_rate = min_rate
        self.max_rate = max_rate
        self.probes: list[tuple[float, bool]] = []

    def record(self, rate: float, passed: bool) -> None:
        self.probes.append((rate, passed))

    @property
    def lowest_failure(self) -> float | None:
        failures = [rate for rate, passed in self.probes if not passed]
        return min(failures) if failures else None

    @property
    def best(self) -> float | None:
        """The goodput: the highest passing rate below every failing one (None: none passed)."""
        ceiling = self.lowest_failure
        passes = [r for r, ok in self.probes if ok and (ceiling is None or r < ceiling)]
        return max(passes) if passes else None

    def next_rate(self) -> float | None:
        """The next rate to measure, or None when the search is done."""
        if len(self.probes) >= self.max_probes:
            return None
        if not self.probes:
            return self.start_rate
        low, high = self.best, self.lowest_failure
        if high is None:  # everything passed so far: go up
            assert low is not None
            return None if low >= self.max_rate else min(low * self.growth, self.max_rate)
        if low is None:  # everything failed so far: go down
            return None if high <= self.min_rate else max(high / self.growth, self.min_rate)
        if high / low <= 1.0 + self.rel_tol:
            return None
        return math.sqrt(low * high)
