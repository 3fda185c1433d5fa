"""An admission pass's covered slices (slice_admission.CoveredRows), queued together at the
pass's end, make the decisions the row-by-row path makes and leave the batcher as it leaves it.

The same seeded traffic meets two batching drivers over one minilm backend (its real
tokenizer; batches of 8, buckets of 16 and 32 tokens, an SLO of 400 ms with shedding past it,
a queue of 64 rows), their latency models seeded alike and their clocks fake, their loops not
started: one admits as the worker does, the other with the covered path turned off. Passes of
mixed callers (one row mostly, some of two or three; three tenants, weights, classes, deadlines
from none to past; now and then a bad weight) cross the room the covered path may take and
the queue's end, withdrawals come and go, batches are taken. Every slice's outcome, the
refusals counted, the queue's counts, the fair-share ledger, the arrival estimate and the
order every batch is then taken in must be the same.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from services.common import metric_names as names
from services.common.model_repository import load_repository
from services.common.priority import PriorityClass
from services.common.text import TokenIds
from services.gpu_worker.backends import load_backend
from services.gpu_worker.backends.base import Backend, PreparedRow
from services.gpu_worker.batching import driver as driver_module
from services.gpu_worker.batching import slice_admission
from services.gpu_worker.batching.driver import BatchingDriver, DriverConfig
from services.gpu_worker.batching.forecast import PassBound
from services.gpu_worker.batching.lane import Admission, Lane
from services.gpu_worker.batching.slice_admission import SliceAsk, lane_key
from services.gpu_worker.batching.types import Dispatch, QueuedItem
from services.gpu_worker.metrics import WorkerMetrics
from tests.support.clock import FakeClock
from tests.support.metrics import total
from tests.support.models import replace_config_lines, write_small_minilm_repository

pytestmark = pytest.mark.integration

TENANTS = ("a", "b", "c")
PRIORITIES = (PriorityClass.INTERACTIVE,) * 7 + (PriorityClass.CRITICAL, PriorityClass.BATCH)
#: Callers' time left: calm passes' (which a pass's bound covers), and any.
CALM_TIMEOUTS_S = (None, 10.0, 2.0, 1.0)
TIMEOUTS_S = (*CALM_TIMEOUTS_S, 0.4, 0.2, 0.08, 0.03, 0.0)
WEIGHTS = (0.0, 0.0, 0.0, 0.5, 2.0)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    repository = tmp_path_factory.mktemp("covered") / "repo"
    write_small_minilm_repository(repository)
    replaced = {
        "slo_p99_ms": "slo_p99_ms = 400",
        "shed_past_slo": "shed_past_slo = true",
        "max_queue_size": "max_queue_size = 64",
    }
    replace_config_lines(repository / "minilm" / "config.toml", replaced)
    (version,) = load_repository(repository)
    return load_backend(version, torch.device("cpu"))


@dataclass
class Run:
    """One driver's run of the traffic, and what it saw."""

    driver: BatchingDriver
    lane: Lane
    clock: FakeClock
    registry: CollectorRegistry
    #: Every observation, in order (outcomes, snapshots, batches).
    seen: list[Any] = field(default_factory=list)
    #: item id -> (pass, slice, row): items compared by whose row they are, not by id.
    label_of: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def labels(self, items: Any) -> list[tuple[int, int, int]]:
        return [self.label_of[item.item_id] for item in items]


def new_run(backend: Backend) -> Run:
    clock = FakeClock()
    registry = CollectorRegistry()
    driver = BatchingDriver([backend], DriverConfig(), WorkerMetrics(registry), clock=clock)
    lane = driver.open_lane(backend)
    for bucket in backend.buckets:  # seeded alike, not measured: both drivers decide alike
        key = lane_key(lane, bucket)
        for size in (1, 2, 4, 8):
            lane.latency.observe(key, size, 0.004 + 0.0015 * size * bucket / 16)
    return Run(driver, lane, clock, registry)


def rows_of(backend: Backend, rng: random.Random, count: int) -> list[PreparedRow]:
    """`count` rows of 6 or 20 tokens (the 16 and 32 buckets)."""
    lengths = [rng.choice((4, 4, 4, 18)) for _ in range(count)]
    ids = [np.array([101, *range(2000, 2000 + n), 102]) for n in lengths]
    return backend.prepare_many([TokenIds(i) for i in ids])


