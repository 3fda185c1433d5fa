"""FailureStreak: when a version whose batches all fail on a worker is marked failing, for how
long, and what clears it (services.gpu_worker.batching.failure_streak)."""

from __future__ import annotations

import traceback

import numpy as np
import pytest

from services.common.errors import ExecutionFailed, Unavailable
from services.common.sparse_log import SparseLog
from services.gpu_worker import execution
from services.gpu_worker.batching.failure_streak import FailingConfig, FailureStreak
from services.gpu_worker.execution import note_batch

pytestmark = pytest.mark.unit

CONFIG = FailingConfig(batches_to_mark=3, min_span_s=1.0, hold_s=5.0, max_hold_s=12.0)


def failed_batches(streak: FailureStreak, times_s: list[float]) -> list[float | None]:
    return [streak.record(t, all_failed=True) for t in times_s]


def test_a_version_is_marked_once_its_last_batches_all_failed_over_the_span() -> None:
    streak = FailureStreak(CONFIG)
    # Three failed batches within 0.5 s: not yet.
    assert failed_batches(streak, [0.0, 0.2, 0.5]) == [None, None, None]
    assert not streak.is_failing(0.5)
    # The last three span 0.8 s: still not; 1.1 s: marked, for hold_s after that batch.
    assert failed_batches(streak, [1.0, 1.6]) == [None, 5.0]
    assert streak.is_failing(6.5)
    assert not streak.is_failing(6.6)


def test_a_failed_batch_long_ago_does_not_stretch_a_quick_run_over_the_span() -> None:
    """On a quiet version, one failed batch an hour ago and a quick run of failures now are
    not a second of failures (review finding): a failure more than twice `max_hold_s` after
    the last starts the streak again. Within it, a lapsed mark comes back at once."""
    streak = FailureStreak(CONFIG)
    assert failed_batches(streak, [0.0, 3600.0, 3600.1, 3600.2]) == [None] * 4
    assert not streak.is_failing(3600.2)
    assert failed_batches(streak, [3601.0, 3601.5]) == [None, 5.0]
    assert streak.record(3601.5 + 2 * CONFIG.max_hold_s, all_failed=True) == 10.0


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


def told(streak: FailureStreak, results: list[object], now_s: float) -> None:
    """`note_batch` of a batch of ("affine", "1") whose rows came out as `results`."""
    failed = sum(isinstance(r, Exception) for r in results)
    note_batch(streak, ("affine", "1"), results, failed, now_s)


def test_rows_refused_unrun_neither_fail_nor_clear_a_version() -> None:
    """`note_batch`: a batch whose rows were all refused unrun (UNAVAILABLE: the worker
    wedged, its device lost) says nothing of the model either way; a batch with one row
    served is a success; rows refused unrun beside rows failed in the model do not make it
    one."""
    streak = FailureStreak(FailingConfig(batches_to_mark=2, min_span_s=0.0))
    wedged = Unavailable("ran past the executor watchdog")
    failed = ExecutionFailed("model failed on this input: boom")
    told(streak, [wedged, wedged], 0.0)
    told(streak, [wedged], 1.0)
    assert not streak.is_failing(1.0)
    told(streak, [failed, np.zeros(2)], 2.0)  # one row served: not failing
    told(streak, [failed, wedged], 3.0)
    assert not streak.is_failing(3.0)
    told(streak, [failed], 4.0)
    assert streak.is_failing(4.0)
    told(streak, [wedged], 5.0)  # not a success: the mark stands
    assert streak.is_failing(5.0)
    told(streak, [], 5.0)  # nothing asked: nothing told
    assert streak.is_failing(5.0)


@pytest.mark.parametrize(
    "settings",
    [
        {"batches_to_mark": -1},
        {"min_span_s": -1.0},
        {"min_span_s": float("nan")},
        {"hold_s": 0.0},
        {"max_hold_s": 1.0},
    ],
)
def test_settings_out_of_range_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FailingConfig(**settings)  # type: ignore[arg-type]


def test_a_model_failing_on_rows_is_logged_with_its_traceback_at_most_every_10_s(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row failed in the model reached its caller as one line (describe_failure) and was
    counted, nothing more: no log named the worker's model or held the traceback until whole
    batches kept failing (review finding). Rows refused unrun are the worker's, not the
    model's: not logged here."""
    monkeypatch.setattr(execution, "_model_failures", SparseLog(execution.log))

    def boom() -> Exception:
        try:
            raise ValueError("index 9 is out of bounds")
        except ValueError as error:
            return error

    streak = FailureStreak(CONFIG)
    told(streak, [Unavailable("ran past the executor watchdog")], 0.0)
    assert not caplog.records
    told(streak, [np.zeros(2), boom(), boom()], 1.0)
    told(streak, [boom()], 2.0)  # within 10 s of the last: left out
    (record,) = caplog.records
    assert record.getMessage() == (
        "model affine version 1 failed on 2 of 3 rows of a batch; the first:"
    )
    assert record.exc_info is not None and "out of bounds" in str(record.exc_info[1])
    assert traceback.extract_tb(record.exc_info[2])[-1].name == "boom"  # where it was raised
