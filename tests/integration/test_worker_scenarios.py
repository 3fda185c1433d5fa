"""RELIABILITY.md scenarios 1, 2, 6/7 and 13-16 against a real in-process worker.

Each test starts a grpc.aio worker on port 0 over a repository of real TorchScript models and
calls it over gRPC. Where a scenario needs the executor held, the repository also serves the
`stall` model (tests/support/models.py): a call with a `STALL` row really blocks the worker's
one executor thread, shared by every model of the device, until the test opens its gate. The
batches of the other models then queue exactly as they would behind a long batch of their own,
and their latency models never see the stall.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from services.common import metric_names as names
from services.gpu_worker import server
from services.gpu_worker.batching.driver import BatchingDriver
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.server import Worker, create_worker
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.clock import FakeClock
from tests.support.metrics import total
from tests.support.models import (
    STALL,
    affine_reference,
    infer_request,
    outputs,
    release_stall,
    row,
    versioned_affine_reference,
    write_affine_model,
    write_stalling_model,
    write_versioned_affine_model,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

#: Client timeout of calls that must not time out (generous: the machine is shared).
PATIENT_S = 30.0
#: A generous SLO: these tests pin down counts and statuses, not speed.
SLO_MS = 30_000


def expected(*rows: np.ndarray) -> np.ndarray:
    return affine_reference(torch.from_numpy(np.stack(rows))).numpy()


def metric(worker: Worker, name: str, **labels: str) -> float:
    return total(generate_latest(worker.metrics.registry).decode(), name, **labels)


def retry_hint_ms(error: grpc.aio.AioRpcError) -> int:
    return int(dict(error.trailing_metadata() or ()).get("retry-after-ms", "0"))


@pytest.fixture
async def gate(tmp_path: Path) -> AsyncIterator[Path]:
    """The `stall` model in `tmp_path/repo`; its gate is opened after the test whatever happens."""
    gate = tmp_path / "gate"
    write_stalling_model(tmp_path / "repo", gate)
    yield gate
    release_stall(gate)


async def start(tmp_path: Path, batching: DriverConfig | None = None) -> Worker:
    config = WorkerConfig(
        model_repository=tmp_path / "repo",
        grpc_port=0,
        metrics_port=0,
        batching=batching or DriverConfig(),
    )
    worker = await create_worker(config)
    await worker.load()
    return worker


async def hold_executor(worker: Worker, stub: pb_grpc.WorkerServiceStub) -> asyncio.Future:
    """Starts a `stall` call and returns it once its batch holds the executor."""
    blocker = asyncio.ensure_future(
        stub.Infer(infer_request("stall", row(STALL, 0, 0, 0)), timeout=60)
    )
    await eventually(lambda: worker.batching.is_executing, interval_s=0.01, message="stalled")
    return blocker


def waker(stub: pb_grpc.WorkerServiceStub) -> asyncio.Future:
    """A call of the `stall` model (not stalling) whose admission wakes the batching loop; it
    runs once the executor is free."""
    return asyncio.ensure_future(
        stub.Infer(infer_request("stall", row(0, 0, 0, 0)), timeout=PATIENT_S)
    )


def in_flight(worker: Worker) -> int:
    assert worker.batching is not None
    return worker.batching.num_in_flight


async def test_s01_a_burst_past_the_queue_cap_is_refused_while_the_running_batch_holds(
    tmp_path: Path, gate: Path
) -> None:
    cap, extra = 4, 6
    write_affine_model(tmp_path / "repo", max_batch_size=2, max_queue_size=cap, slo_p99_ms=SLO_MS)
    worker = await start(tmp_path)
    rows = [row(i, 1, 0, 0) for i in range(cap + extra)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            blocker = await hold_executor(worker, stub)
            calls = [
                asyncio.ensure_future(stub.Infer(infer_request("affine", r), timeout=PATIENT_S))
                for r in rows
            ]
            await eventually(lambda: sum(c.done() for c in calls) >= extra, interval_s=0.01)
            # Fail fast: every refusal is in while the running batch still holds the executor,
            # and exactly the cap is queued behind it.
            assert not blocker.done()
            assert in_flight(worker) == cap + 1
            refused = [c for c in calls if c.done()]
            queued = [c for c in calls if not c.done()]
            release_stall(gate)
            answers = await asyncio.gather(*queued)
            await blocker
    finally:
        release_stall(gate)
        await worker.stop()
    errors = [c.exception() for c in refused]
    assert len(errors) == extra
    assert all(isinstance(e, grpc.aio.AioRpcError) for e in errors), errors
    assert {e.code() for e in errors} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all("queue is full" in (e.details() or "") for e in errors)
    assert all(retry_hint_ms(e) > 0 for e in errors), [retry_hint_ms(e) for e in errors]
    queued_rows = [rows[calls.index(c)] for c in queued]
    got = np.concatenate([outputs(a) for a in answers])
    np.testing.assert_allclose(got, expected(*queued_rows), rtol=1e-5, atol=1e-6)
    assert metric(worker, names.WORKER_REJECTED_TOTAL, model="affine", reason="queue_full") == extra
    assert metric(worker, names.WORKER_ROWS_TOTAL, model="affine") == cap


async def test_s02_a_same_tick_burst_admits_exactly_the_cap_and_the_gauges_return_to_zero(
    tmp_path: Path, gate: Path
) -> None:
    cap, burst = 5, 24
    write_affine_model(tmp_path / "repo", max_batch_size=8, max_queue_size=cap, slo_p99_ms=SLO_MS)
    worker = await start(tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            blocker = await hold_executor(worker, stub)
            # One gather: every call is sent in the same tick of the (shared) event loop.
            burst_done = asyncio.gather(
                *(
                    stub.Infer(infer_request("affine", row(i, 2, 0, 0)), timeout=PATIENT_S)
                    for i in range(burst)
                ),
                return_exceptions=True,
            )
            await eventually(
                lambda: metric(worker, names.WORKER_REJECTED_TOTAL, model="affine") >= burst - cap,
                interval_s=0.01,
            )
            queued_while_held = metric(worker, names.WORKER_QUEUE_DEPTH, model="affine")
            in_flight_while_held = in_flight(worker)
            release_stall(gate)
            results = await burst_done
            await blocker
        await eventually(lambda: in_flight(worker) == 0, message="nothing in flight")
    finally:
        release_stall(gate)
        await worker.stop()
    assert queued_while_held == cap
    assert in_flight_while_held == cap + 1
    answered = [r for r in results if isinstance(r, pb.InferResponse)]
    refused = [r for r in results if not isinstance(r, pb.InferResponse)]
    assert len(answered) == cap
    assert all(isinstance(r, grpc.aio.AioRpcError) for r in refused), refused
    assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len(refused) == burst - cap
    assert metric(worker, names.WORKER_REJECTED_TOTAL, model="affine") == burst - cap
    assert metric(worker, names.WORKER_ROWS_TOTAL, model="affine") == cap
    for model in ("affine", "stall"):
        assert metric(worker, names.WORKER_QUEUE_DEPTH, model=model) == 0


async def test_s06_s07_a_row_whose_deadline_passes_in_the_queue_is_answered_at_once_unrun(
    tmp_path: Path, gate: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker expires a queued row once even running it at once would miss the deadline.
    # Its batching runs on a clock the test moves (the driver takes one): the row's deadline
    # passes in the queue when the test says, while gRPC's own deadline timers (real time) are
    # far off on either side, so the answer below is the worker's expiry, not a cancellation,
    # and the drop is counted as expired. Who answered is read from the answer ("was not run" is
    # the worker's; gRPC's own deadline says "Deadline Exceeded"), not from how long it took.
    clock = FakeClock()
    monkeypatch.setattr(server, "BatchingDriver", functools.partial(BatchingDriver, clock=clock))
    write_affine_model(
        tmp_path / "repo", "slow", work_iters=400, max_batch_size=1, slo_p99_ms=SLO_MS
    )
    worker = await start(tmp_path)
    assert worker.models is not None and worker.batching is not None
    (slow,) = (b for b in worker.models.fixed_cost if b.config.name == "slow")
    compute_s = worker.batching.load_report(slow).min_batch_s  # as warm-up measured it
    time_left_s = 20.0  # the row's, within its SLO (30 s): bound by its deadline alone
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            blocker = await hold_executor(worker, stub)
            # Admitted (the stall is predicted to be short and nothing else is queued), then
            # held in the queue past its deadline by a batch that runs far longer than predicted.
            admitted_s, sent_s = clock.now_s, time.monotonic()
            call = asyncio.ensure_future(
                stub.Infer(infer_request("slow", row(3, 3, 3, 3)), timeout=time_left_s)
            )
            await eventually(
                lambda: metric(worker, names.WORKER_QUEUE_DEPTH, model="slow") == 1,
                interval_s=0.01,
                message="the row queued",
            )
            # Its deadline is its time left as the worker read it (real time: between
            # time_left_s less the call's transit, at most `in_transit_s`, and time_left_s) on
            # the driver's clock; a row of another model wakes the batching loop (admission
            # does). Seconds before its deadline, it is still queued ...
            in_transit_s = time.monotonic() - sent_s
            clock.now_s = admitted_s + time_left_s - in_transit_s - compute_s - 5.0
            wakers = [waker(stub)]
            await eventually(
                lambda: metric(worker, names.WORKER_QUEUE_DEPTH, model="stall") == 1,
                interval_s=0.01,
                message="the waker queued",
            )
            await asyncio.sleep(0.2)  # a turn of the batching loop: an early expiry would show
            assert not call.done(), "expired seconds before its deadline"
            assert metric(worker, names.WORKER_QUEUE_DEPTH, model="slow") == 1
            # ... and once it could no longer run in time, it is answered unrun.
            clock.now_s = admitted_s + time_left_s - compute_s / 2
            wakers.append(waker(stub))
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call
            assert not blocker.done(), "answered while the blocking batch still ran"
            release_stall(gate)
            await blocker
            await asyncio.gather(*wakers)
    finally:
        release_stall(gate)
        await worker.stop()  # drains: anything still queued would run now
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "was not run" in (raised.value.details() or ""), raised.value.details()
    assert metric(worker, names.WORKER_DROPPED_TOTAL, model="slow", reason="expired") == 1
    assert metric(worker, names.WORKER_DROPPED_TOTAL, model="slow", reason="cancelled") == 0
    assert metric(worker, names.WORKER_ROWS_TOTAL, model="slow") == 0, "the model never ran it"


async def test_a_row_held_past_its_slo_bound_is_refused_unrun_while_its_deadline_allows_it(
    tmp_path: Path, gate: Path
) -> None:
    # A model that sheds past its SLO (2 s): a row admitted within it (the stall ahead is
    # predicted short) and then held in the queue by a batch that runs far longer is refused
    # once it could no longer finish within the SLO, RESOURCE_EXHAUSTED with a retry hint, though
    # its caller would wait 30 s: an answer past the SLO is what the bound exists to prevent.
    model_dir = write_affine_model(tmp_path / "repo", "shed", slo_p99_ms=2_000)
    config = model_dir / "config.toml"
    config.write_text("shed_past_slo = true\n" + config.read_text())  # a top-level key
    worker = await start(tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            blocker = await hold_executor(worker, stub)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Infer(infer_request("shed", row(1, 2, 3, 4)), timeout=PATIENT_S)
            assert not blocker.done(), "answered while the blocking batch still ran"
            release_stall(gate)
            await blocker
    finally:
        release_stall(gate)
        await worker.stop()
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "could no longer finish within its SLO" in (raised.value.details() or "")
    assert retry_hint_ms(raised.value) > 0
    assert metric(worker, names.WORKER_DROPPED_TOTAL, model="shed", reason="past_slo") == 1
    assert metric(worker, names.WORKER_DROPPED_TOTAL, model="shed", reason="expired") == 0
    assert metric(worker, names.WORKER_ROWS_TOTAL, model="shed") == 0, "the model never ran it"


async def test_s13_a_held_scheduler_forms_exactly_the_configured_batches(
    tmp_path: Path, gate: Path
) -> None:
    num_rows, max_batch = 10, 4
    write_affine_model(tmp_path / "repo", max_batch_size=max_batch, slo_p99_ms=SLO_MS)
    worker = await start(tmp_path)
    rows = [row(i, -i, 1, 2) for i in range(num_rows)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            blocker = await hold_executor(worker, stub)
            calls = [
                asyncio.ensure_future(stub.Infer(infer_request("affine", r), timeout=PATIENT_S))
                for r in rows
            ]
            await eventually(lambda: in_flight(worker) == num_rows + 1, interval_s=0.01)
            release_stall(gate)
            answers = await asyncio.gather(*calls)
            await blocker
    finally:
        release_stall(gate)
        await worker.stop()
    got = np.concatenate([outputs(a) for a in answers])
    np.testing.assert_allclose(got, expected(*rows), rtol=1e-5, atol=1e-6)
    size = names.WORKER_BATCH_SIZE
    assert metric(worker, f"{size}_count", model="affine") == 3
    assert metric(worker, f"{size}_sum", model="affine") == num_rows
    # Cumulative buckets: no batch of 1, one of 2, three of at most 4: sizes 4, 4, 2.
    assert metric(worker, f"{size}_bucket", model="affine", le="1.0") == 0
    assert metric(worker, f"{size}_bucket", model="affine", le="2.0") == 1
    assert metric(worker, f"{size}_bucket", model="affine", le="4.0") == 3
    assert metric(worker, names.WORKER_BATCHES_TOTAL, model="affine") == 3
    assert metric(worker, names.WORKER_BATCHES_TOTAL, model="affine", reason="full") == 2


async def _executions_of_twelve_singles(
    tmp_path: Path, max_wait_cap_s: float, max_batch_size: int = 16
) -> tuple[float, float]:
    """Sends 12 single-row calls that are all in flight together, each started once the worker
    has admitted the one before and its executor is idle (so arrivals never overlap a batch by
    chance). Returns how many batches ran them, and how many of those closed full."""
    write_affine_model(tmp_path / "repo", max_batch_size=max_batch_size, slo_p99_ms=SLO_MS)
    # min_expected_arrivals=0: the batcher lingers the whole max_wait instead of closing early
    # when it expects no more arrivals; the linger is the only knob that differs.
    config = DriverConfig(max_wait_cap_s=max_wait_cap_s, min_expected_arrivals=0)
    worker = await start(tmp_path, config)
    assert worker.batching is not None
    driver = worker.batching
    rows = [row(i, 0, 1, 0) for i in range(12)]

    def admitted() -> float:
        return driver.num_in_flight + metric(worker, names.WORKER_ROWS_TOTAL, model="affine")

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            calls = []
            for i, r in enumerate(rows):
                calls.append(
                    asyncio.ensure_future(stub.Infer(infer_request("affine", r), timeout=PATIENT_S))
                )
                await eventually(
                    lambda n=i + 1: admitted() >= n and not driver.is_executing,
                    interval_s=0.005,
                )
            answers = await asyncio.gather(*calls)
    finally:
        await worker.stop()
    got = np.concatenate([outputs(a) for a in answers])
    np.testing.assert_allclose(got, expected(*rows), rtol=1e-5, atol=1e-6)
    assert metric(worker, names.WORKER_ROWS_TOTAL, model="affine") == 12
    batches = names.WORKER_BATCHES_TOTAL
    return metric(worker, batches, model="affine"), metric(
        worker, batches, model="affine", reason="full"
    )


async def test_s14_zero_linger_runs_twelve_singles_alone_and_positive_linger_batches_them(
    tmp_path: Path,
) -> None:
    (tmp_path / "zero").mkdir()
    (tmp_path / "positive").mkdir()
    assert (await _executions_of_twelve_singles(tmp_path / "zero", 0.0))[0] == 12
    # A linger far longer than the 12 arrivals take, and a batch of exactly 12: one execution,
    # closed because it was full (a batch closed by its linger running out would say "timeout").
    lingered = await _executions_of_twelve_singles(tmp_path / "positive", 30.0, max_batch_size=12)
    assert lingered == (1, 1)


async def test_s15_a_request_larger_than_a_batch_is_split_and_one_larger_than_the_queue_refused(
    tmp_path: Path, gate: Path
) -> None:
    max_batch, cap = 4, 6
    write_affine_model(
        tmp_path / "repo", max_batch_size=max_batch, max_queue_size=cap, slo_p99_ms=SLO_MS
    )
    worker = await start(tmp_path)
    split_rows = [row(i, 2 * i, -i, 1) for i in range(cap)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            # More rows than a batch holds: split over batches, answered whole and in order.
            split = await stub.Infer(infer_request("affine", *split_rows), timeout=PATIENT_S)
            # More rows than the queue can ever hold: refused as invalid, nothing runs.
            with pytest.raises(grpc.aio.AioRpcError) as too_big:
                await stub.Infer(infer_request("affine", *split_rows, row(9, 9, 9, 9)), timeout=10)
            rows_after_refusal = metric(worker, names.WORKER_ROWS_TOTAL, model="affine")
            # Within the cap but more than the queue has room for now: refused whole, at once.
            blocker = await hold_executor(worker, stub)
            queued = [
                asyncio.ensure_future(
                    stub.Infer(infer_request("affine", row(i, 0, 0, 5)), timeout=PATIENT_S)
                )
                for i in range(3)
            ]
            await eventually(lambda: in_flight(worker) == 4, interval_s=0.01)
            with pytest.raises(grpc.aio.AioRpcError) as no_room:
                await stub.Infer(infer_request("affine", *split_rows[:4]), timeout=PATIENT_S)
            assert not blocker.done()
            assert in_flight(worker) == 4, "the refused request's rows left the queue"
            release_stall(gate)
            await asyncio.gather(blocker, *queued)
    finally:
        release_stall(gate)
        await worker.stop()
    assert len(split.outputs) == cap
    np.testing.assert_allclose(outputs(split), expected(*split_rows), rtol=1e-5, atol=1e-6)
    assert metric(worker, f"{names.WORKER_BATCH_SIZE}_count", model="affine") >= 2
    assert too_big.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceed the queue capacity" in (too_big.value.details() or "")
    assert rows_after_refusal == cap
    assert no_room.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_hint_ms(no_room.value) > 0
    # Refused whole before any row was queued: four rows rejected, none counted as cancelled.
    assert metric(worker, names.WORKER_REJECTED_TOTAL, model="affine", reason="queue_full") == 4
    assert metric(worker, names.WORKER_DROPPED_TOTAL, model="affine", reason="cancelled") == 0
    assert metric(worker, names.WORKER_ROWS_TOTAL, model="affine") == cap + 3


async def test_s16_versions_never_share_a_batch_and_every_reply_is_its_own(
    tmp_path: Path, gate: Path
) -> None:
    write_versioned_affine_model(
        tmp_path / "repo", versions=(1, 2), max_batch_size=4, slo_p99_ms=SLO_MS
    )
    worker = await start(tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            listing = await stub.ListModels(pb.ListWorkerModelsRequest(), timeout=10)
            fingerprints = {
                int(v.model_version): v.fingerprint
                for v in listing.versions
                if v.model_name == "affine"
            }
            assert len(set(fingerprints.values())) == 2, fingerprints
            plan = _mixed_traffic(fingerprints)
            blocker = await hold_executor(worker, stub)
            calls = [
                asyncio.ensure_future(stub.Infer(request, timeout=PATIENT_S))
                for request, _, _ in plan
            ]
            # Everything queued behind the stall at once, both versions interleaved.
            num_rows = sum(len(rows) for _, rows, version in plan if version)
            await eventually(lambda: in_flight(worker) == num_rows + 1, interval_s=0.01)
            release_stall(gate)
            results = await asyncio.gather(*calls, return_exceptions=True)
            await blocker
    finally:
        release_stall(gate)
        await worker.stop()
    rows_by_version = {1: 0, 2: 0}
    for (_, rows, version), result in zip(plan, results, strict=True):
        if version is None:  # sent with the other version's fingerprint
            assert isinstance(result, grpc.aio.AioRpcError), result
            assert result.code() == grpc.StatusCode.FAILED_PRECONDITION
            continue
        assert isinstance(result, pb.InferResponse), result
        assert result.model_version == str(version)
        assert result.fingerprint == fingerprints[version]
        reference = versioned_affine_reference(torch.from_numpy(np.stack(rows)), version)
        np.testing.assert_allclose(outputs(result), reference.numpy(), rtol=1e-5, atol=1e-6)
        rows_by_version[version] += len(rows)
    for version, num in rows_by_version.items():
        labels = {"model": "affine", "version": str(version)}
        assert metric(worker, names.WORKER_ROWS_TOTAL, **labels) == num
        # Rows of a version did share batches (of 4), just never with the other version.
        assert metric(worker, f"{names.WORKER_BATCH_SIZE}_count", **labels) < num
    assert metric(worker, names.WORKER_MIXED_BUCKET_BATCHES_TOTAL) == 0


def _mixed_traffic(
    fingerprints: dict[int, str],
) -> list[tuple[pb.InferRequest, list[np.ndarray], int | None]]:
    """(request, its rows, the version that must answer it; None: must be refused) for 30
    requests of 1-3 rows: versions interleaved, named or left to "latest" (2), with or without
    their fingerprint, and a few carrying the other version's fingerprint."""
    plan: list[tuple[pb.InferRequest, list[np.ndarray], int | None]] = []
    for i in range(30):
        version = 1 + i % 2
        rows = [row(i, j, 0.5 * i, -j) for j in range(1 + i % 3)]
        fields = {"model_version": str(version)}
        if version == 2 and i % 4 == 1:
            fields = {}  # the latest version
        if i % 3 == 0:
            fields["fingerprint"] = fingerprints[version]
        answered_by: int | None = version
        if i % 7 == 3:
            fields["fingerprint"] = fingerprints[3 - version]
            answered_by = None
        plan.append((infer_request("affine", *rows, **fields), rows, answered_by))
    return plan
