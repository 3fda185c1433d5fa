"""CoDel's standing-queue test (services/common/standing_queue.py) and the worker's SLO
shedding that reads it (services/gpu_worker/batching/slo_shedding.py): a burst is absorbed,
a queue that stands is held standing while a flood refills it."""

from __future__ import annotations

import pytest

from services.common.priority import PriorityClass
from services.common.standing_queue import StandingQueue
from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.slo_shedding import HOLD_INTERVALS, SloShedding
from services.gpu_worker.batching.types import BatcherConfig, BatchKey, QueuedItem

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


def queued_batcher(rows: int, latency: LatencyModel | None = None) -> Batcher:
    """A batcher of batches of 8 whose every batch is predicted at 0.1 s (or by `latency`),
    `rows` queued."""
    config = BatcherConfig(
        max_batch_size=8,
        max_queue_size=100,
        slo_s=0.25,
        upstream_budget_s=0.02,
        safety_margin_s=0.005,
        max_wait_cap_s=0.05,
    )
    batcher = Batcher(config, latency or LatencyModel(default_s=0.1))
    for i in range(rows):
        assert batcher.add(row(i, finish_by_s=None), 0.0) == Admitted()
    return batcher


def row(item_id: int, *, finish_by_s: float | None = 0.23, deadline_s: float = 10.0,
        priority: int = INTERACTIVE, slo_share: float = 1.0) -> QueuedItem:  # fmt: skip
    key = BatchKey(model="m", version="1", fingerprint="f", bucket=16)
    return QueuedItem(
        item_id=item_id,
        key=key,
        tenant="t",
        num_tokens=4,
        arrival_s=0.0,
        deadline_s=deadline_s,
        finish_by_s=finish_by_s,
        priority=priority,
        slo_share=slo_share,
    )


def standing_shedding() -> tuple[SloShedding, float]:
    """minilm's SLO (0.25 s): a lane standing once dispatches left rows that waited 0.1 s for
    an interval; returns it and the time it stood."""
    shedding = SloShedding(0.25, shed_past_slo=False, upstream_budget_s=0.02, max_linger_s=0.0)
    assert shedding.budget_s(0.0, INTERACTIVE, num_queued=5) is None
    now_s = 0.0
    while not shedding.queue.is_standing:
        now_s += 0.05
        shedding.after_dispatch(now_s, 0.1)
    return shedding, now_s


def test_slo_shedding_keeps_bounding_rows_by_the_slo_while_its_refusals_keep_the_queue_short() -> (
    None
):
    """A flood that the SLO bound keeps short: the queue empties between its arrivals (a batch
    takes every row), and rows are still bound by the SLO while online rows bound by it are
    refused behind a queue; once that stops for the hold, rows are bound by their deadlines
    again."""
    shedding, now_s = standing_shedding()
    assert shedding.budget_s(now_s, INTERACTIVE, num_queued=5) == pytest.approx(0.23)
    batcher, latency = queued_batcher(8), LatencyModel(default_s=0.1)
    refused = row(100, finish_by_s=now_s + 0.23)  # 0.2 s to finish behind a batch: refused

    for _ in range(8):  # each 0.5 s: an empty queue, a refusal
        now_s += 0.5
        assert shedding.budget_s(now_s, INTERACTIVE, num_queued=0) == pytest.approx(0.23)
        shedding.refused(now_s, refused, batcher.predicted_finish_s(refused.key, now_s), latency)
    now_s += HOLD_INTERVALS * 0.25
    assert shedding.budget_s(now_s, INTERACTIVE, num_queued=0) is None
    assert shedding.budget_s(now_s, PriorityClass.BATCH.rank, num_queued=0) is None


def test_a_drained_lane_stops_bounding_by_the_slo_after_its_hold_though_rows_stay_queued() -> None:
    """The last dispatch left no online row, but `batch` rows stay queued (held back as a
    backfill): with no dispatch to see it, the standing ends once its hold runs out."""
    shedding, now_s = standing_shedding()
    shedding.after_dispatch(now_s, 0.0)
    assert shedding.budget_s(now_s + 0.1, INTERACTIVE, num_queued=3) == pytest.approx(0.23)
    now_s += HOLD_INTERVALS * 0.25 + 0.01
    assert shedding.budget_s(now_s, INTERACTIVE, num_queued=3) is None
    # Online rows still waiting above the target after the last dispatch: it stands on.
    shedding, now_s = standing_shedding()
    now_s += HOLD_INTERVALS * 0.25 + 0.01
    assert shedding.budget_s(now_s, INTERACTIVE, num_queued=3) == pytest.approx(0.23)


