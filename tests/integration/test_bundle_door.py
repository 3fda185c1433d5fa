"""The bundle door (services.gpu_worker.batching.bundle_door): a bundle none of whose slices
could be queued is refused whole, one status for the call, before its rows are made; a bundle
one slice of which might be queued takes the row-by-row path. And the executor's idle time
between batches (batch_gap), which the forecasts the door and admission read now count.

minilm (its real weights and tokenizer; batches of 8, buckets of 16 and 32 tokens, an SLO of
1 s, a queue of 64 rows) behind a batching driver on a fake clock whose loop is not started:
nothing is dispatched, so the queue holds what each test puts in it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from services.common import metric_names as names
from services.common.bundles import SliceCancels, pack_token_rows
from services.common.errors import Overloaded
from services.common.model_repository import load_repository
from services.common.priority import PriorityClass
from services.common.text import TokenIds
from services.gpu_worker.admission import Rejected, RejectReason
from services.gpu_worker.backends import load_backend
from services.gpu_worker.backends.base import Backend, PreparedRow, RawInput
from services.gpu_worker.batching import bundle_door
from services.gpu_worker.batching.batch_gap import BatchGap
from services.gpu_worker.batching.driver import BatchingDriver, DriverConfig
from services.gpu_worker.batching.key_queue import drain_s
from services.gpu_worker.batching.lane import Admission
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.slice_admission import SliceAsk, lane_key
from services.gpu_worker.batching.types import BatchKey, CloseReason, Dispatch, QueuedItem
from services.gpu_worker.bundles import BundleRunner, bundle_callers
from services.gpu_worker.device_busy import DeviceBusy
from services.gpu_worker.metrics import WorkerMetrics
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.clock import FakeClock
from tests.support.metrics import total
from tests.support.models import replace_config_lines, write_small_minilm_repository
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

INTERACTIVE, BATCH = PriorityClass.INTERACTIVE.rank, PriorityClass.BATCH.rank


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
        return self.backend.prepare_many([TokenIds(ids) for ids in token_rows(count)])

    def queue(self, count: int, tenant: str) -> Admission:
        return self.driver.admit(self.backend, self.rows(count), timeout_s=60.0, tenant=tenant)

    def refusal(self, callers: Sequence[bundle_door.Caller]) -> Exception | None:
        lane = self.driver.open_lane(self.backend)
        now = self.clock()
        return bundle_door.whole_refusal(
            lane, callers, self.backend.buckets, now, None, self.metrics
        )


@pytest.fixture
async def door(tmp_path: Path) -> AsyncIterator[Door]:
    write_small_minilm_repository(tmp_path / "repo")
    replaced = {"slo_p99_ms": "slo_p99_ms = 1000", "max_queue_size": "max_queue_size = 64"}
    replace_config_lines(tmp_path / "repo" / "minilm" / "config.toml", replaced)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    prepare_many = backend.prepare_many
    prepared: list[int] = []

    def counted(values: Sequence[RawInput]) -> list[PreparedRow]:
        prepared.append(len(values))
        return prepare_many(values)

    backend.prepare_many = counted  # type: ignore[method-assign]
    prepare_packed = backend.prepare_packed

    def counted_packed(token_ids: np.ndarray, lengths: Sequence[int]) -> list[PreparedRow] | None:
        rows = prepare_packed(token_ids, lengths)
        if rows is not None:  # a bundle's rows made at once (else prepare_many counts them)
            prepared.append(len(rows))
        return rows

    backend.prepare_packed = counted_packed  # type: ignore[method-assign]
    clock = FakeClock()
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    driver = BatchingDriver([backend], DriverConfig(), metrics, clock=clock)
    driver.warm_up()
    yield Door(driver, backend, clock, registry, metrics, prepared)
    await driver.drain()


def token_rows(count: int, first_id: int = 2000) -> list[np.ndarray]:
    """`count` rows of 8 token ids: [CLS], six words, [SEP]."""
    return [np.array([101, *range(first_id + i, first_id + i + 6), 102]) for i in range(count)]


def text_bundle(door: Door, slices: list[pb.Slice], first_id: int = 2000) -> pb.InferRequest:
    request = pb.InferRequest(
        model_name="minilm",
        model_version="1",
        fingerprint=door.backend.fingerprint,
        slices=slices,
    )
    ids, lengths = pack_token_rows(token_rows(sum(s.rows for s in slices), first_id))
    request.packed.token_ids, request.packed.row_lengths = ids, lengths
    return request


def stand(door: Door) -> None:
    """The lane's queue stands (slo_shedding): dispatches left rows above its target for a
    whole interval."""
    shedding = door.driver.open_lane(door.backend).shedding
    target_s, interval_s = shedding.queue.target_s, shedding.queue.interval_s
    shedding.after_dispatch(door.clock.now_s - interval_s, 2 * target_s)
    shedding.after_dispatch(door.clock.now_s, 2 * target_s)
    assert shedding.queue.is_standing


def set_gap(door: Door, gap_s: float) -> None:
    """The executor idles `gap_s` between batches while rows wait, as measured just now."""
    latency = door.driver.open_lane(door.backend).latency
    latency.batch_gap_s, latency.batch_gap_as_of_s = gap_s, door.clock.now_s


def batches_now_run_in(door: Door, seconds: float) -> None:
    """A batch of one row of any bucket now takes `seconds` (the others as the warm-up's curve
    says, scaled alike), as the lane's latency model learns from batches run since its
    warm-up: a forecast that must fit a budget then does not hang on how loaded the machine
    was while the fixture warmed up (a full `make test` ran it beside other tests at a
    quarter of its pace or less: 30 rows forecast at 0.98 s)."""
    lane = door.driver.open_lane(door.backend)
    for _ in range(100):  # a bounded step a batch: from any warm-up, within a few percent
        for key in lane.keys.values():
            lane.latency.observe(key, 1, seconds)


def caller(tenant: str, rank: int = INTERACTIVE) -> bundle_door.Caller:
    return bundle_door.Caller(tenant, 0.0, rank, 10.0, 1)


async def test_a_bundle_at_a_full_queue_is_refused_whole_before_its_rows_are_made(
    door: Door,
) -> None:
    held = door.queue(64, tenant="a")
    made_before = sum(door.prepared)
    request = text_bundle(door, [pb.Slice(rows=1, tenant="a"), pb.Slice(rows=2, tenant="b")])
    with pytest.raises(Overloaded, match="queue is full") as refused:
        await BundleRunner(door.driver, door.metrics).infer(door.backend, request, 10.0, None)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    assert sum(door.prepared) == made_before  # no row of the bundle was made
    assert door.metric(names.WORKER_REJECTED_TOTAL, reason="queue_full") == 3  # rows
    assert door.metric(names.WORKER_REQUESTS_TOTAL, code="RESOURCE_EXHAUSTED") == 2  # slices
    assert door.driver.open_lane(door.backend).batcher.num_queued == 64
    door.driver.withdraw(held)
    assert door.refusal([caller("a")]) is None


async def test_a_standing_queue_refuses_a_bundle_whole_only_when_no_caller_of_it_fits(
    door: Door,
) -> None:
    """The queue stands, and the executor idles 0.3 s between batches while rows wait: the
    30 rows of tenant "flood" take four batches, past the SLO's 0.96 s budget. A flood row is
    refused, a new tenant's row goes ahead of them by fair share, and a `batch` row, which
    the SLO does not bound, fits its deadline: a bundle with any of those is not refused
    whole. What the door refuses, admission refuses row by row too."""
    door.queue(30, tenant="flood")
    batches_now_run_in(door, 0.005)  # the gaps decide, not how loaded the warm-up was
    stand(door)
    set_gap(door, 0.3)
    flood, light, backlog = caller("flood"), caller("light"), caller("flood", BATCH)
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
    """The 30 rows' four batches take well under the budget on the executor: without the time
    it idles between them, or with a gap no batch refreshed for seconds (a worker idle since
    a flood), the flood's row fits its SLO budget and nothing is refused."""
    door.queue(30, tenant="flood")
    batches_now_run_in(door, 0.005)
    stand(door)
    assert door.refusal([caller("flood")]) is None
    set_gap(door, 0.3)
    door.clock.now_s += 3.0
    stand(door)
    assert door.refusal([caller("flood")]) is None


