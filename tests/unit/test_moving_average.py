"""MovingAverage.observe_repeated folds a value in as many `observe` calls would, bit for bit
(the batcher folds a pass's arrivals at once: key_queue.KeyQueue.record_arrival)."""

from __future__ import annotations

import random

import pytest

from services.common.moving_average import MovingAverage

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("start", [None, 0.0, 0.25, 3e-3])
@pytest.mark.parametrize("times", [0, 1, 2, 15, 64])
def test_a_value_folded_in_times_over_equals_as_many_observations(
    start: float | None, times: int
) -> None:
    rng = random.Random(times)
    value = rng.choice((0.0, rng.random()))
    once, repeated = MovingAverage(0.2), MovingAverage(0.2)
    if start is not None:
        once.observe(start)
        repeated.observe(start)
    for _ in range(times):
        once.observe(value)
    repeated.observe_repeated(value, times)
    assert repeated.mean == once.mean  # exactly: the same arithmetic in the same order


def test_a_value_known_only_as_a_floor_raises_the_average_but_never_lowers_it() -> None:
    average = MovingAverage(0.2)
    assert average.observe_at_least(0.1) == 0.1  # the first value starts it, as observe's
    assert average.observe_at_least(0.05) == 0.1  # below: it was at least that, no news
    assert average.observe_at_least(0.6) == pytest.approx(0.2)  # above: as observe(0.6)
