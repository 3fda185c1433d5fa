"""`batch` rows wait for urgent ones, but not until they are lost: beside online traffic that
keeps the executor busy, a key's `batch` backlog runs ahead of every batch but critical rows'
once it would otherwise miss its earliest deadline (due_rows.due_limit_s,
CloseReason.BACKFILL_DUE).
Before, it ran only when nothing more urgent was ready, so under steady online load a job's
rows expired unrun and its calls timed out (a review finding)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from services.gpu_worker.batching.fair_share import (
    DUE_BURST_S,
    DUE_SHARE,
    ComputeLedger,
    DueAllowance,
)
from services.gpu_worker.batching.lane import Lane, by_urgency
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.types import DUE_RANK, CloseReason, Dispatch, QueuedItem
from tests.unit.test_batching_policy import (
    BATCH,
    CRITICAL,
    INTERACTIVE,
    add_all,
    dispatch_of,
    flat_latency,
    ids,
    linear_latency,
    make_batcher,
    make_item,
    make_key,
)

pytestmark = pytest.mark.unit

#: 4 ms a row (a CPU: each row costs its own); batches of at most 8 rows (32 ms).
PER_ROW_S = 0.004
BATCH_DEADLINE_S = 1.0


def _online_rows(
    first_id: int, now_s: float, count: int = 8, *, time_left_s: float = 0.1
) -> list[QueuedItem]:
    """A full batch of interactive rows arriving at `now_s`, due `time_left_s` later."""
    return [
        make_item(item_id=first_id + i, arrival_s=now_s, deadline_s=now_s + time_left_s)
        for i in range(count)
    ]


def _serve_beside_steady_online_load(
    batcher: Batcher, latency: LatencyModel, until_s: float
) -> tuple[list[Dispatch], list[QueuedItem]]:
    """Runs the executor back to back until `until_s`: before each batch a full batch of
    interactive rows arrives (those admission refuses are left out), so an urgent batch is
    always ready. Returns the dispatches in order and the rows dropped unrun."""
    now_s, next_id = 0.0, 1000
    dispatches: list[Dispatch] = []
    expired: list[QueuedItem] = []
    while now_s < until_s:
        for row in _online_rows(next_id, now_s):
            batcher.add(row, now_s)
        next_id += 8
        poll = batcher.poll(now_s, executor_idle=True)
        expired.extend(poll.expired)
        dispatch = dispatch_of(poll)
        dispatches.append(dispatch)
        now_s += latency.predict(dispatch.key, len(dispatch.items))  # as long as predicted
    return dispatches, expired


@pytest.mark.parametrize("bucket", [64, 32], ids=["a-key-of-their-own", "the-online-key"])
def test_batch_rows_run_before_their_deadline_beside_steady_online_traffic(bucket: int) -> None:
    """16 `batch` rows (a job's call, deadline 1 s) beside a full batch of interactive rows
    ready at every turn: online batches run first until the backlog is due (its two batches,
    the margin and one running batch before the deadline); then both backlog batches run,
    `batch` rows first even where they share the online rows' key, and none is lost. Without
    the due rule every `batch` row expired unrun. The price: admission does not foresee the
    backlog coming due, so online rows admitted with less slack than its run are dropped
    late: no more than the run would have served."""
    latency = linear_latency(PER_ROW_S)  # bucket 64 is predicted twice bucket 32's cost
    batcher = make_batcher(latency=latency, max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, bucket=bucket, priority=BATCH,
                                deadline_s=BATCH_DEADLINE_S) for i in range(16)])  # fmt: skip
    key = make_key(bucket=bucket)
    width = batcher.max_batch_size_for(key)  # 8 rows of bucket 32, 4 of bucket 64
    run_s = 16 // width * latency.predict(key, width)
    due_at_s = BATCH_DEADLINE_S - run_s - 0.005 - batcher.batch_compute_budget_s

    dispatches, expired = _serve_beside_steady_online_load(batcher, latency, BATCH_DEADLINE_S + 0.1)

    assert [row.item_id for row in expired if row.priority == BATCH] == []
    assert len(expired) <= run_s / PER_ROW_S, expired  # online rows its run would have served
    due = [(i, d) for i, d in enumerate(dispatches) if d.reason is CloseReason.BACKFILL_DUE]
    assert [ids(d) for _, d in due] == [list(range(i, i + width)) for i in range(0, 16, width)]
    first = due[0][0]
    assert [i for i, _ in due] == list(range(first, first + len(due))), "back to back once due"
    started_s = sum(latency.predict(d.key, len(d.items)) for d in dispatches[:first])
    assert due_at_s <= started_s < due_at_s + PER_ROW_S * 8, (started_s, due_at_s)
    assert all(d.reason is not CloseReason.BACKFILL for d in dispatches[:first])
    assert all(i.priority == INTERACTIVE for d in dispatches if d not in [x for _, x in due]
               for i in d.items)  # fmt: skip


def test_a_due_backlog_takes_its_batch_rows_first_then_fills_with_online_rows() -> None:
    """Five `batch` rows due (1 s less their one batch of 32 ms, the margin and the budget) in
    the key three online rows wait in, beside a full online batch of another key: their batch
    goes first, and holds all five, then the online rows in the width left (8 rows), its
    device time counted online. Before, the online rows went alone, no `batch` row riding
    (each would add 4 ms)."""
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(5)])
    add_all(batcher, _online_rows(100, 0.0, count=3, time_left_s=2.0))
    add_all(batcher, [make_item(item_id=200 + i, bucket=64, arrival_s=0.0, deadline_s=2.0)
                      for i in range(8)])  # fmt: skip

    dispatch = dispatch_of(batcher.poll(0.93, executor_idle=True))  # due from 0.9255 s

    assert dispatch.reason is CloseReason.BACKFILL_DUE
    assert ids(dispatch) == [0, 1, 2, 3, 4, 100, 101, 102]
    assert dispatch.work == "online"


def test_only_the_group_with_little_slack_goes_first_not_the_whole_backlog() -> None:
    """Four `batch` rows due at 1 s and 200 due at 100 s, in one key: once the four are due
    they run in one batch (filled with the earliest of the others, `batch` work only), and
    then the online rows beside them go first again: a backlog with far deadlines waits on
    (the first version ran all 204 ahead of online traffic, the backlog's whole run counted
    against the earliest deadline; a review finding)."""
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(4)])
    add_all(batcher, [make_item(item_id=10 + i, priority=BATCH, deadline_s=100.0)
                      for i in range(200)])  # fmt: skip
    add_all(batcher, [make_item(item_id=1000 + i, bucket=64, deadline_s=5.0) for i in range(8)])
    assert dispatch_of(batcher.poll(0.9, executor_idle=True)).key.bucket == 64, "not due yet"
    add_all(batcher, [make_item(item_id=2000 + i, bucket=64, arrival_s=0.9, deadline_s=5.0)
                      for i in range(8)])  # fmt: skip

    due = dispatch_of(batcher.poll(0.93, executor_idle=True))
    after = dispatch_of(batcher.poll(0.962, executor_idle=True))

    assert (due.reason, ids(due)) == (CloseReason.BACKFILL_DUE, [0, 1, 2, 3, 10, 11, 12, 13])
    assert due.work == "backfill"
    assert (after.reason, after.key.bucket) == (CloseReason.FULL, 64)


@pytest.mark.parametrize(("deadline_s", "reason"), [(0.39, CloseReason.FULL),
                                                     (0.41, CloseReason.BACKFILL_DUE)])  # fmt: skip
def test_a_batch_row_with_little_patience_is_never_due(
    deadline_s: float, reason: CloseReason
) -> None:
    """A `batch` row whose deadline leaves it less than DUE_PATIENCE_SLOS of its SLO (0.39 s
    where 4 SLOs are 0.4 s) asks for online latency at `batch` priority: it is a backfill
    only, never run ahead of online rows, so the class cannot jump the queue. Just over 4 SLOs
    it is kept: due 74.5 ms before its deadline, it runs ahead of the full online batch."""
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=deadline_s)
                      for i in range(4)])  # fmt: skip
    add_all(batcher, [make_item(item_id=100 + i, bucket=64, deadline_s=5.0) for i in range(8)])

    dispatch = dispatch_of(batcher.poll(deadline_s - 0.07, executor_idle=True))

    assert dispatch.reason is reason


def test_a_due_batch_takes_the_earliest_deadlines_whatever_the_tenant() -> None:
    """Two tenants' `batch` rows in one key: the one far below its share has the later
    deadlines. The due batch takes the earliest deadlines (the rows that made it due), not the
    favoured tenant's: by share, those rows would have expired behind them."""
    ledger = ComputeLedger()
    ledger.charge("heavy", 10.0, weight=1.0)
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), ledger=ledger, max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, tenant="heavy", priority=BATCH, deadline_s=1.0)
                      for i in range(8)])  # fmt: skip
    add_all(batcher, [make_item(item_id=100 + i, tenant="light", priority=BATCH, deadline_s=9.0)
                      for i in range(8)])  # fmt: skip
    add_all(batcher, [make_item(item_id=200 + i, bucket=64, deadline_s=5.0) for i in range(8)])

    due = dispatch_of(batcher.poll(0.93, executor_idle=True))

    assert (due.reason, ids(due)) == (CloseReason.BACKFILL_DUE, list(range(8)))