async def test_a_bundle_with_a_slice_of_its_own_answer_takes_the_row_path(door: Door) -> None:
    """At a full queue: a slice with a weight that is not a number, a row past the
    vocabulary, or a `batch` slice past what the queue takes of one, is answered
    INVALID_ARGUMENT on its own, and a slice whose caller went away before the bundle came
    CANCELLED, beside bundle-mates refused for room: never a RESOURCE_EXHAUSTED for the whole
    call that a client would resend as it is (the last from a review)."""
    door.queue(64, tenant="a")
    runner = BundleRunner(door.driver, door.metrics)
    nan_weight = text_bundle(door, [pb.Slice(rows=1, tenant="a", tenant_weight=float("nan"))])
    (status,) = (await runner.infer(door.backend, nan_weight, 10.0, None)).slices
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "weight" in status.message
    past_vocabulary = text_bundle(door, [pb.Slice(rows=1, tenant="a")], first_id=10**6)
    (status,) = (await runner.infer(door.backend, past_vocabulary, 10.0, None)).slices
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    gone = SliceCancels()
    gone.cancel(0)
    two = text_bundle(door, [pb.Slice(rows=1, tenant="a"), pb.Slice(rows=1, tenant="b")])
    answer = await runner.infer(door.backend, two, 10.0, gone)
    assert [s.code for s in answer.slices] == [
        grpc.StatusCode.CANCELLED.value[0],
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
    ]
    # A `batch` slice of 33 rows, more than the queue (64) takes of one such call: refused for
    # good on an idle worker too, so INVALID_ARGUMENT ("split it") here as well, not a hint.
    too_many = text_bundle(door, [pb.Slice(rows=33, tenant="a", priority=pb.PRIORITY_BATCH)])
    (status,) = (await runner.infer(door.backend, too_many, 10.0, None)).slices
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], status
    assert "split it" in status.message


