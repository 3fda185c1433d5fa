"""When a supervisor (a gateway group's, a worker engine's of its fronts) restarts a child that
exits (services.common.processes.Restarts): after a backoff that doubles while the child keeps
failing fast, back to the first once it ran long enough, each child on its own clock."""

from __future__ import annotations

import pytest

from services.common.processes import (
    FIRST_BACKOFF_S,
    HEALTHY_RUN_S,
    MAX_BACKOFF_S,
    Restarts,
)

pytestmark = pytest.mark.unit


def test_a_child_failing_fast_waits_twice_as_long_each_time_up_to_the_cap() -> None:
    restarts = Restarts("front")
    now_s, waits = 0.0, []
    for _ in range(10):
        restarts.exited(0, pid=100, code=1, ran_s=1.0, now_s=now_s)
        assert restarts.is_pending(0) and restarts.due(now_s) == []
        wait_s = restarts.next_in_s(now_s)
        assert wait_s is not None
        waits.append(wait_s)
        now_s += wait_s
        assert restarts.due(now_s) == [0] and not restarts.is_pending(0)
    assert waits[:4] == [FIRST_BACKOFF_S * 2**i for i in range(4)]
    assert waits[-1] == MAX_BACKOFF_S


def test_a_child_that_ran_long_enough_restarts_after_the_first_backoff_again() -> None:
    restarts = Restarts("front")
    for now_s in (0.0, 10.0, 20.0):
        restarts.exited(0, pid=100, code=1, ran_s=1.0, now_s=now_s)
        restarts.due(now_s + MAX_BACKOFF_S)
    restarts.exited(0, pid=100, code=-9, ran_s=HEALTHY_RUN_S, now_s=100.0)
    assert restarts.next_in_s(100.0) == FIRST_BACKOFF_S


def test_children_back_off_on_their_own_clocks() -> None:
    restarts = Restarts("front")
    restarts.exited(0, pid=100, code=1, ran_s=1.0, now_s=0.0)
    restarts.due(FIRST_BACKOFF_S)
    restarts.exited(0, pid=101, code=1, ran_s=1.0, now_s=1.0)  # child 0's second failure
    restarts.exited(1, pid=102, code=1, ran_s=1.0, now_s=1.0)  # child 1's first
    assert restarts.next_in_s(1.0) == FIRST_BACKOFF_S
    assert restarts.due(1.0 + FIRST_BACKOFF_S) == [1]
    assert restarts.due(1.0 + 2 * FIRST_BACKOFF_S) == [0]
    assert restarts.next_in_s(5.0) is None


def test_a_child_that_cannot_be_started_is_tried_again_after_a_backoff() -> None:
    """Starting a child fails (an OSError: no memory, no file descriptors): the supervisor's
    loop goes on, and the child is tried again after a backoff that grows while it keeps
    failing; the other children due are started. Before, the error ended the loop, and no
    child was ever restarted again."""
    restarts = Restarts("front")
    attempts: list[int] = []
    failing = {0: 2}  # child 0 fails to start twice

    def start(index: int) -> None:
        attempts.append(index)
        if failing.get(index, 0) > 0:
            failing[index] -= 1
            raise OSError(24, "Too many open files")

    restarts.exited(0, pid=100, code=1, ran_s=1.0, now_s=0.0)
    restarts.exited(1, pid=101, code=1, ran_s=1.0, now_s=0.0)
    assert restarts.start_due(FIRST_BACKOFF_S, start) == 1  # child 1 started, 0 failed
    assert restarts.is_pending(0) and not restarts.is_pending(1)
    first_wait_s = restarts.next_in_s(FIRST_BACKOFF_S)
    assert first_wait_s == 2 * FIRST_BACKOFF_S
    now_s = FIRST_BACKOFF_S + first_wait_s
    assert restarts.start_due(now_s, start) == 0  # failed again: waits twice as long
    assert restarts.next_in_s(now_s) == 4 * FIRST_BACKOFF_S
    assert restarts.start_due(now_s + 4 * FIRST_BACKOFF_S, start) == 1
    assert attempts == [0, 1, 0, 0] and not restarts.is_pending(0)
