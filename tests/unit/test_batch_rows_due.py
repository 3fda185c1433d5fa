"""`batch` rows wait for urgent ones, but not until they are lost: beside online traffic that
keeps the executor busy, a key's `batch` backlog runs ahead of every other batch once it would
otherwise miss its earliest deadline (close_rule.batch_rows_due, CloseReason.BACKFILL_DUE).
Before, it ran only when nothing more urgent was ready, so under steady online load a job's
rows expired unrun and its calls timed out (a review finding)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.lane import Lane, by_urgency
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.types import DUE_RANK, CloseReason, Dispatch, QueuedItem
from tests.unit.test_batching_policy import (
    BATCH,
    INTERACTIVE,
    add_all,
    dispatch_of,
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
    """Five `batch` rows due (0.2 s less their one batch of 32 ms, the margin and the budget)
    in the key three online rows wait in, beside a full online batch of another key: their
    batch goes first, and holds all five, then the online rows in the width left (8 rows).
    Before, the online rows went alone, no `batch` row riding (each would add 4 ms)."""
    batcher = make_batcher(latency=linear_latency(PER_ROW_S), max_queue_size=1000)
    add_all(batcher, [make_item(item_id=i, priority=BATCH, deadline_s=0.2) for i in range(5)])
    add_all(batcher, _online_rows(100, 0.0, count=3, time_left_s=1.0))
    add_all(batcher, [make_item(item_id=200 + i, bucket=64, arrival_s=0.0, deadline_s=1.0)
                      for i in range(8)])  # fmt: skip

    dispatch = dispatch_of(batcher.poll(0.13, executor_idle=True))  # due from 0.1255 s

    assert dispatch.reason is CloseReason.BACKFILL_DUE
    assert ids(dispatch) == [0, 1, 2, 3, 4, 100, 101, 102]


def test_a_lane_whose_batch_rows_are_due_goes_before_a_lane_with_urgent_rows() -> None:
    """Across models: the lane whose `batch` rows are due ranks ahead of every class (DUE_RANK),
    so the driver serves it before a lane holding a full batch of critical rows, and forces no
    other lane to close."""
    ledger = ComputeLedger()
    online = make_batcher(latency=linear_latency(PER_ROW_S), ledger=ledger)
    job = make_batcher(latency=linear_latency(PER_ROW_S), ledger=ledger)
    add_all(online, [make_item(item_id=100 + i, priority=0, deadline_s=5.0) for i in range(8)])
    add_all(job, [make_item(item_id=i, priority=BATCH, deadline_s=1.0) for i in range(4)])
    lanes = [cast(Lane, SimpleNamespace(name=name, batcher=batcher))
             for name, batcher in (("online", online), ("job", job))]  # fmt: skip

    def order(now_s: float) -> list[tuple[str, bool]]:
        return [(cast(SimpleNamespace, lane).name, force) for lane, force in
                by_urgency(lanes, now_s)]  # fmt: skip

    assert order(0.5) == [("online", False), ("job", False)], "not due yet: the backlog waits"
    job_urgency = job.urgency(0.95)
    assert job_urgency is not None and job_urgency[0] == DUE_RANK
    assert order(0.95) == [("job", False), ("online", False)]
    assert dispatch_of(job.poll(0.95, executor_idle=True)).reason is CloseReason.BACKFILL_DUE