async def test_a_row_past_the_vocabulary_refuses_its_slice_alone(door: Door) -> None:
    """A bundle of three one-row slices, the middle row past the vocabulary: that slice is
    answered INVALID_ARGUMENT, the other two are queued, each with its own row."""
    runner = BundleRunner(door.driver, door.metrics)
    request = text_bundle(door, [pb.Slice(rows=1, tenant=t) for t in ("a", "b", "c")])
    ids = np.frombuffer(request.packed.token_ids, dtype="<i4").copy()
    ids[9] = 10**6  # the second row's first word (each row: [CLS], six words, [SEP])
    request.packed.token_ids = ids.tobytes()
    call = asyncio.ensure_future(runner.infer(door.backend, request, 10.0, None))
    await eventually(lambda: door.driver.num_in_flight == 2, interval_s=0.01)
    lane = door.driver.open_lane(door.backend)
    queued = sorted(p.row.data.tolist() for p in lane.pending.values())
    assert queued == sorted(r.tolist() for r in (token_rows(3)[0], token_rows(3)[2]))
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    assert door.metric(names.WORKER_REQUESTS_TOTAL, code="INVALID_ARGUMENT") == 1


def test_callers_group_slices_by_tenant_weight_and_class_with_their_latest_time() -> None:
    slices = [  # no priority: the default class, interactive
        pb.Slice(rows=2, tenant="a", tenant_weight=1.0, earlier_us=1_500_000),
        pb.Slice(rows=1, tenant="a", tenant_weight=1.0),
        pb.Slice(rows=1, tenant="", tenant_weight=1.0),
        pb.Slice(rows=4, tenant="a", tenant_weight=2.0, earlier_us=1_900_000),
        pb.Slice(rows=1, tenant="default", tenant_weight=1.0),
    ]
    assert bundle_callers(slices, 2.0) == [
        bundle_door.Caller("a", 1.0, INTERACTIVE, 2.0, 3),
        bundle_door.Caller("default", 1.0, INTERACTIVE, 2.0, 2),
        bundle_door.Caller("a", 2.0, INTERACTIVE, pytest.approx(0.1), 4),
    ]
    assert bundle_callers(slices[:1], None) == [
        bundle_door.Caller("a", 1.0, INTERACTIVE, float("inf"), 2)
    ]
    assert bundle_callers([pb.Slice(rows=1, tenant_weight=float("nan"))], 1.0) is None
    assert bundle_callers([pb.Slice(rows=1, earlier_us=1_000_000)], 1.0) is None  # late
    assert bundle_callers([pb.Slice(rows=1, priority=99)], 1.0) is None  # no such class