@pytest.mark.parametrize(
    ("online_class", "first_when_due"),
    [(INTERACTIVE, "job"), (CRITICAL, "online")],
    ids=["beside-interactive", "beside-critical"],
)
def test_a_lane_whose_batch_rows_are_due_goes_before_interactive_rows_not_critical_ones(
    online_class: int, first_when_due: str
) -> None:
    """Across models: the lane whose `batch` rows are due ranks after critical rows and ahead
    of every other class (DUE_RANK), so the driver serves it before a lane holding a full batch
    of interactive rows, and after one of critical rows (a review finding: it went before
    those too), and forces no other lane to close."""
    ledger = ComputeLedger()
    online = make_batcher(latency=linear_latency(PER_ROW_S), ledger=ledger)
    job = make_batcher(latency=linear_latency(PER_ROW_S), ledger=ledger)
    add_all(online, [make_item(item_id=100 + i, priority=online_class, deadline_s=5.0)
                     for i in range(8)])  # fmt: skip
    add_all(job, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(4)])
    lanes = [cast(Lane, SimpleNamespace(name=name, batcher=batcher))
             for name, batcher in (("online", online), ("job", job))]  # fmt: skip

    def order(now_s: float) -> list[tuple[str, bool]]:
        return [(cast(SimpleNamespace, lane).name, force) for lane, force in
                by_urgency(lanes, now_s)]  # fmt: skip

    assert order(0.5) == [("online", False), ("job", False)], "not due yet: the backlog waits"
    job_urgency = job.urgency(0.95)
    assert job_urgency is not None and job_urgency[0] == DUE_RANK
    second = "online" if first_when_due == "job" else "job"
    assert order(0.95) == [(first_when_due, False), (second, False)]
    assert dispatch_of(job.poll(0.95, executor_idle=True)).reason is CloseReason.BACKFILL_DUE