def asks_of(backend: Backend, rng: random.Random) -> list[SliceAsk]:
    asks = []
    timeouts_s = CALM_TIMEOUTS_S if rng.random() < 0.6 else TIMEOUTS_S
    for _ in range(rng.randint(1, 16)):
        count = 1 if rng.random() < 0.8 else rng.randint(2, 3)
        weight = rng.choice(WEIGHTS) if rng.random() > 0.01 else rng.choice((-1.0, math.nan))
        asks.append(
            SliceAsk(
                rows_of(backend, rng, count),
                rng.choice(timeouts_s),
                rng.choice(TENANTS),
                rng.choice(PRIORITIES),
                weight,
            )
        )
    return asks


def outcome(result: Admission | Exception) -> tuple[str, str]:
    if isinstance(result, Admission):
        return ("admitted", str(len(result.item_ids)))
    return (type(result).__name__, str(result))


def snapshot(run: Run) -> dict[str, Any]:
    """What the next decisions read: the queue's counts by key, class and tenant, its limits and
    arrivals, the fair-share ledger and the classes' heads."""
    batcher, now = run.lane.batcher, run.clock()
    queues = batcher._queues  # the state compared is the batcher's own
    keys: dict[Any, Any] = {}
    for key in batcher.queued_keys():
        queue = queues[key]
        keys[key] = (
            sorted(run.labels(queue.items)),
            [queue.items.count_at_most(rank) for rank in range(3)],
            [sorted(queue.items.rows_by_tenant(rank).items()) for rank in range(3)],
            list(queue.items.tenants()),  # the order tenants joined in
            queue.earliest_limit_s(),
            queue.oldest_urgent_arrival_s(),
            queue.arrival_gap_s(now),
            queue.last_add_s,
        )
    ledger = batcher._ledger
    return {
        "keys": keys,
        "queued": batcher.num_queued,
        "room": batcher.unchecked_room,
        "head": batcher.head_rank(),
        "wait": batcher.oldest_urgent_wait_s(now),
        "virtual": [ledger.virtual_s(t) for t in TENANTS],
        "ledger_queued": dict(ledger._queued),
        "ledger_urgent": dict(ledger._queued_urgent),
        "last_urgent": ledger.last_urgent_s,
        "weights": dict(batcher._weights),
        "pending": sorted(run.label_of[item_id] for item_id in run.lane.pending),
    }


def bound_state(bound: PassBound | None) -> tuple[Any, ...] | None:
    """A pass's bound as its last row left it (forecast.PassBound, its Step's running sum)."""
    if bound is None:
        return None
    step = bound.step
    steps = None if step is None else (step._drain_s, sorted(step._counts.items()))
    return (bound.finish_s, bound.earliest_limit_s, steps)


def play(
    run: Run, backend: Backend, seed: int, passes: int, bounds: list[PassBound | None]
) -> None:
    """The seeded traffic on `run`'s driver; `bounds` gets each pass's bound as it is built."""
    rng = random.Random(seed)
    admitted: list[Admission] = []
    for number in range(passes):
        run.clock.now_s += rng.choice((0.0, 0.0, 0.001, 0.01, 0.05))
        # A batch running (the executor busy, its predicted end ahead), or none: a pass into
        # an empty queue then takes the covered path only while one runs.
        busy_for_s = rng.choice((None, None, 0.002, 0.02))
        run.driver._running_until_s = None if busy_for_s is None else run.clock() + busy_for_s
        asks = asks_of(backend, rng)
        results = run.driver.admit_slices(backend, asks)
        run.seen.append([outcome(r) for r in results])
        run.seen.append(bound_state(bounds[-1]))
        for index, result in enumerate(results):
            if isinstance(result, Admission):
                admitted.append(result)
                for row, item_id in enumerate(result.item_ids):
                    run.label_of[item_id] = (number, index, row)
        for _ in range(rng.choice((0, 0, 1, 3))):  # callers that stop waiting
            if admitted:
                run.driver.withdraw(admitted.pop(rng.randrange(len(admitted))))
        for _ in range(rng.choice((0, 1, 2, 3, 4))):  # batches taken (and what expired dropped)
            poll = run.lane.batcher.poll(run.clock(), executor_idle=True)
            taken = poll.action.items if isinstance(poll.action, Dispatch) else ()
            run.seen.append(("batch", run.labels(taken), run.labels(poll.expired)))
        run.seen.append(snapshot(run))
    for _ in range(1000):  # every batch left, in the order the batcher takes them
        if not run.lane.batcher.num_queued:
            break
        run.clock.now_s += 0.001
        poll = run.lane.batcher.poll(run.clock(), executor_idle=True)
        taken = poll.action.items if isinstance(poll.action, Dispatch) else ()
        run.seen.append(("drain", run.labels(taken), run.labels(poll.expired)))
    refused = names.WORKER_REJECTED_TOTAL
    metrics = generate_latest(run.registry).decode()
    reasons = ("queue_full", "deadline", "tenant_share", "draining")
    run.seen.append([total(metrics, refused, reason=reason) for reason in reasons])