def test_the_gap_counts_full_batches_ready_at_the_last_end_and_a_stall_moves_it_little() -> None:
    gap = BatchGap()
    assert gap.observe(0.0, 0.002, full_at_s=0.0, rows_waiting=True) == 0.0  # none before it
    first = gap.observe(0.006, 0.008, full_at_s=0.001, rows_waiting=True)  # 4 ms idle
    assert first == pytest.approx(0.2 * 0.004)
    # A loop busy with a flood: 50 ms between batches, batch after batch.
    steady = [gap.observe(0.060 + 0.052 * i, 0.062 + 0.052 * i, full_at_s=0.0,
                          rows_waiting=True) for i in range(40)]  # fmt: skip
    assert steady[6] > 0.02 and steady[-1] == pytest.approx(0.050, rel=0.01)
    # A linger the policy chose (not full), or rows that came after the last end: nothing.
    assert gap.observe(2.2, 2.202, full_at_s=None, rows_waiting=True) == steady[-1]
    assert gap.observe(2.3, 2.302, full_at_s=2.25, rows_waiting=True) == steady[-1]
    # One 2.7 s stall with its rows ready; the queue was empty as that batch ended, so the
    # next batch waited for rows, not for the loop.
    stalled = gap.observe(5.0, 5.002, full_at_s=0.0, rows_waiting=False)
    assert steady[-1] < stalled <= 1.6 * steady[-1]
    assert gap.observe(9.0, 9.002, full_at_s=9.0, rows_waiting=False) < stalled
    assert gap.observe(9.1, 9.102, full_at_s=9.1, rows_waiting=False) < 0.8 * stalled


def test_a_gap_no_batch_refreshed_halves_every_half_second() -> None:
    latency = LatencyModel()
    latency.batch_gap_s, latency.batch_gap_as_of_s = 0.1, 10.0
    assert latency.batch_gap_at(10.0) == 0.1
    assert latency.batch_gap_at(10.5) == pytest.approx(0.05)
    assert latency.batch_gap_at(12.0) == pytest.approx(0.1 / 16)


def test_a_queue_drains_in_its_batches_and_a_gap_before_each() -> None:
    key = BatchKey(model="m", version="1", fingerprint="", bucket=0)
    other = BatchKey(model="m", version="1", fingerprint="", bucket=1)
    rows = {key: 20, other: 3}  # batches of 8: 8, 8, 4 and 3

    def predict(_: BatchKey, size: int) -> float:
        return 0.001 * size

    assert drain_s(rows, predict, lambda _: 8) == pytest.approx(0.023)
    assert drain_s(rows, predict, lambda _: 8, 0.01) == pytest.approx(0.023 + 4 * 0.01)


async def test_the_gap_is_told_every_lane_and_exported(door: Door) -> None:
    """Full batches of 2 ms, 2 ms apart, their rows queued all along: each lane's forecasts
    and the worker's gauge read the same estimate, as of the last batch's end."""
    door.queue(8, tenant="a")
    lane = door.driver.open_lane(door.backend)
    key = lane_key(lane, door.backend.buckets[0])
    full = Dispatch(key, (QueuedItem(1, key, "a", 8, 0.0, 60.0),), CloseReason.FULL)
    clock = FakeClock(0.0)
    gap = BatchGap(door.metrics.batch_gap_seconds)

    def two_ms() -> None:
        clock.now_s += 0.002

    for start_s in (0.0, 0.004, 0.008, 0.012):
        clock.now_s = start_s
        batch = DeviceBusy(two_ms, torch.device("cpu"), clock)
        batch()
        gap.ran(batch, full, [lane])
    assert gap.gap_s == pytest.approx(0.002 * (1 - 0.8**3))
    assert (lane.latency.batch_gap_s, lane.latency.batch_gap_as_of_s) == (gap.gap_s, 0.014)
    assert door.metric(names.WORKER_BATCH_GAP_SECONDS) == pytest.approx(gap.gap_s)
    never_ran = DeviceBusy(two_ms, torch.device("cpu"), clock)
    gap.ran(never_ran, full, [lane])  # a batch that never reached the executor teaches nothing
    assert lane.latency.batch_gap_s == gap.gap_s


async def test_a_refusal_for_a_tenants_share_names_no_tenant(door: Door) -> None:
    """A bundle refused whole gives each of its callers, whatever their tenant, its first
    caller's refusal: one past its tenant's share named that tenant to the others, and that
    it was loading the model (review finding)."""
    lane = door.driver.open_lane(door.backend)
    now = door.clock()
    item = QueuedItem(
        item_id=1, key=lane_key(lane, door.backend.buckets[0]), tenant="acme-secret",
        num_tokens=8, arrival_s=now, deadline_s=now + 10.0, finish_by_s=None,
        priority=INTERACTIVE, weight=1.0,
    )  # fmt: skip
    refusal = lane.rejection(item, Rejected(RejectReason.TENANT_SHARE), now, now)
    assert isinstance(refusal, Overloaded) and "fair share" in str(refusal)
    assert "acme-secret" not in str(refusal)
