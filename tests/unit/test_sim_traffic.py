"""Simulated traffic: seeded Poisson streams, length mixes, the diurnal curve, bursts, traces."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from services.sim.traffic import (
    Burst,
    Diurnal,
    LengthMix,
    Stream,
    Traffic,
    load_trace,
    write_trace,
)

pytestmark = pytest.mark.unit


def make_stream(*, rate_per_s: float = 1000.0, tenant: str = "t", **overrides: object) -> Stream:
    return Stream(model="m", rate_per_s=rate_per_s, tenant=tenant, **overrides)  # type: ignore[arg-type]


def within_poisson(count: int, expected: float) -> bool:
    """Within 5 standard deviations of a Poisson count's mean."""
    return abs(count - expected) <= 5 * math.sqrt(expected)


def test_same_seed_same_arrivals_other_seed_other_arrivals() -> None:
    traffic = Traffic(streams=(make_stream(),))
    first = list(traffic.arrivals(seed=7, until_s=2.0))
    assert first == list(traffic.arrivals(seed=7, until_s=2.0))
    assert first != list(traffic.arrivals(seed=8, until_s=2.0))


def test_arrivals_are_time_ordered_and_before_the_end() -> None:
    arrivals = list(Traffic(streams=(make_stream(),)).arrivals(seed=1, until_s=3.0))
    times = [a.at_s for a in arrivals]
    assert times == sorted(times)
    assert times[0] > 0.0 and times[-1] < 3.0


def test_each_stream_arrives_at_its_own_rate() -> None:
    streams = (
        make_stream(rate_per_s=2000.0, tenant="a"),
        make_stream(rate_per_s=500.0, tenant="b"),
    )
    counts = Counter(a.tenant for a in Traffic(streams=streams).arrivals(seed=3, until_s=10.0))
    assert within_poisson(counts["a"], 20_000)
    assert within_poisson(counts["b"], 5_000)


def test_lengths_follow_the_mix() -> None:
    lengths = LengthMix(tokens=(10, 100), weights=(3.0, 1.0))
    stream = make_stream(rate_per_s=4000.0, lengths=lengths)
    counts = Counter(a.num_tokens for a in Traffic(streams=(stream,)).arrivals(1, until_s=5.0))
    total = counts[10] + counts[100]
    assert set(counts) == {10, 100}
    assert abs(counts[10] / total - 0.75) < 0.02
    assert lengths.mean_tokens() == pytest.approx(32.5)


def test_diurnal_curve_shapes_the_rate() -> None:
    diurnal = Diurnal(amplitude=0.8, period_s=20.0, peak_at_s=10.0)
    assert diurnal.factor(10.0) == pytest.approx(1.8)
    assert diurnal.factor(0.0) == pytest.approx(0.2)
    traffic = Traffic(streams=(make_stream(),), diurnal=diurnal)
    arrivals = list(traffic.arrivals(seed=5, until_s=20.0))
    near_peak = sum(1 for a in arrivals if 8.0 <= a.at_s < 12.0)
    near_trough = sum(1 for a in arrivals if a.at_s < 2.0 or a.at_s >= 18.0)
    # Expected counts: the integral of 1000 x (1 + 0.8 cos(...)) over each 4 s window.
    assert within_poisson(near_peak, 4000 + 800 * 10 / math.pi * 2 * math.sin(math.pi / 5))
    assert within_poisson(near_trough, 4000 - 800 * 10 / math.pi * 2 * math.sin(math.pi / 5))


def test_a_burst_multiplies_only_its_tenant_and_only_in_its_window() -> None:
    streams = (make_stream(tenant="flood"), make_stream(tenant="quiet"))
    burst = Burst(start_s=2.0, duration_s=1.0, multiplier=10.0, tenant="flood")
    arrivals = list(Traffic(streams=streams, bursts=(burst,)).arrivals(seed=9, until_s=4.0))
    in_burst = Counter(a.tenant for a in arrivals if 2.0 <= a.at_s < 3.0)
    outside = Counter(a.tenant for a in arrivals if a.at_s < 2.0)
    assert within_poisson(in_burst["flood"], 10_000)
    assert within_poisson(in_burst["quiet"], 1_000)
    assert within_poisson(outside["flood"], 2_000)


def test_scaled_multiplies_every_stream() -> None:
    traffic = Traffic(streams=(make_stream(rate_per_s=100.0),)).scaled(1.5)
    assert traffic.total_rate_per_s(0.0) == pytest.approx(150.0)


def test_a_written_trace_reads_back_and_replays_as_recorded(tmp_path: Path) -> None:
    recorded = list(Traffic(streams=(make_stream(rate_per_s=50.0),)).arrivals(2, until_s=2.0))
    path = tmp_path / "trace.csv"
    write_trace(path, recorded)
    trace = load_trace(path, default_model="m")
    assert [(a.at_s, a.tenant, a.num_tokens) for a in trace] == [
        (a.at_s, a.tenant, a.num_tokens) for a in recorded
    ]
    replayed = list(Traffic(trace=trace).arrivals(seed=99, until_s=1.0))
    assert replayed == [a for a in trace if a.at_s < 1.0]


def test_the_mean_rate_counts_each_burst_for_exactly_its_length() -> None:
    """The planner's mean rate sampled 200 midpoints: over 600 s, a burst from 5 s to 6 s at
    10x fell between two of them and was left out, and one from 4 s to 5 s counted as 3 s
    (simulator review). Bursts count for their length, and the diurnal curve, clipped at 0,
    integrates to its mean."""
    stream = Stream("m", 10.0)
    exact = 10.0 * (599.0 + 10.0) / 600.0
    for start_s in (4.0, 5.0, 5.3):
        traffic = Traffic(streams=(stream,), bursts=(Burst(start_s, 1.0, 10.0),))
        assert traffic.mean_rate_per_s(stream, 600.0) == pytest.approx(exact, rel=1e-9)
    # A burst past the end counts for the part within it; another tenant's not at all.
    traffic = Traffic(streams=(stream,), bursts=(Burst(590.0, 20.0, 3.0), Burst(0, 600, 9, "b")))
    assert traffic.mean_rate_per_s(stream, 600.0) == pytest.approx(10.0 * (590 + 30) / 600)
    clipped = Traffic(streams=(stream,), diurnal=Diurnal(amplitude=2.0, period_s=600.0))
    mean_factor = (4 * math.pi / 3 + 2 * math.sqrt(3)) / (2 * math.pi)  # 1 + 2 cos, above 0
    assert clipped.mean_rate_per_s(stream, 600.0) == pytest.approx(10.0 * mean_factor, rel=1e-3)
