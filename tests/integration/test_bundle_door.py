"""The bundle door (services.gpu_worker.batching.bundle_door): a bundle none of whose slices
could be queued is refused whole, one status for the call, before its rows are made; a bundle
one slice of which might be queued takes the row-by-row path. And the executor's idle time
between batches (batch_gap), which the forecasts the door and admission read now count.

A real TorchScript backend (the affine model) behind a batching driver on a fake clock whose
loop is not started: nothing is dispatched, so the queue holds what each test puts in it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from services.common import metric_names as names
from services.common.errors import Overloaded
from services.common.model_repository import load_repository
from services.common.priority import PriorityClass
from services.common.tensors import tensor_to_pb
from services.gpu_worker.backends import load_backend
from services.gpu_worker.backends.base import Backend, PreparedRow, RawInput
from services.gpu_worker.batching import bundle_door
from services.gpu_worker.batching.batch_gap import BatchGap
from services.gpu_worker.batching.driver import BatchingDriver, DriverConfig
from services.gpu_worker.batching.key_queue import drain_s
from services.gpu_worker.batching.lane import Admission
from services.gpu_worker.batching.slice_admission import SliceAsk
from services.gpu_worker.batching.types import BatchKey
from services.gpu_worker.bundles import BundleRunner
from services.gpu_worker.device_busy import DeviceBusy
from services.gpu_worker.metrics import WorkerMetrics
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.clock import FakeClock
from tests.support.metrics import total
from tests.support.models import write_affine_model

pytestmark = pytest.mark.integration

INTERACTIVE = PriorityClass.INTERACTIVE.rank


@dataclass
class Door:
    driver: BatchingDriver
    backend: Backend
    clock: FakeClock
    registry: CollectorRegistry
    metrics: WorkerMetrics
    #: Rows the backend prepared, counted as they are made.
    prepared: list[int]

    def metric(self, name: str, **labels: str) -> float:
        return total(generate_latest(self.registry).decode(), name, **labels)

    def rows(self, count: int) -> Sequence[PreparedRow]:
        return self.backend.prepare_many([np.full(4, i, dtype=np.float32) for i in range(count)])

    def queue(self, count: int, tenant: str) -> Admission:
        return self.driver.admit(self.backend, self.rows(count), timeout_s=60.0, tenant=tenant)

    def refusal(self, callers: Sequence[bundle_door.Caller]) -> Exception | None:
        lane = self.driver.open_lane(self.backend)
        now = self.clock()
        return bundle_door.whole_refusal(
            lane, callers, self.backend.buckets, 1, now, None, self.metrics
        )


@pytest.fixture
async def door(tmp_path: Path) -> AsyncIterator[Door]:
    write_affine_model(tmp_path / "repo", max_queue_size=64, slo_p99_ms=1000)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    prepare_many = backend.prepare_many
    prepared: list[int] = []

    def counted(values: Sequence[RawInput]) -> list[PreparedRow]:
        prepared.append(len(values))
        return prepare_many(values)

    backend.prepare_many = counted  # type: ignore[method-assign]
    clock = FakeClock()
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    driver = BatchingDriver([backend], DriverConfig(), metrics, clock=clock)
    driver.warm_up()
    yield Door(driver, backend, clock, registry, metrics, prepared)
    await driver.drain()


def affine_bundle(slices: list[pb.Slice]) -> pb.InferRequest:
    request = pb.InferRequest(model_name="affine", model_version="1", slices=slices)
    rows = np.ones((sum(s.rows for s in slices), 4), dtype=np.float32)
    request.packed.tensor.CopyFrom(tensor_to_pb(rows))
    return request


def stand(door: Door) -> None:
    """The lane's queue stands (slo_shedding): dispatches left rows above its target for a
    whole interval."""
    shedding = door.driver.open_lane(door.backend).shedding
    target_s, interval_s = shedding.queue.target_s, shedding.queue.interval_s
    shedding.after_dispatch(door.clock.now_s - interval_s, 2 * target_s)
    shedding.after_dispatch(door.clock.now_s, 2 * target_s)
    assert shedding.queue.is_standing


async def test_a_bundle_at_a_full_queue_is_refused_whole_before_its_rows_are_made(
    door: Door,
) -> None:
    held = door.queue(64, tenant="a")
    made_before = sum(door.prepared)
    request = affine_bundle([pb.Slice(rows=1, tenant="a"), pb.Slice(rows=2, tenant="b")])
    with pytest.raises(Overloaded, match="queue is full") as refused:
        await BundleRunner(door.driver, door.metrics).infer(door.backend, request, 10.0, None)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    assert sum(door.prepared) == made_before  # no row of the bundle was made
    assert door.metric(names.WORKER_REJECTED_TOTAL, reason="queue_full") == 3  # rows
    assert door.metric(names.WORKER_REQUESTS_TOTAL, code="RESOURCE_EXHAUSTED") == 2  # slices
    assert door.driver.open_lane(door.backend).batcher.num_queued == 64
    door.driver.withdraw(held)
    assert door.refusal([bundle_door.Caller("a", 0.0, INTERACTIVE, 10.0)]) is None


async def test_a_standing_queue_refuses_a_bundle_whole_only_when_no_caller_of_it_fits(
    door: Door,
) -> None:
    """The queue stands, and the executor idles 0.3 s between batches while rows wait: the
    30 rows of tenant "flood" take four batches, past the SLO's 0.96 s budget. A flood row is
    refused, a new tenant's row goes ahead of them by fair share, and a `batch` row, which
    the SLO does not bound, fits its deadline: a bundle with any of those is not refused
    whole. What the door refuses, admission refuses row by row too."""
    door.queue(30, tenant="flood")
    stand(door)
    door.driver.open_lane(door.backend).latency.batch_gap_s = 0.3
    flood = bundle_door.Caller("flood", 0.0, INTERACTIVE, 10.0)
    light = bundle_door.Caller("light", 0.0, INTERACTIVE, 10.0)
    backlog = bundle_door.Caller("flood", 0.0, PriorityClass.BATCH.rank, 10.0)
    refused = door.refusal([flood])
    assert isinstance(refused, Overloaded) and "past its SLO" in str(refused)
    assert door.metric(names.WORKER_REJECTED_TOTAL, reason="deadline") == 1
    assert door.refusal([flood, light]) is None
    assert door.refusal([flood, backlog]) is None
    (alone,) = door.driver.admit_slices(door.backend, [SliceAsk(door.rows(1), 10.0, "flood")])
    assert isinstance(alone, Overloaded)
    (ahead,) = door.driver.admit_slices(door.backend, [SliceAsk(door.rows(1), 10.0, "light")])
    assert isinstance(ahead, Admission)


async def test_without_the_gap_the_same_queue_is_forecast_in_time(door: Door) -> None:
    """The 30 rows' four batches take a few ms on the executor: without the time it idles
    between them, the flood's row fits its SLO budget and nothing is refused."""
    door.queue(30, tenant="flood")
    stand(door)
    assert door.refusal([bundle_door.Caller("flood", 0.0, INTERACTIVE, 10.0)]) is None