@pytest.mark.parametrize(
    ("why", "refused", "queued"),
    [
        ("its own deadline, not the SLO, was its limit", row(100, deadline_s=0.2), 8),
        ("a batch row", row(100, priority=PriorityClass.BATCH.rank), 8),
        ("its own compute, nothing queued, missed the SLO", row(100), 0),
    ],
)
def test_a_refusal_that_says_nothing_about_the_queue_holds_nothing(
    why: str, refused: QueuedItem, queued: int
) -> None:
    shedding, now_s = standing_shedding()
    batcher = queued_batcher(queued)
    for _ in range(8):
        now_s += 0.5
        finish_s = batcher.predicted_finish_s(refused.key, now_s)
        shedding.refused(now_s, refused, finish_s, LatencyModel(default_s=0.1))
    assert shedding.budget_s(now_s, INTERACTIVE, num_queued=0) is None, why


def spread_latency() -> tuple[LatencyModel, BatchKey]:
    """A lane's latency model at two spreads whose batches of 8 alternate 60 and 140 ms."""
    latency, key = LatencyModel(spread_weight=2.0), row(0).key
    latency.observe(key, 1, 0.05)
    latency.observe(key, 8, 0.1)
    for seconds in [0.06, 0.14] * 10:
        latency.observe(key, 8, seconds)
    return latency, key


def test_a_row_bound_by_the_slo_is_admitted_by_four_spreads_one_bound_by_its_deadline_by_two() -> (
    None
):
    """The same predicted finish, inside the budget at two spreads and past it at four: a row
    that the SLO bounds is refused, a row its caller's deadline bounds (a burst's) admitted, and
    an SLO bound at the lane's own spreads admits it too."""
    latency, key = spread_latency()
    share = latency.budget_share(key, 4.0)
    assert 0.5 < share < 0.9

    def shedding(slo_spreads: float | None) -> SloShedding:
        return SloShedding(0.25, shed_past_slo=True, upstream_budget_s=0.02, max_linger_s=0.0,
                           slo_spreads=slo_spreads)  # fmt: skip

    assert shedding(4.0).slo_share(latency, key) == share
    assert shedding(None).slo_share(latency, key) == 1.0
    now_s = 0.0
    finish_s = queued_batcher(8, latency).predicted_finish_s(key, now_s, rank=INTERACTIVE)
    # A budget that the finish (and the safety margin) fills between its share and its whole.
    budget_s = (finish_s + 0.005 - now_s) * 2.0 / (1.0 + share)

    def add(slo_share: float, *, slo_bound: bool = True) -> Admitted | Rejected:
        if slo_bound:
            item = row(100, finish_by_s=now_s + budget_s, slo_share=slo_share)
        else:
            item = row(100, finish_by_s=None, deadline_s=now_s + budget_s, slo_share=slo_share)
        return queued_batcher(8, latency).add(item, now_s, executor_free_s=now_s)

    assert add(share) == Rejected(RejectReason.DEADLINE)
    assert add(share, slo_bound=False) == Admitted()
    assert add(1.0) == Admitted()


def test_a_queued_row_is_held_to_its_whole_slo_budget() -> None:
    """The share bounds admission's forecast only: once queued, a row is dropped unrun only when
    it could no longer finish within the whole budget."""
    item = row(1, finish_by_s=0.23, slo_share=0.5)
    assert (item.admission_limit_s, item.queue_limit_s, item.is_slo_bound) == (0.115, 0.23, True)
    assert not row(1, finish_by_s=0.23, deadline_s=0.1, slo_share=0.5).is_slo_bound
    assert row(1, priority=PriorityClass.BATCH.rank, slo_share=0.5).queue_limit_s == 10.0

    batcher = queued_batcher(0)  # every batch 0.1 s
    assert batcher.add(item, 0.0, executor_free_s=0.0) == Admitted()  # 0.105 s, within 0.115
    batcher.poll(0.1, executor_idle=False)  # 0.2 s at the soonest: past 0.115, within 0.23
    assert batcher.num_queued == 1
    batcher.poll(0.14, executor_idle=False)  # 0.24 s: past the budget, dropped
    assert batcher.num_queued == 0
