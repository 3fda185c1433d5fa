"""When a worker's fronts have all stopped listening for long enough that it must stop serving
(services.gpu_worker.fronts.Silence, on the caller's clock), how long its stop waits for them
(fronts.front_wait_s), and when one front's stopped beats say it is hung
(beats.BeatWatch.is_hung)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common.beats import HUNG_S, BeatWatch, beat_file
from services.common.lifecycle import STOP_OVERRUN_S
from services.gpu_worker.fronts import STOP_MARGIN_S, Silence, front_wait_s

pytestmark = pytest.mark.unit


def test_lost_once_none_has_listened_for_the_whole_time() -> None:
    silence = Silence(lost_after_s=30.0)
    assert not silence.update(False, now_s=100.0)  # the first time none listens
    assert not silence.update(False, now_s=129.9)
    assert silence.update(False, now_s=130.0)
    assert not silence.update(False, now_s=200.0), "told once"


def test_a_front_listening_between_restarts_starts_the_count_again() -> None:
    silence = Silence(lost_after_s=30.0)
    assert not silence.update(False, now_s=0.0)
    assert not silence.update(True, now_s=20.0)  # one came up a while
    assert not silence.update(False, now_s=25.0)
    assert not silence.update(False, now_s=54.9)
    assert silence.update(False, now_s=55.0)


@pytest.mark.parametrize("drain_grace_s", [0.0, 5.0, 30.0])
def test_the_engine_stops_waiting_for_its_fronts_before_its_own_stop_bound(
    drain_grace_s: float,
) -> None:
    """Stopped after the engine's drain, the fronts are waited for no later than the engine's
    own bound (drain grace + STOP_OVERRUN_S) less the margin to kill and reap them: a front slow
    to stop had the bound end the engine first (exit 1, its fronts left alive), a review
    finding. Early in the stop the fronts get their drain grace and 5 s; that near the bound,
    none (SIGKILLed at once)."""
    bound_s = drain_grace_s + STOP_OVERRUN_S
    for elapsed_s in (0.0, drain_grace_s + 2.0, bound_s - 4.0, bound_s - 1.0, bound_s + 5.0):
        wait_s = front_wait_s(drain_grace_s, elapsed_s)
        assert wait_s >= 0.0
        assert elapsed_s + wait_s <= max(elapsed_s, bound_s - STOP_MARGIN_S), (elapsed_s, wait_s)
    assert front_wait_s(drain_grace_s, 0.0) == drain_grace_s + 5.0
    assert front_wait_s(30.0, 32.0) == 30.0 + STOP_OVERRUN_S - STOP_MARGIN_S - 32.0
    assert front_wait_s(drain_grace_s, bound_s - 1.0) == 0.0


def test_a_front_is_hung_once_its_beat_file_has_not_changed_for_hung_s(tmp_path: Path) -> None:
    """Counted from the first look, on the engine's clock: the file's time is only compared
    for change (a wall clock that steps makes no front hung)."""
    ready_file, watch = tmp_path / "front-0.ready.json", BeatWatch()
    assert not watch.is_hung(ready_file, 100.0)
    assert not watch.is_hung(
        ready_file, 200.0 + HUNG_S
    )  # no beat file: not judged (a disk's fault)
    beat = beat_file(ready_file)
    beat.touch()
    assert not watch.is_hung(ready_file, 300.0)  # counted from here
    assert not watch.is_hung(ready_file, 300.0 + HUNG_S)
    assert watch.is_hung(ready_file, 300.1 + HUNG_S)
    # Each beat below at a time of its own: a file's clock is coarse, and two touches within
    # one of its ticks read alike.
    os.utime(beat, ns=(5, 5))
    assert not watch.is_hung(ready_file, 400.0)  # it beat
    assert not watch.is_hung(ready_file, 400.0 + HUNG_S)
    os.utime(beat, ns=(1, 1))  # changed, even to a time long past: a beat
    assert not watch.is_hung(ready_file, 400.1 + HUNG_S)
    assert watch.is_hung(ready_file, 400.2 + 2 * HUNG_S)
