"""FailureStreak: when a version whose batches all fail on a worker is marked failing, for how
long, and what clears it (services.gpu_worker.batching.failure_streak)."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import ExecutionFailed, Unavailable
from services.gpu_worker.batching.failure_streak import FailingConfig, FailureStreak

pytestmark = pytest.mark.unit

CONFIG = FailingConfig(batches_to_mark=3, min_span_s=1.0, hold_s=5.0, max_hold_s=12.0)


def failed_batches(streak: FailureStreak, times_s: list[float]) -> list[float | None]:
    return [streak.record(t, all_failed=True) for t in times_s]


def test_a_version_is_marked_after_enough_failed_batches_over_the_span() -> None:
    streak = FailureStreak(CONFIG)
    # Three failed batches within 0.5 s (one large request of poison rows): not yet.
    assert failed_batches(streak, [0.0, 0.2, 0.5]) == [None, None, None]
    assert not streak.is_failing(0.5)
    # The streak goes on past min_span_s: marked, for hold_s after that batch.
    assert streak.record(1.0, all_failed=True) == 5.0
    assert streak.is_failing(5.9)
    assert not streak.is_failing(6.0)


def test_a_batch_that_succeeds_ends_the_streak_and_the_mark() -> None:
    streak = FailureStreak(CONFIG)
    failed_batches(streak, [0.0, 0.6])
    streak.record(0.9, all_failed=False)  # a poison row among good ones: its batch succeeds
    assert failed_batches(streak, [1.0, 1.6]) == [None, None]  # counted from 1.0 again
    assert streak.record(2.0, all_failed=True) == 5.0
    streak.record(2.1, all_failed=False)
    assert not streak.is_failing(2.1)


def test_a_mark_that_lapses_unrepaired_comes_back_at_once_for_twice_as_long() -> None:
    streak = FailureStreak(CONFIG)
    assert failed_batches(streak, [0.0, 0.5, 1.0]) == [None, None, 5.0]
    # Failures while marked (panic-mode traffic) extend the mark; they do not mark it again.
    assert streak.record(3.0, all_failed=True) is None
    assert streak.is_failing(7.9)
    # Lapsed (no traffic): the next failed batch marks it at once, 10 s, then 12 (the cap).
    assert not streak.is_failing(8.0)
    assert streak.record(20.0, all_failed=True) == 10.0
    assert streak.record(31.0, all_failed=True) == 12.0
    # A success clears the doubling too.
    streak.record(50.0, all_failed=False)
    assert failed_batches(streak, [60.0, 60.5, 61.0]) == [None, None, 5.0]


def test_zero_batches_to_mark_never_marks() -> None:
    streak = FailureStreak(FailingConfig(batches_to_mark=0))
    assert set(failed_batches(streak, [float(t) for t in range(100)])) == {None}
    assert not streak.is_failing(99.0)


def test_rows_refused_unrun_do_not_count_as_the_model_failing() -> None:
    """`note_batch` counts a batch failed only when every row failed in the model: rows
    answered UNAVAILABLE (the worker wedged, its device lost) say nothing of the model."""
    streak = FailureStreak(FailingConfig(batches_to_mark=2, min_span_s=0.0))
    labels = ("affine", "1")
    wedged = Unavailable("ran past the executor watchdog")
    streak.note_batch(labels, [wedged, wedged], 0.0)
    streak.note_batch(labels, [wedged], 1.0)
    assert not streak.is_failing(1.0)
    failed = ExecutionFailed("model failed on this input: boom")
    streak.note_batch(labels, [failed, np.zeros(2)], 2.0)  # one row served: not failing
    streak.note_batch(labels, [failed, failed], 3.0)
    assert not streak.is_failing(3.0)
    streak.note_batch(labels, [failed], 4.0)
    assert streak.is_failing(4.0)


@pytest.mark.parametrize(
    "settings",
    [{"batches_to_mark": -1}, {"min_span_s": -1.0}, {"hold_s": 0.0}, {"max_hold_s": 1.0}],
)
def test_settings_out_of_range_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FailingConfig(**settings)  # type: ignore[arg-type]
