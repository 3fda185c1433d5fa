"""Scenario 22: a worker that is alive but wedged stops serving within the watchdog interval.

A real in-process worker on port 0 serves a real TorchScript model whose call blocks (until
the test opens its gate file) on one marked row: the executor thread is really held."""

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
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.server import SERVICE_NAME, Worker, create_worker
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.metrics import total
from tests.support.models import STALL, release_stall, write_stalling_model
from tests.support.processes import health_status
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

WATCHDOG_S = 0.5
#: Time allowed past the watchdog for the answer and the health flip (a loaded CI machine).
MARGIN_S = 2.0


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


async def start(tmp_path: Path) -> Worker:
    config = WorkerConfig(
        model_repository=tmp_path / "repo",
        grpc_port=0,
        metrics_port=0,
        batching=DriverConfig(watchdog_s=WATCHDOG_S),
    )
    worker = await create_worker(config)
    await worker.load()
    return worker


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
            await eventually(lambda: _not_serving(address), timeout_s=MARGIN_S, interval_s=0.02)
            flipped_s = time.monotonic() - started
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Infer(request(1, 2, 3, 4), timeout=10)
        stop_started = time.monotonic()
        await worker.stop()
        stop_s = time.monotonic() - stop_started
    finally:
        release_stall(gate)
    assert wedged.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "exceeded the watchdog" in (wedged.value.details() or "")
    assert WATCHDOG_S <= answered_s < WATCHDOG_S + MARGIN_S
    assert flipped_s < WATCHDOG_S + MARGIN_S
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "exceeded the watchdog" in (refused.value.details() or "")
    assert "exceeded the watchdog" in str(worker.fatal_error)
    # Drain does not wait for the call that never returns.
    assert stop_s < 5.0
    exported = generate_latest(worker.metrics.registry).decode()
    assert total(exported, names.WORKER_WATCHDOG_EXPIRED_TOTAL, model="stall", version="1") == 1


async def _not_serving(address: str) -> bool:
    statuses = [await health_status(address, service) for service in ("", SERVICE_NAME)]
    return statuses == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2


async def test_s22_a_slow_call_within_the_watchdog_succeeds_and_the_worker_keeps_serving(
    tmp_path: Path, gate: Path
) -> None:
    worker = await start(tmp_path)
    address = f"127.0.0.1:{worker.port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            call = stub.Infer(request(STALL, 0, 0, 0), timeout=30)
            loop = asyncio.get_running_loop()
            loop.call_later(WATCHDOG_S / 5, release_stall, gate)
            response = await call
            status = await health_status(address, SERVICE_NAME)
    finally:
        await worker.stop()
    assert len(response.outputs) == 1
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert worker.fatal_error is None
