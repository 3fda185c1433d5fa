"""An admission pass's bound (batching.forecast.PassBound): rows it covers skip the per-row
forecasts, and every decision stays what the per-row checks alone would make."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.common.priority import PriorityClass
from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.batching.forecast import PassBound
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.types import BatchKey, QueuedItem
from tests.unit.test_batching_policy import make_batcher, make_item, make_key

pytestmark = pytest.mark.unit

BUCKETS = (16, 32)
TENANTS = ("a", "b", "c")
RANKS = (PriorityClass.CRITICAL.rank, PriorityClass.INTERACTIVE.rank, PriorityClass.BATCH.rank)


def steep_latency(rng: random.Random) -> LatencyModel:
    """A CPU-like model: each row costs its own compute, longer rows more."""
    latency = LatencyModel(default_s=0.01)
    for bucket in BUCKETS:
        per_row_s = rng.uniform(0.0005, 0.002) * bucket / 16
        for size in (1, 2, 4, 8):
            latency.observe(make_key(bucket=bucket), size, 0.001 + per_row_s * size)
    return latency


def random_item(rng: random.Random, item_id: int, now_s: float, light: bool) -> QueuedItem:
    """A row arriving at `now_s`; `light`: with time to spare (a queue that drains in time)."""
    times_s = (0.3, 1.0) if light else (0.005, 0.02, 0.05, 0.1, 0.3, 1.0)
    deadline_s = now_s + rng.choice(times_s) * rng.uniform(0.5, 1.5)
    finish_by_s = None if rng.random() < 0.7 else now_s + rng.uniform(0.01, 0.2)
    return make_item(
        item_id=item_id,
        tenant=rng.choice(TENANTS),
        arrival_s=now_s,
        deadline_s=deadline_s,
        finish_by_s=finish_by_s,
        bucket=rng.choice(BUCKETS),
        priority=rng.choice(RANKS),
    )


def decision(outcome: Admitted | Rejected) -> RejectReason | None:
    return outcome.reason if isinstance(outcome, Rejected) else None


def test_rows_a_pass_bound_covers_get_the_decisions_the_per_row_checks_give() -> None:
    """Two batchers alike in config, model and queue: one checks each row alone, the other
    with its pass's bound. Over 300 random queues and passes (tenants, classes, two keys,
    deadlines from 5 ms to 1 s, or half of them with time to spare, some with a shedding limit,
    a batch running or not), every row
    gets the same decision from both; the bound spared many rows their forecasts, and the
    per-row checks refused many rows for their deadlines (so the two paths both ran)."""
    seen: Counter[str] = Counter()
    item_ids = iter(range(1_000_000))
    for seed in range(300):
        rng = random.Random(seed)
        latency = steep_latency(rng)
        alone, bounded = make_batcher(latency=latency), make_batcher(latency=latency)
        now_s, light = 1.0, seed % 2 == 0
        for _ in range(rng.randrange(0, 10 if light else 40)):  # the queue the pass finds
            item = random_item(rng, next(item_ids), now_s - rng.uniform(0.0, 0.02), light)
            assert decision(alone.add(item, now_s)) == decision(bounded.add(item, now_s))
        executor_free_s = None if rng.random() < 0.3 else now_s + rng.uniform(-0.005, 0.03)
        arrivals = [
            random_item(rng, next(item_ids), now_s, light) for _ in range(rng.randrange(2, 65))
        ]
        rows = Counter(item.key for item in arrivals)
        bound = bounded.pass_bound(rows, now_s, executor_free_s)
        for item in arrivals:
            covered = bound.covers(item.key, item.admission_limit_s, 0.005)  # make_batcher's margin
            whole = bound.finish_s + 0.005 <= min(item.admission_limit_s, bound.earliest_limit_s)
            expected = decision(alone.add(item, now_s, executor_free_s=executor_free_s))
            got = bounded.add(item, now_s, executor_free_s=executor_free_s, bound=bound)
            assert decision(got) == expected, (seed, item, bound.finish_s, covered)
            seen["covered" if covered else "checked"] += 1
            seen["covered by the step"] += covered and not whole
            if expected is RejectReason.DEADLINE:
                seen["refused for its deadline"] += 1
        assert alone.num_queued == bounded.num_queued
    assert seen["covered"] >= 500, seen
    assert seen["covered by the step"] >= 500, seen
    assert seen["checked"] >= 500, seen
    assert seen["refused for its deadline"] >= 500, seen


def test_a_bound_tightens_with_each_admitted_row_and_covers_only_rows_that_fit() -> None:
    key = make_key()
    bound = PassBound(finish_s=1.0, earliest_limit_s=2.0)
    assert bound.covers(key, 1.5, margin_s=0.1)
    assert not bound.covers(key, 1.05, margin_s=0.1)  # its own limit is too close
    bound.admitted(key, 1.08)  # a row with an early limit joined: later rows must not make it late
    assert not bound.covers(key, 1.5, margin_s=0.1)
    assert bound.earliest_limit_s == 1.08


def three_rows_queued() -> tuple[Batcher, BatchKey]:
    """A batcher with 3 rows of one key queued (each allowing 5 s), batches of 8 rows, each row
    0.01 s of compute; and the key."""
    latency = LatencyModel(default_s=0.01)
    key = make_key()
    for size in (1, 8):
        latency.observe(key, size, 0.01 * size)
    batcher: Batcher = make_batcher(latency=latency)
    for i in range(3):
        assert batcher.add(make_item(item_id=i, deadline_s=5.0), 0.0) == Admitted()
    return batcher, key


def test_a_bound_counts_every_row_queued_and_every_row_the_pass_brings() -> None:
    """finish_s: the whole queue plus the pass's rows, each key in its fullest batches, from
    when the running batch ends."""
    batcher, key = three_rows_queued()
    bound = batcher.pass_bound({key: 10}, now_s=0.0, executor_free_s=0.5)
    # 13 rows of one key, batches of 8: 8 + 5 rows, 0.08 + 0.05 s after the running batch ends.
    assert abs(bound.finish_s - (0.5 + 0.08 + 0.05)) < 1e-9, bound.finish_s
    assert bound.earliest_limit_s == 5.0


def test_a_standing_queue_s_pass_is_bounded_row_by_row_up_to_the_row_that_does_not_fit() -> None:
    """A queue standing (3 rows, 0.01 s of compute a row, the executor free at 0.5 s) and a
    pass of 40 rows whose limit is 0.7 s: the whole pass (0.93 s) does not fit, so the step
    bounds each row by the drain of what is queued when it asks. Rows 1-16 finish by 0.69 s
    and are covered, each counting the pass's rows admitted before it; the 17th would finish
    at 0.7 s, past its limit less the 5 ms margin, so it meets its own forecast and is refused,
    as is every row after it. The step's running sum is the drain computed afresh."""
    batcher, key = three_rows_queued()
    bound = batcher.pass_bound({key: 40}, now_s=0.0, executor_free_s=0.5)
    covered, outcomes = [], []
    for i in range(40):
        item = make_item(item_id=100 + i, deadline_s=0.7)
        covered.append(bound.covers(key, item.admission_limit_s, 0.005))
        outcomes.append(decision(batcher.add(item, 0.0, executor_free_s=0.5, bound=bound)))
    assert covered == [True] * 16 + [False] * 24
    assert outcomes == [None] * 16 + [RejectReason.DEADLINE] * 24
    assert batcher.num_queued == 19
    assert bound.step is not None  # built at the first row the whole bound did not cover
    assert abs(bound.step.finish_bound_s(key) - (0.5 + 0.01 * 20)) < 2e-9


