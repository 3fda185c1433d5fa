"""A worker with fronts (`--front-processes 2`) as real processes: the engine serves gRPC only
on its own Unix socket, and two fronts share the worker's port, relaying InferStreams as
frames and passing every other method on. Callers see one worker; a front killed is
restarted while the engine and the other front serve on; an engine killed takes its fronts
with it."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2

from bench.models import affine_reference
from services.common import metric_names as names
from services.common.errors import UpstreamError
from services.common.multiplex import CHANNEL_OPTIONS, MultiplexClient
from services.common.tensors import tensor_to_pb
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.metrics import samples, scrape, total
from tests.support.models import write_affine_model
from tests.support.processes import ServiceProcess, health_status, start_worker
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

SERVICE = "inference.v1.WorkerService"
#: Connections the callers open: the kernel spreads connections, not calls, over the fronts,
#: so 16 leave one front without any with odds of 2 in 65,536.
CHANNELS = 16
#: One connection per channel (grpc otherwise shares one among a process's like channels).
OWN_CONNECTION = (*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))


def start_with_fronts(tmp_path: Path) -> ServiceProcess:
    repository = tmp_path / "repo"
    write_affine_model(repository, slo_p99_ms=30_000)
    return start_worker(
        tmp_path, model_repository=repository, extra_args=("--front-processes", "2")
    )


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    service = start_with_fronts(tmp_path_factory.mktemp("fronts"))
    yield service
    assert service.terminate() == 0, service.log()


def fronts_of(engine_pid: int) -> set[int]:
    """The live child processes of the engine (its fronts)."""
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == engine_pid and fields[0] != "Z":
            children.add(int(entry))
    return children


def affine_request(seed: int) -> tuple[pb.InferRequest, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal(4).astype(np.float32)
    request = pb.InferRequest(model_name="affine", inputs=[pb.ModelInput(tensor=tensor_to_pb(x))])
    return request, affine_reference(torch.from_numpy(x)).numpy()


def answer(response: bytes | pb.InferResponse) -> np.ndarray:
    if isinstance(response, bytes):
        response = pb.InferResponse.FromString(response)
    return np.frombuffer(response.outputs[0].raw_data, dtype="<f4")


async def test_callers_see_one_worker_whose_calls_both_fronts_carry(worker) -> None:
    assert len(fronts_of(worker.process.pid)) == 2
    assert await health_status(worker.address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        listed = await stub.ListModels(pb.ListWorkerModelsRequest(), timeout=10)
        assert [v.model_name for v in listed.versions] == ["affine"]
        request, expected = affine_request(0)
        np.testing.assert_allclose(answer(await stub.Infer(request, timeout=10)), expected, 1e-5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Infer(pb.InferRequest(model_name="nope", inputs=request.inputs), timeout=10)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'nope'" in (refused.value.details() or "")

    channels = [
        grpc.aio.insecure_channel(worker.address, options=OWN_CONNECTION) for _ in range(CHANNELS)
    ]
    clients = [MultiplexClient(c, f"caller-{i}") for i, c in enumerate(channels)]
    try:
        calls = [affine_request(seed) for seed in range(64)]
        answers = await asyncio.gather(
            *(
                clients[i % CHANNELS].call(request.SerializeToString(), timeout_s=10)
                for i, (request, _) in enumerate(calls)
            )
        )
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    for got, (_, expected) in zip(answers, calls, strict=True):
        np.testing.assert_allclose(answer(got), expected, 1e-5)
    relayed = samples(scrape(worker.metrics_port), names.WORKER_FRONT_STREAMS_TOTAL)
    by_front = {labels["worker_front"]: value for labels, value in relayed}
    assert set(by_front) == {"0", "1"} and all(value >= 1 for value in by_front.values()), by_front
    assert sum(by_front.values()) >= CHANNELS


async def test_a_killed_front_is_restarted_while_the_engine_and_the_other_front_serve(
    tmp_path: Path,
) -> None:
    worker = start_with_fronts(tmp_path)
    channels = [
        grpc.aio.insecure_channel(worker.address, options=OWN_CONNECTION) for _ in range(CHANNELS)
    ]
    clients = [MultiplexClient(c, f"caller-{i}") for i, c in enumerate(channels)]
    request, expected = affine_request(1)
    payload = request.SerializeToString()

    async def call_each() -> list[bytes | BaseException]:
        return await asyncio.gather(
            *(client.call(payload, timeout_s=10) for client in clients), return_exceptions=True
        )

    try:
        assert all(isinstance(got, bytes) for got in await call_each())
        before = fronts_of(worker.process.pid)
        killed = min(before)
        os.kill(killed, signal.SIGKILL)
        # The killed front's callers lose their streams: UNAVAILABLE (which a router retries
        # elsewhere); the other front's callers are answered.
        for got in await call_each():
            if isinstance(got, BaseException):
                assert isinstance(got, UpstreamError), got
                assert got.code == grpc.StatusCode.UNAVAILABLE, got
            else:
                np.testing.assert_allclose(answer(got), expected, 1e-5)

        async def restarted() -> bool:
            text = scrape(worker.metrics_port)
            fronts = fronts_of(worker.process.pid)
            return total(text, names.WORKER_FRONT_RESTARTS_TOTAL) == 1 and len(fronts) == 2

        await eventually(restarted, timeout_s=30, message="the killed front was not restarted")
        assert killed not in fronts_of(worker.process.pid)
        assert worker.process.poll() is None

        # Every caller is served again: a new stream on a new connection, to either front.
        async def all_answered() -> list[bytes | BaseException] | None:
            results = await call_each()
            return results if all(isinstance(r, bytes) for r in results) else None

        for got in await eventually(all_answered, timeout_s=10, message="not served again"):
            np.testing.assert_allclose(answer(got), expected, 1e-5)
        assert (
            await health_status(worker.address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
        )
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    assert worker.terminate() == 0, worker.log()


async def test_an_engine_killed_takes_its_fronts_and_the_port_with_it(tmp_path: Path) -> None:
    worker = start_with_fronts(tmp_path)
    fronts = fronts_of(worker.process.pid)
    assert len(fronts) == 2
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.wait()

    def gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() and _is_live(pid) for pid in fronts)

    await eventually(gone, timeout_s=30, message="the fronts outlived their engine")
    with pytest.raises(grpc.aio.AioRpcError) as unreachable:
        await health_status(worker.address, SERVICE)
    assert unreachable.value.code() == grpc.StatusCode.UNAVAILABLE
    assert worker.log().count("worker front stopped") == 2  # each stopped on its own SIGTERM


def _is_live(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