def counting(taken: list[int], refused: list[int]) -> Callable[..., Any]:
    """CoveredRows.admit, counting the slices it takes and those it leaves to the row path."""
    admit = slice_admission.CoveredRows.admit

    def counted(self: slice_admission.CoveredRows, ask: SliceAsk) -> Admission | None:
        result = admit(self, ask)
        (taken if result is not None else refused).append(1)
        return result

    return counted


@pytest.mark.parametrize("seed", range(8))
async def test_covered_slices_are_decided_and_queued_as_the_row_path_would(
    backend: Backend, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[int] = []
    left: list[int] = []
    bounds: list[PassBound | None] = []
    built = driver_module.pass_bound
    monkeypatch.setattr(
        driver_module, "pass_bound", lambda *a: bounds.append(built(*a)) or bounds[-1]
    )
    monkeypatch.setattr(slice_admission.CoveredRows, "admit", counting(taken, left))
    covered = new_run(backend)
    play(covered, backend, seed, 80, bounds)
    monkeypatch.setattr(slice_admission.CoveredRows, "admit", lambda self, ask: None)
    row_by_row = new_run(backend)
    play(row_by_row, backend, seed, 80, bounds)

    for step, (mine, theirs) in enumerate(zip(covered.seen, row_by_row.seen, strict=True)):
        assert mine == theirs, f"step {step} differs"
    # The traffic tried what it is for: slices taken together, slices left to the row path,
    # refusals of several kinds, rows queued and taken in batches.
    outcomes = [kind for seen in covered.seen if isinstance(seen, list) for kind in seen]
    kinds = {kind[0] for kind in outcomes if isinstance(kind, tuple)}
    assert len(taken) > 100 and len(left) > 50
    assert {"admitted", "Overloaded", "DeadlineExceeded"} <= kinds
    batches = [seen[1] for seen in covered.seen if isinstance(seen, tuple) and seen[0] == "batch"]
    assert sum(map(len, batches)) > 100


def test_a_slice_admitted_without_a_running_loop_fails_with_nothing_queued(
    backend: Backend,
) -> None:
    """Its future is made before any row is queued: called outside an event loop, each slice
    fails RuntimeError, on the covered path and the row path alike, and the lane holds neither
    a queued row nor a pending one (the driver would meet a queued row with no pending entry
    at its next dispatch, KeyError). One row queued first, so the pass is not an idle lane's."""
    run = new_run(backend)
    batcher, now = run.lane.batcher, run.clock()
    (row,) = rows_of(backend, random.Random(0), 1)
    key = lane_key(run.lane, row.bucket)
    batcher.add(QueuedItem(10**9, key, "held", row.num_tokens, now, now + 60.0), now)
    asks = [SliceAsk(rows_of(backend, random.Random(n), 1), 10.0, "a") for n in range(3)]
    asks.append(SliceAsk(rows_of(backend, random.Random(3), 2), 0.001, "a"))  # the row path
    results = run.driver.admit_slices(backend, asks)
    assert [type(r) for r in results] == [RuntimeError] * 4
    assert batcher.num_queued == 1 and not run.lane.pending