def test_a_pass_into_an_empty_queue_has_no_step() -> None:
    """With nothing queued at the pass's start, the first row's own forecast prices it alone
    (by its floor), which a drain of the queue would not: the pass bounds its rows whole or
    not at all. A pass that fits whole builds no step either."""
    batcher: Batcher = make_batcher()
    bound = batcher.pass_bound({make_key(): 40}, now_s=0.0, executor_free_s=0.5)
    assert not bound.covers(make_key(), 0.5, 0.005)  # past what the whole pass needs
    assert bound.step is None
    queued, key = three_rows_queued()
    fits = queued.pass_bound({key: 10}, now_s=0.0, executor_free_s=0.5)
    assert fits.covers(key, 5.0, 0.005)
    assert fits.step is None


@pytest.mark.parametrize("now_s", [3.0e6, 1.0e6 + 0.123, 7.5e5])
def test_a_long_pass_on_a_clock_days_from_boot_decides_as_the_per_row_checks(now_s: float) -> None:
    """The worker's clock is seconds since boot, so a bound summed on it rounds each step at
    the clock's grain (about 5e-10 s days from boot), not the drain's. Rows with a limit a
    hair (10 ns) before where the 1,500th row of a pass is predicted to finish: the first
    1,499 are admitted, and the 1,500th is refused, as the per-row checks decide."""
    latency = LatencyModel(default_s=0.01)
    key = make_key()
    for size in (1, 8):
        latency.observe(key, size, 0.0001 * size + 0.00003)
    alone, bounded = (make_batcher(latency=latency, max_queue_size=5_000) for _ in range(2))
    for i in range(3):
        for batcher in (alone, bounded):
            assert batcher.add(make_item(item_id=i, deadline_s=now_s + 100.0), now_s) == Admitted()
    free_s = now_s + 0.01
    for i in range(1_499):  # the twin, to find where the 1,500th row is predicted to finish
        assert alone.add(make_item(item_id=10 + i, deadline_s=now_s + 100.0), now_s) == Admitted()
    row = make_item(item_id=9_999, deadline_s=now_s + 100.0)
    finish_s = alone.predicted_finish_s(key, free_s, rank=row.priority, of=row)
    limit_s = finish_s + 0.005 - 1e-8  # make_batcher's margin, less a hair
    bound = bounded.pass_bound({key: 2_000}, now_s, free_s)
    outcomes = [
        decision(bounded.add(make_item(item_id=10 + i, deadline_s=limit_s), now_s,
                             executor_free_s=free_s, bound=bound))
        for i in range(2_000)
    ]  # fmt: skip
    assert outcomes[:1_499] == [None] * 1_499
    assert set(outcomes[1_499:]) == {RejectReason.DEADLINE}
