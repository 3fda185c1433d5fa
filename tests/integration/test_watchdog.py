"""Scenario 22: a worker that is alive but wedged stops serving once the watchdog expires.

A real in-process worker on port 0 serves a real TorchScript model whose call blocks (until
the test opens its gate file) on one marked row: the executor thread is really held.

No figure here depends on how busy the machine is: the wedged call is answered no earlier than
the watchdog, by the watchdog (its message says so, where gRPC's own deadline would say
"Deadline Exceeded"), and the stop is bounded by half the drain grace it would otherwise wait
out; the waits for health to flip are generous condition bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import generate_latest

from services.common import metric_names as names
from services.common.model_repository import load_repository
from services.gpu_worker.server import SERVICE_NAME, Worker
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.in_process import start_lone_worker, swapper_for
from tests.support.metrics import total
from tests.support.models import STALL, release_stall, write_stalling_model
from tests.support.processes import health_status
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

WATCHDOG_S = 0.5
#: Bound on the wait for the health flip after the answer (a condition wait: generous, it
#: costs nothing when health flips at once).
FLIP_TIMEOUT_S = 30.0


def request(*values: float) -> pb.InferRequest:
    data = np.array(values, dtype=np.float32).tobytes()
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=data)
    return pb.InferRequest(model_name="stall", inputs=[pb.ModelInput(tensor=tensor)])


@pytest.fixture
async def gate(tmp_path: Path) -> AsyncIterator[Path]:
    gate = tmp_path / "gate"
    write_stalling_model(tmp_path / "repo", gate)
    yield gate
    release_stall(gate)  # the wedged call returns and its thread ends


async def start(tmp_path: Path, watchdog_s: float = WATCHDOG_S) -> Worker:
    return await start_lone_worker(tmp_path / "repo", watchdog_s)


async def test_s22_a_wedged_model_call_fails_its_batch_and_turns_the_worker_not_serving(
    tmp_path: Path, gate: Path
) -> None:
    worker = await start(tmp_path)
    address = f"127.0.0.1:{worker.port}"
    try:
        assert worker.batching is not None and worker.batching.watchdog_s == WATCHDOG_S
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            await stub.Infer(request(1, 2, 3, 4), timeout=10)  # serving normally first
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as wedged:
                await stub.Infer(request(STALL, 0, 0, 0), timeout=30)
            answered_s = time.monotonic() - started
            # Overall health too: the liveness probe replaces the process (its thread is stuck).
            await _turns_not_serving(address)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Infer(request(1, 2, 3, 4), timeout=10)
        stop_started = time.monotonic()
        await worker.stop()
        stop_s = time.monotonic() - stop_started
    finally:
        release_stall(gate)
    assert wedged.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "exceeded the watchdog" in (wedged.value.details() or "")
    # Not failed before the watchdog expired (and by the watchdog, not the 30 s deadline: its
    # message above).
    assert answered_s >= WATCHDOG_S
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "exceeded the watchdog" in (refused.value.details() or "")
    assert "exceeded the watchdog" in str(worker.fatal_error)
    # Drain does not wait for the call that never returns: the gate is still closed, so a stop
    # that waited for it would take the whole drain grace (30 s) and then some.
    assert stop_s < worker.config.drain_grace_s / 2, stop_s
    exported = generate_latest(worker.metrics.registry).decode()
    assert total(exported, names.WORKER_WATCHDOG_EXPIRED_TOTAL, model="stall", version="1") == 1


async def test_s22_a_hot_loaded_version_whose_warm_up_wedges_stops_the_worker(
    tmp_path: Path, gate: Path
) -> None:
    """A version loaded while serving warms up on the executor that runs every batch: a warm-up
    call that never returns holds them all. It is bounded as a batch is, at WARMUP_MULTIPLE x
    the watchdog: the load fails past it, and the worker stops serving (before, the load and
    every row waited for the call while the worker said SERVING). A load after it fails
    naming the wedged call: its warm-up would only wait behind it, and is not blamed."""
    worker = await start(tmp_path)
    address = f"127.0.0.1:{worker.port}"
    write_stalling_model(tmp_path / "more", gate, name="wedge", stall_every_call=True)
    write_stalling_model(tmp_path / "more", gate, name="later")
    later, wedging = load_repository(tmp_path / "more")  # by model name
    assert worker.models is not None and worker.batching is not None
    assert worker.batching.watchdog_s == WATCHDOG_S  # a slow start-up warm-up did not raise it
    swapper = swapper_for(worker, WATCHDOG_S)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            await stub.Infer(request(1, 2, 3, 4), timeout=10)  # serving normally first
            # The gate stays closed: only the watchdog can end the load (the bound is a
            # condition wait's, far past it).
            is_loaded = await asyncio.wait_for(swapper.load(wedging), timeout=FLIP_TIMEOUT_S)
            await _turns_not_serving(address)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Infer(request(1, 2, 3, 4), timeout=10)
            is_later_loaded = await asyncio.wait_for(swapper.load(later), FLIP_TIMEOUT_S)
    finally:
        await worker.stop()
        release_stall(gate)
    assert (is_loaded, is_later_loaded) == (False, False)
    failed = {(f.model, f.version): f.error for f in worker.models.failed}
    assert sorted(failed) == [("later", "1"), ("wedge", "1")]
    assert "wedge/1 exceeded the watchdog" in failed[("later", "1")]
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "exceeded the watchdog" in str(worker.fatal_error)
    exported = generate_latest(worker.metrics.registry).decode()
    assert total(exported, names.WORKER_WATCHDOG_EXPIRED_TOTAL, model="wedge", version="1") == 1
    assert total(exported, names.WORKER_WATCHDOG_EXPIRED_TOTAL, model="later", version="1") == 0


async def _turns_not_serving(address: str) -> None:
    await eventually(
        lambda: _not_serving(address),
        timeout_s=FLIP_TIMEOUT_S,
        interval_s=0.02,
        message="NOT_SERVING (overall and the worker service) after the watchdog",
    )


async def _not_serving(address: str) -> bool:
    statuses = [await health_status(address, service) for service in ("", SERVICE_NAME)]
    return statuses == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2


#: The watchdog of the slow-call test: far longer than the call is held (SLOW_CALL_S), so that
#: a busy machine cannot stretch the call past it.
GENEROUS_WATCHDOG_S = 10.0
#: How long the slow call holds the executor: the scenario's duration, far past a normal call.
SLOW_CALL_S = 1.0


async def test_s22_a_slow_call_within_the_watchdog_succeeds_and_the_worker_keeps_serving(
    tmp_path: Path, gate: Path
) -> None:
    """A call held on the executor for SLOW_CALL_S, well within the watchdog: answered, and the
    worker stays SERVING."""
    worker = await start(tmp_path, watchdog_s=GENEROUS_WATCHDOG_S)
    address = f"127.0.0.1:{worker.port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            call = stub.Infer(request(STALL, 0, 0, 0), timeout=30)
            assert worker.batching is not None
            batching = worker.batching
            await eventually(lambda: batching.is_executing, interval_s=0.01, message="stalled")
            await asyncio.sleep(SLOW_CALL_S)  # the scenario: the call is slow, not wedged
            release_stall(gate)
            response = await call
            status = await health_status(address, SERVICE_NAME)
    finally:
        await worker.stop()
    assert len(response.outputs) == 1
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert worker.fatal_error is None
