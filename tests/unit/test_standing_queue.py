"""CoDel's standing-queue test (services/common/standing_queue.py) and the worker's SLO
shedding that reads it (services/gpu_worker/batching/slo_shedding.py): a burst is absorbed,
a queue that stands is held standing while a flood refills it."""

from __future__ import annotations

import pytest

from services.common.priority import PriorityClass
from services.common.standing_queue import StandingQueue
from services.gpu_worker.batching.slo_shedding import HOLD_INTERVALS, SloShedding

pytestmark = pytest.mark.unit

TARGET_S, INTERVAL_S = 0.025, 0.25
INTERACTIVE = PriorityClass.INTERACTIVE.rank


def stood(queue: StandingQueue) -> float:
    """Delays above the target from 0 until the queue stands; returns when it stood."""
    now_s = 0.0
    while not queue.observe(now_s, 0.1):
        now_s += 0.05
    assert INTERVAL_S <= now_s < INTERVAL_S + 0.06
    return now_s


def test_without_a_hold_one_delay_at_the_target_ends_standing() -> None:
    queue = StandingQueue(TARGET_S, INTERVAL_S)
    now_s = stood(queue)

    assert not queue.observe(now_s + 0.01, TARGET_S)
    queue.hold(now_s + 0.02)  # turned away: nothing to hold without a hold time
    assert not queue.observe(now_s + 0.03, 0.0)


def test_a_held_queue_stands_until_no_delay_above_the_target_for_the_hold() -> None:
    queue = StandingQueue(TARGET_S, INTERVAL_S, hold_s=1.0)
    now_s = stood(queue)

    # Emptied by a batch that took every row: still standing within the hold...
    assert queue.observe(now_s + 0.1, 0.0)
    # ...and one more delay above the target, however brief, starts the hold again.
    assert queue.observe(now_s + 0.5, 0.1)
    assert queue.observe(now_s + 1.4, 0.0)
    # A whole hold without one: drained.
    assert not queue.observe(now_s + 1.5, 0.0)
    # Standing again takes a whole interval above the target, as at first.
    assert not queue.observe(now_s + 1.6, 0.1)
    assert queue.observe(now_s + 1.61 + INTERVAL_S, 0.1)


def test_a_refusal_holds_a_standing_queue_and_never_starts_one() -> None:
    queue = StandingQueue(TARGET_S, INTERVAL_S, hold_s=1.0)
    queue.hold(0.0)
    assert not queue.observe(0.01, 0.0)  # not standing: a refusal alone does not make it so

    now_s = stood(queue)
    for step in range(1, 10):  # kept short by refusals, its delays at 0: held all along
        queue.hold(now_s + 0.5 * step)
        assert queue.observe(now_s + 0.5 * step + 0.01, 0.0)
    assert not queue.observe(now_s + 4.5 + 1.0, 0.0)


def test_hold_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="hold_s"):
        StandingQueue(TARGET_S, INTERVAL_S, hold_s=-1.0)


def test_slo_shedding_keeps_bounding_rows_by_the_slo_while_its_refusals_keep_the_queue_short() -> (
    None
):
    """A flood that the SLO bound keeps short: the queue empties between its arrivals (a batch
    takes every row), and rows are still bound by the SLO while they are refused; once the
    refusals and delays stop for the hold, rows are bound by their deadlines again."""
    slo_s = 0.25
    shedding = SloShedding(slo_s, shed_past_slo=False, upstream_budget_s=0.02, max_linger_s=0.0)
    hold_s = HOLD_INTERVALS * slo_s
    assert shedding.budget_s(0.0, INTERACTIVE, num_queued=5) is None
    now_s = 0.0
    while not shedding.queue.is_standing:  # dispatches leave rows that waited 0.1 s
        now_s += 0.05
        shedding.after_dispatch(now_s, 0.1)
    assert shedding.budget_s(now_s, INTERACTIVE, num_queued=5) == pytest.approx(0.23)

    for _ in range(8):  # each 0.5 s: an empty queue, a refusal
        now_s += 0.5
        assert shedding.budget_s(now_s, INTERACTIVE, num_queued=0) == pytest.approx(0.23)
        shedding.refused(now_s)
    now_s += hold_s
    assert shedding.budget_s(now_s, INTERACTIVE, num_queued=0) is None
    # A `batch` row is never bound by the SLO here, standing or not.
    assert shedding.budget_s(now_s, PriorityClass.BATCH.rank, num_queued=0) is None