def test_a_due_batch_in_a_key_with_critical_rows_takes_them_first() -> None:
    """In one key: critical rows, then the due `batch` rows, then interactive rows in the
    width left; and a key of ready critical rows goes before another key's due batch."""
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(5)])
    add_all(batcher, [make_item(item_id=10 + i, priority=CRITICAL, deadline_s=5.0)
                      for i in range(2)])  # fmt: skip
    add_all(batcher, [make_item(item_id=20 + i, deadline_s=5.0) for i in range(3)])
    dispatch = dispatch_of(batcher.poll(0.95, executor_idle=True))
    assert dispatch.reason is CloseReason.BACKFILL_DUE
    assert ids(dispatch) == [10, 11, 0, 1, 2, 3, 4, 20]

    other = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    add_all(other, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(4)])
    add_all(other, [make_item(item_id=10 + i, bucket=64, priority=CRITICAL, deadline_s=5.0)
                    for i in range(4)])  # fmt: skip
    first = dispatch_of(other.poll(0.95, executor_idle=True))
    assert ids(first) == [10, 11, 12, 13], "the critical key's full batch first"
    assert dispatch_of(other.poll(0.95, executor_idle=True)).reason is CloseReason.BACKFILL_DUE


def test_critical_rows_lingering_in_another_key_close_before_a_due_batch() -> None:
    """Critical rows still lingering (their key not full, a batch costing its fixed part
    whatever its width, and more rows expected 1 ms apart) do not wait for a due batch of
    another key in their lane: they close now (FULL), the due batch right after (a review
    finding: across lanes the driver forced them, within a lane the due batch ran first)."""
    batcher = make_batcher(latency=flat_latency(0.01), max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(4)])
    add_all(batcher, [make_item(item_id=10 + i, bucket=64, priority=CRITICAL,
                                arrival_s=0.947 + i * 0.001, deadline_s=5.0)
                      for i in range(3)])  # fmt: skip
    first = dispatch_of(batcher.poll(0.95, executor_idle=True))
    assert (ids(first), first.reason) == ([10, 11, 12], CloseReason.FULL)
    due = dispatch_of(batcher.poll(0.95, executor_idle=True))
    assert (ids(due), due.reason) == ([0, 1, 2, 3], CloseReason.BACKFILL_DUE)


