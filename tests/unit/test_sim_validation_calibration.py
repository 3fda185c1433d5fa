"""The validation's calibration statistics (bench/sim_validation.py), as pure functions."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.fabric.loadgen import OK, Outcome
from bench.sim_validation import mean_hops_ms, robust_sigma

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
