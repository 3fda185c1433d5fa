"""The validation's calibration statistics (bench/sim_calibration.py), as pure functions."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.fabric.loadgen import OK, Outcome, arrival_schedule
from bench.sim_calibration import mean_hops_ms, robust_sigma
from bench.sim_validation import length_draws, real_side
from bench.stand_in_fit import CostPoint, fit_bundle_costs

pytestmark = pytest.mark.unit


def test_the_noise_is_the_body_of_the_calls_not_the_few_the_other_tiers_slowed() -> None:
    rng = random.Random(3)
    body = [rng.gauss(0.0, 0.03) for _ in range(54)]
    with_one_slow_call = [*body, math.log(2.1)]
    assert robust_sigma(body) == pytest.approx(0.03, rel=0.35)
    # One call at 2.1x moves the standard deviation more than threefold, the robust one little.
    assert statistics.pstdev(with_one_slow_call) > 3 * statistics.pstdev(body)
    assert robust_sigma(with_one_slow_call) == pytest.approx(robust_sigma(body), rel=0.1)
    assert robust_sigma([]) == 0.0


def test_the_hops_are_the_answered_calls_latency_less_the_workers_row_latency() -> None:
    outcomes = [
        Outcome(0.0, 0.0, 0.020, OK),
        Outcome(0.1, 0.0, 0.030, OK),
        Outcome(0.2, 0.0, 1.000, "DEADLINE_EXCEEDED"),  # not answered: not counted
    ]
    assert mean_hops_ms(outcomes, worker_row_ms=18.0) == pytest.approx(7.0)
    assert math.isnan(mean_hops_ms(outcomes[2:], worker_row_ms=18.0))


def _point(callers: int, per_s: float, slices: float, **cost_us: float) -> CostPoint:
    cost_s = {tier: us / 1e6 for tier, us in cost_us.items()}
    return CostPoint(callers, per_s, slices, {"bench": 0.0, **cost_s}, {OK: 1})


def test_two_loads_that_bundle_differently_give_each_tier_a_cost_per_call_and_per_bundle() -> None:
    # The stand-in stack's shape (8 and 64 callers): the router's cost is nearly all per
    # bundle, the gateway's split.
    light = _point(8, 616, 1.04, gateway=1049, router=561, worker=675)
    busy = _point(64, 1761, 4.73, gateway=524, router=127, worker=190)
    costs = fit_bundle_costs(light, busy, max_slices=64)
    for point in (light, busy):  # the model goes through both points, bundles and costs
        slices = costs.slices_per_bundle(point.per_s)
        assert slices == pytest.approx(point.slices)
        assert costs.gateway_s(slices) == pytest.approx(point.cost_s["gateway"])
        assert costs.router_s(slices) == pytest.approx(point.cost_s["router"])
        assert costs.worker_s(1.0, slices) == pytest.approx(point.cost_s["worker"])
    assert costs.router_s_per_request < 0.1 * costs.router_s_per_bundle
    # Bundles grow linearly from about 600 calls/s: 1.04 callers at 616/s, 4.73 at 1,761/s.
    assert 590 < costs.min_bundling_per_s < 616
    assert costs.slices_per_bundle(400) == 1.0


def test_a_fit_never_gives_a_negative_cost_and_always_matches_the_busy_point() -> None:
    # Noise: the light load cheaper per call than the busy one.
    light = _point(8, 616, 1.04, gateway=500, router=100, worker=100)
    busy = _point(64, 1761, 4.73, gateway=524, router=127, worker=190)
    costs = fit_bundle_costs(light, busy, max_slices=64)
    assert costs.gateway_s_per_bundle == 0 and costs.gateway_s(4.73) == pytest.approx(524e-6)
    # The light load costlier than bundles alone explain: all per bundle.
    heavy = _point(8, 616, 1.04, gateway=5000, router=127, worker=190)
    costs = fit_bundle_costs(heavy, busy, max_slices=64)
    assert costs.gateway_s_per_request == 0 and costs.gateway_s(4.73) == pytest.approx(524e-6)
    with pytest.raises(ValueError, match="bundled alike"):
        fit_bundle_costs(busy, busy, max_slices=64)


def test_the_real_runs_lengths_are_drawn_apart_from_its_gaps() -> None:
    """Drawn from a generator seeded as the schedule's, each length came from the number that
    drew the gap before it: every long request (the top 15% of draws) followed a gap of at
    least ln(1/0.15) mean gaps, and none came in a clump (review finding). Apart, long
    requests follow short gaps as often as the others do."""
    rate = 100.0
    schedule = arrival_schedule(rate, 200.0, seed=1)
    gaps = [b - a for a, b in zip([0.0, *schedule], schedule, strict=False)]
    kinds = length_draws(len(schedule), seed=1)
    assert len(kinds) == len(schedule) and set(kinds) == {12, 100}
    lull_s = math.log(1 / 0.15) / rate
    after_short_gaps = [kind for kind, gap in zip(kinds, gaps, strict=True) if gap < lull_s]
    share = after_short_gaps.count(100) / len(after_short_gaps)
    assert 0.10 < share < 0.20, share  # the mix's 15%, not 0
    assert length_draws(len(schedule), seed=1) == kinds != length_draws(len(schedule), seed=2)


def test_the_real_side_counts_latency_from_the_scheduled_time() -> None:
    """The simulator's latency runs from its arrival; the real side's ran from the send, so a
    call the generator held back 0.3 s counted as good (review finding)."""
    held = Outcome(scheduled_s=10.0, lateness_s=0.3, latency_s=0.1, status=OK)
    side = real_side([held], warmup_s=5.0, window_s=30.0, slo_s=0.25)
    assert side.goodput_per_s == 0.0
    on_time = Outcome(scheduled_s=10.0, lateness_s=0.0, latency_s=0.1, status=OK)
    assert real_side([on_time], warmup_s=5.0, window_s=30.0, slo_s=0.25).goodput_per_s == 1 / 30