def test_batch_rows_queued_by_an_admission_pass_come_due_alike() -> None:
    """A job's chunk queued at once by the bundle path (Batcher.push_admitted, KeyQueue.
    push_many), in two runs out of deadline order: due as rows queued one by one are, the
    earliest deadlines first."""
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    late = [make_item(item_id=i, priority=BATCH, deadline_s=3.0, weight=1.0) for i in range(4)]
    early = [make_item(item_id=10 + i, priority=BATCH, deadline_s=1.0, weight=1.0)
             for i in range(4)]  # fmt: skip
    batcher.push_admitted(late, 0.0)
    batcher.push_admitted(early, 0.0)
    add_all(batcher, [make_item(item_id=100 + i, bucket=64, deadline_s=5.0) for i in range(8)])

    assert dispatch_of(batcher.poll(0.9, executor_idle=True)).key.bucket == 64, "not due yet"
    due = dispatch_of(batcher.poll(0.93, executor_idle=True))

    assert (due.reason, ids(due)) == (CloseReason.BACKFILL_DUE, [10, 11, 12, 13, 0, 1, 2, 3])


def test_due_batches_take_no_more_than_their_share_of_the_executor() -> None:
    """The worker's due allowance (fair_share.DueAllowance): DUE_BURST_S of predicted compute
    at once, refilled at DUE_SHARE of the time passing. Spent, a key whose rows are due waits
    as a backfill again (the full online batch goes first); refilled, it runs ahead again.
    Online traffic keeps its share whatever `batch` callers send."""
    allowance = DueAllowance()
    assert allowance.has_credit(0.0)
    allowance.spend(0.0, DUE_BURST_S + 0.1)
    repaid_s = 0.1 / DUE_SHARE  # the debt, repaid at DUE_SHARE of the time passing
    assert not allowance.has_credit(repaid_s - 0.05) and allowance.has_credit(repaid_s + 0.05)
    allowance.spend(100.0, DUE_BURST_S + 0.01)  # 100 s idle banks no more than the burst
    assert not allowance.has_credit(100.04)

    ledger = ComputeLedger()
    ledger.due.spend(0.9, DUE_BURST_S + 0.007)  # in debt until 0.935 s
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), ledger=ledger, max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(4)])
    add_all(batcher, [make_item(item_id=100 + i, bucket=64, deadline_s=5.0) for i in range(8)])
    add_all(batcher, [make_item(item_id=200 + i, bucket=64, deadline_s=5.0) for i in range(8)])

    spent = dispatch_of(batcher.poll(0.93, executor_idle=True))
    refilled = dispatch_of(batcher.poll(0.945, executor_idle=True))

    assert (spent.reason, spent.key.bucket) == (CloseReason.FULL, 64)
    assert (refilled.reason, ids(refilled)) == (CloseReason.BACKFILL_DUE, [0, 1, 2, 3])


def test_the_key_with_the_earliest_due_row_goes_first() -> None:
    """Two keys whose `batch` rows are due: the one whose due row's deadline is earlier runs
    first, whatever its other rows (the first version ranked by the key's earliest limit of
    any row, here an online row's; a review finding)."""
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(4)])
    add_all(batcher, [make_item(item_id=50, arrival_s=0.9, deadline_s=0.97)])
    add_all(batcher, [make_item(item_id=10 + i, bucket=16, priority=BATCH, deadline_s=0.98)
                      for i in range(4)])  # fmt: skip
    add_all(batcher, [make_item(item_id=100 + i, bucket=64, deadline_s=5.0) for i in range(8)])

    first = dispatch_of(batcher.poll(0.95, executor_idle=True))
    second = dispatch_of(batcher.poll(0.951, executor_idle=True))

    assert [(d.reason, d.key.bucket) for d in (first, second)] == [
        (CloseReason.BACKFILL_DUE, 16),
        (CloseReason.BACKFILL_DUE, 32),
    ]