async def test_a_bundle_with_a_slice_that_needs_its_own_answer_takes_the_row_path(
    door: Door,
) -> None:
    door.queue(64, tenant="a")
    runner = BundleRunner(door.driver, door.metrics)
    nan_weight = affine_bundle([pb.Slice(rows=1, tenant="a", tenant_weight=float("nan"))])
    answer = await runner.infer(door.backend, nan_weight, 10.0, None)
    (status,) = answer.slices
    assert status.code == 3 and "weight" in status.message  # INVALID_ARGUMENT, its own


def test_callers_group_slices_by_tenant_weight_and_class_with_their_latest_time() -> None:
    callers = bundle_door.callers(
        [("a", 1.0, 1, 0.5), ("a", 1.0, 1, 2.0), ("b", 1.0, 1, None), ("a", 2.0, 1, 0.1)]
    )
    assert callers == [
        bundle_door.Caller("a", 1.0, 1, 2.0),
        bundle_door.Caller("b", 1.0, 1, float("inf")),
        bundle_door.Caller("a", 2.0, 1, 0.1),
    ]
    assert bundle_door.callers([("a", float("nan"), 1, 1.0)]) is None
    assert bundle_door.callers([("a", 1.0, 1, 1.0), ("a", 1.0, 1, 0.0)]) is None


def test_the_gap_counts_only_while_rows_wait_and_one_stall_moves_it_little() -> None:
    gap = BatchGap()
    assert gap.observe(0.0, 0.002, rows_waiting=True) == 0.0  # nothing before it
    first = gap.observe(0.006, 0.008, rows_waiting=True)  # 4 ms idle with rows waiting
    assert first == pytest.approx(0.2 * 0.004)
    # A loop busy with a flood: 50 ms between batches, batch after batch.
    steady = [gap.observe(0.060 + 0.052 * i, 0.062 + 0.052 * i, rows_waiting=True)
              for i in range(40)]  # fmt: skip
    assert steady[6] > 0.02 and steady[-1] == pytest.approx(0.050, rel=0.01)
    # One 3 s stall with rows waiting; the queue was empty as that batch ended, so the next
    # batch waited for rows, not for the loop.
    stalled = gap.observe(5.0, 5.002, rows_waiting=False)
    assert steady[-1] < stalled <= 1.6 * steady[-1]
    assert gap.observe(9.0, 9.002, rows_waiting=False) < stalled
    assert gap.observe(9.1, 9.102, rows_waiting=False) < 0.8 * stalled


def test_a_queue_drains_in_its_batches_and_a_gap_before_each() -> None:
    key = BatchKey(model="m", version="1", fingerprint="", bucket=0)
    other = BatchKey(model="m", version="1", fingerprint="", bucket=1)
    rows = {key: 20, other: 3}  # batches of 8: 8, 8, 4 and 3

    def predict(_: BatchKey, size: int) -> float:
        return 0.001 * size

    assert drain_s(rows, predict, lambda _: 8) == pytest.approx(0.023)
    assert drain_s(rows, predict, lambda _: 8, 0.01) == pytest.approx(0.023 + 4 * 0.01)


async def test_the_gap_is_told_every_lane_and_exported(door: Door) -> None:
    """Batches of 2 ms, 2 ms apart, rows queued all along: each lane's forecasts and the
    worker's gauge read the same estimate."""
    door.queue(8, tenant="a")
    lane = door.driver.open_lane(door.backend)
    clock = FakeClock(0.0)
    gap = BatchGap(door.metrics.batch_gap_seconds)

    def two_ms() -> None:
        clock.now_s += 0.002

    for start_s in (0.0, 0.004, 0.008, 0.012):
        clock.now_s = start_s
        batch = DeviceBusy(two_ms, torch.device("cpu"), clock)
        batch()
        gap.ran(batch, [lane])
    assert gap.gap_s == pytest.approx(0.002 * (1 - 0.8**3))
    assert lane.latency.batch_gap_s == gap.gap_s
    assert door.metric(names.WORKER_BATCH_GAP_SECONDS) == pytest.approx(gap.gap_s)
    never_ran = DeviceBusy(two_ms, torch.device("cpu"), clock)
    gap.ran(never_ran, [lane])  # a batch that never reached the executor teaches nothing
    assert lane.latency.batch_gap_s == gap.gap_s