def test_rows_gone_count_neither_in_the_due_time_nor_in_the_list() -> None:
    """16 `batch` rows due at 1.0 s are cancelled, 8 due at 1.1 s stay, interleaved with 16
    more cancelled ones: the 8 come due one batch (32 ms), the margin and the budget before
    their deadline (1.0255 s), as if the others had never been queued (counted, they would
    have been three batches before it: 0.9615 s), and the list keeps only them."""
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(16)])
    add_all(batcher, [make_item(item_id=16 + i, priority=BATCH, deadline_s=1.1)
                      for i in range(24)])  # fmt: skip
    add_all(batcher, [make_item(item_id=100 + i, bucket=64, deadline_s=5.0) for i in range(16)])
    for item_id in [*range(16), *range(17, 40, 3), *range(18, 40, 3)]:
        assert batcher.cancel(item_id)
    queue = batcher._queues[make_key()]  # white box: the list's length

    assert dispatch_of(batcher.poll(1.0, executor_idle=True)).key.bucket == 64, "not due yet"
    assert len(queue.batch_limits) == 8
    due = dispatch_of(batcher.poll(1.026, executor_idle=True))
    assert (due.reason, ids(due)) == (CloseReason.BACKFILL_DUE, list(range(16, 40, 3)))


def test_a_due_batch_spends_the_allowance_only_beside_online_traffic() -> None:
    """A due batch beside online rows spends its predicted compute from the worker's allowance
    (left with less than that, the allowance is spent after it); on a worker with no online
    rows for a second it spends nothing (it displaced nobody)."""
    ledger = ComputeLedger()
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), ledger=ledger, max_queue_size=1000)
    ledger.due.spend(0.93, DUE_BURST_S - 0.02)  # 20 ms left
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(8)])
    add_all(batcher, [make_item(item_id=100 + i, bucket=64, arrival_s=0.9, deadline_s=5.0)
                      for i in range(8)])  # fmt: skip

    assert dispatch_of(batcher.poll(0.93, executor_idle=True)).reason is CloseReason.BACKFILL_DUE
    assert not ledger.due.has_credit(0.93), "a batch of 32 ms spent the 20 ms left"

    quiet = ComputeLedger()
    alone = make_batcher(latency=linear_latency(PER_ROW_S), ledger=quiet, max_queue_size=1000)
    quiet.due.spend(0.93, DUE_BURST_S - 0.02)
    add_all(alone, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(8)])
    assert dispatch_of(alone.poll(0.93, executor_idle=True)).reason is CloseReason.BACKFILL_DUE
    assert quiet.due.has_credit(0.93)


def test_a_group_past_the_allowances_burst_comes_due_early_enough_to_run_within_its_share() -> None:
    """32 `batch` rows, 4 batches of 0.8 s (3.2 s, past the 2 s burst): beyond the burst due
    batches get DUE_SHARE of the time, so the group comes due at its deadline less (3.2 - 2) /
    0.2 = 6 s, the margin and the budget (5 s): 89 s for a deadline at 100 s. Due only 3.2 s
    before (the first version), it ran out of allowance with rows left, which then expired."""
    latency = linear_latency(0.1)
    batcher = make_batcher(latency=latency, slo_s=10.0, upstream_budget_s=0.0, max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=100.0) for i in range(32)])
    add_all(batcher, [make_item(item_id=100 + i, bucket=64, deadline_s=200.0) for i in range(16)])
    assert batcher.max_batch_size_for(make_key()) == 8

    early = dispatch_of(batcher.poll(88.9, executor_idle=True))
    due = dispatch_of(batcher.poll(89.0, executor_idle=True))

    assert (early.reason, early.key.bucket) == (CloseReason.FULL, 64)
    assert (due.reason, ids(due)) == (CloseReason.BACKFILL_DUE, list(range(8)))


def test_a_backfill_ends_by_the_earliest_deadline_of_its_rows() -> None:
    """After a quiet second a backfill runs full width, but no wider than ends by the earliest
    limit of the key's rows less the margin: 8 `batch` rows due 20 ms from now (asking for
    too little patience to be kept: a backfill only) take a batch of 3 (12 ms; 8 rows take
    32 ms, and answered late). A review finding."""
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, arrival_s=4.9, deadline_s=5.02)
                      for i in range(8)])  # fmt: skip

    backfill = dispatch_of(batcher.poll(5.0, executor_idle=True))

    assert (backfill.reason, ids(backfill)) == (CloseReason.BACKFILL, [0, 1, 2])
