"""A worker with fronts (`--front-processes 2`) as real processes: the engine serves gRPC only
on its own Unix socket, and two fronts share the worker's port, relaying InferStreams as
frames and passing every other method on. Callers see one worker; a front killed is
restarted while the engine and the other front serve on; an engine killed takes its fronts
with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from bench.models import affine_reference
from services.common import metric_names as names
from services.common import multiplex
from services.common.beats import HUNG_S
from services.common.channel_options import CHANNEL_OPTIONS
from services.common.errors import NOT_STARTED_TRAILER, UpstreamError
from services.common.multiplex import MultiplexClient
from services.common.procfs import descendants, is_alive
from services.common.tensors import tensor_to_pb
from services.gpu_worker.front import Passthrough, engine_grpc_target, follow_engine_health
from services.gpu_worker.stream_relay import ENGINE_LOST_S, FrontMetrics, StreamRelay
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.metrics import samples, scrape, total
from tests.support.models import (
    STALL,
    release_stall,
    write_affine_model,
    write_stalling_model,
)
from tests.support.processes import (
    REPO_ROOT,
    ServiceProcess,
    health_status,
    runs_uvloop,
    start_worker,
)
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
        tmp_path,
        model_repository=repository,
        extra_args=("--front-processes", "2", "--health-port", "0"),
    )


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    service = start_with_fronts(tmp_path_factory.mktemp("fronts"))
    yield service
    assert service.terminate() == 0, service.log()


@pytest.fixture
def own_worker(tmp_path: Path) -> Iterator[ServiceProcess]:
    """A worker for a test that kills part of it; stopped afterwards whatever happened."""
    service = start_with_fronts(tmp_path)
    try:
        yield service
    finally:
        if service.process.poll() is None:
            service.terminate()


def fronts_of(engine_pid: int) -> set[int]:
    """The engine's live children: its fronts."""
    return {pid for pid in descendants(engine_pid) if is_alive(pid)}


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
    # The fronts follow the engine's settings: both on uvloop's event loop, as it is.
    assert all(map(runs_uvloop, {worker.process.pid, *fronts_of(worker.process.pid)}))
    assert await health_status(worker.address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    # The plaintext health port its fronts serve (`--health-port 0`), from its ready file.
    assert worker.health_port is not None
    health_address = f"127.0.0.1:{worker.health_port}"
    assert await health_status(health_address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
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

    def streams_by_front() -> dict[str, float] | None:
        """Each front's relayed streams; None while a front's series is missing (the worker's
        scrape leaves out a front whose own scrape timed out)."""
        relayed = samples(scrape(worker.metrics_port), names.WORKER_FRONT_STREAMS_TOTAL)
        found = {labels["worker_front"]: value for labels, value in relayed}
        return found if set(found) == {"0", "1"} else None

    by_front = await eventually(streams_by_front, message="both fronts' series")
    assert set(by_front) == {"0", "1"} and all(value >= 1 for value in by_front.values()), by_front
    assert sum(by_front.values()) >= CHANNELS


async def test_a_generation_stream_through_a_front_is_the_engines_own(tmp_path: Path) -> None:
    """Generate (a server-streaming method) passed on by a front: the same greedy tokens and
    finish as from the engine's own socket; its errors too."""
    shutil.copytree(REPO_ROOT / "models" / "tiny-llama", tmp_path / "repo" / "tiny-llama")
    worker = start_worker(
        tmp_path, model_repository=tmp_path / "repo", extra_args=("--front-processes", "1")
    )
    try:
        (front,) = fronts_of(worker.process.pid)
        command = Path(f"/proc/{front}/cmdline").read_text().split("\0")
        engine = engine_grpc_target(Path(command[command.index("--engine-dir") + 1]))
        request = pb.WorkerGenerateRequest(
            model_name="tiny-llama",
            text="the fronts pass this on",
            sampling=pb.SamplingParameters(max_tokens=12, ignore_eos=True),  # greedy
        )
        unknown = pb.WorkerGenerateRequest(model_name="nope", text="x")
        streams, errors = [], []
        for address in (worker.address, engine):
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.WorkerServiceStub(channel)
                streams.append([m async for m in stub.Generate(request, timeout=60)])
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in stub.Generate(unknown, timeout=60):
                        pass
                errors.append((refused.value.code(), refused.value.details()))
        through_front, from_engine = (
            ([t for m in stream for t in m.token_ids], stream[-1].finish_reason)
            for stream in streams
        )
        assert through_front == from_engine
        assert len(through_front[0]) == 12
        assert errors[0] == errors[1] and errors[0][0] == grpc.StatusCode.NOT_FOUND
    finally:
        code = worker.terminate()
    assert code == 0, worker.log()


async def test_a_killed_front_is_restarted_while_the_engine_and_the_other_front_serve(
    own_worker: ServiceProcess,
) -> None:
    worker = own_worker
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


async def test_a_front_killed_mid_call_has_its_queued_rows_withdrawn_by_the_engine(
    tmp_path: Path,
) -> None:
    """Two calls on one stream, so on one front: the first holds the executor in a stalled
    batch, the second is queued behind it. The front dies: both callers fail UNAVAILABLE, and
    the engine withdraws the queued row while the stalled batch still runs."""
    gate = tmp_path / "gate"
    write_stalling_model(tmp_path / "repo", gate)
    worker = start_worker(
        tmp_path, model_repository=tmp_path / "repo", extra_args=("--front-processes", "2")
    )
    channel = grpc.aio.insecure_channel(worker.address, options=OWN_CONNECTION)
    try:
        client = MultiplexClient(channel, "caller")
        row = np.array([STALL, 0, 0, 0], dtype=np.float32)  # a row that stalls its batch
        stall = pb.InferRequest(
            model_name="stall", inputs=[pb.ModelInput(tensor=tensor_to_pb(row))]
        ).SerializeToString()

        def queued() -> float:
            return total(scrape(worker.metrics_port), names.WORKER_QUEUE_DEPTH, model="stall")

        def dispatched() -> float:
            count = f"{names.WORKER_QUEUE_WAIT_SECONDS}_count"
            return total(scrape(worker.metrics_port), count, model="stall")

        blocker = asyncio.ensure_future(client.call(stall, timeout_s=60))
        await eventually(lambda: dispatched() == 1, message="the first call did not run")
        assert queued() == 0 and not blocker.done()  # its batch holds the executor
        waiting = asyncio.ensure_future(client.call(stall, timeout_s=60))
        await eventually(lambda: queued() == 1, message="the second call was not queued")
        (carrier,) = await _carrying_front(worker)
        os.kill(_front_pid(worker, carrier), signal.SIGKILL)
        for call in (blocker, waiting):
            with pytest.raises(UpstreamError) as failed:
                await call
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        await eventually(lambda: queued() == 0, message="the queued row was not withdrawn")
        release_stall(gate)
    finally:
        release_stall(gate)
        await channel.close()
        code = worker.terminate() if worker.process.poll() is None else None
    assert code == 0, worker.log()


def _open_streams_by_front(worker: ServiceProcess) -> dict[str, float]:
    relaying = samples(scrape(worker.metrics_port), names.WORKER_FRONT_OPEN_STREAMS)
    return {labels["worker_front"]: value for labels, value in relaying}


async def _carrying_front(worker: ServiceProcess) -> list[str]:
    """The fronts with an open stream, once one shows (the worker's scrape leaves out a front
    whose own scrape timed out)."""
    return await eventually(
        lambda: [i for i, n in _open_streams_by_front(worker).items() if n > 0],
        message="the carrying front's open stream",
    )


def _front_pid(worker: ServiceProcess, index: str) -> int:
    """The pid of front `index`, known by its ready file's name on its command line."""
    for pid in fronts_of(worker.process.pid):
        if f"front-{index}.ready.json" in Path(f"/proc/{pid}/cmdline").read_text():
            return pid
    raise AssertionError(f"front {index} is not running")


async def test_an_engine_killed_takes_its_fronts_and_the_port_with_it(
    own_worker: ServiceProcess,
) -> None:
    worker = own_worker
    fronts = fronts_of(worker.process.pid)
    assert len(fronts) == 2
    # What a killed engine cannot remove: its sockets' directory, named on its fronts' commands.
    command = Path(f"/proc/{min(fronts)}/cmdline").read_text().split("\0")
    engine_dir = Path(command[command.index("--engine-dir") + 1])
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.wait()

    def gone() -> bool:
        return not any(is_alive(pid) for pid in fronts)

    try:
        await eventually(gone, timeout_s=30, message="the fronts outlived their engine")
    finally:  # did they not, they must not outlive the test
        for pid in fronts:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(engine_dir, ignore_errors=True)
    with pytest.raises(grpc.aio.AioRpcError) as unreachable:
        await health_status(worker.address, SERVICE)
    assert unreachable.value.code() == grpc.StatusCode.UNAVAILABLE
    assert worker.log().count("worker front stopped") == 2  # each stopped on its own SIGTERM


async def test_a_stopping_front_waits_for_the_calls_it_passed_on(tmp_path: Path) -> None:
    """A unary Infer passed on by the only front, held in a stalled batch; the front is told
    to stop (SIGTERM, as when a whole process group is signalled). It turns NOT_SERVING and
    stays until the call ends: released HUNG_S + 2 s later, the call is answered OK. Before,
    the front waited only for its relayed streams and cut the call after a 1 s grace. A front
    draining keeps beating (beats.beat): the engine does not take it for hung past HUNG_S."""
    gate = tmp_path / "gate"
    write_stalling_model(tmp_path / "repo", gate)
    worker = start_worker(
        tmp_path, model_repository=tmp_path / "repo", extra_args=("--front-processes", "1")
    )
    channel = grpc.aio.insecure_channel(worker.address, options=OWN_CONNECTION)
    try:
        (front,) = fronts_of(worker.process.pid)
        row = np.array([STALL, 0, 0, 0], dtype=np.float32)  # a row that stalls its batch
        stall = pb.InferRequest(
            model_name="stall", inputs=[pb.ModelInput(tensor=tensor_to_pb(row))]
        )
        stub = pb_grpc.WorkerServiceStub(channel)
        call = asyncio.ensure_future(stub.Infer(stall, timeout=60))

        def dispatched() -> float:
            count = f"{names.WORKER_QUEUE_WAIT_SECONDS}_count"
            return total(scrape(worker.metrics_port), count, model="stall")

        await eventually(lambda: dispatched() == 1, message="the call did not run")
        os.kill(front, signal.SIGTERM)
        # Past the 1 s grace the front's server stop would give, and past HUNG_S.
        await asyncio.sleep(HUNG_S + 2.0)
        assert not call.done()
        assert is_alive(front)
        release_stall(gate)
        response = await call
        assert len(response.outputs) == 1
        await eventually(lambda: not is_alive(front), message="the front did not stop")
    finally:
        release_stall(gate)
        await channel.close()
        code = worker.terminate() if worker.process.poll() is None else None
    assert code == 0, worker.log()


async def test_a_front_stopping_alone_sends_its_callers_new_streams_to_the_other(
    own_worker: ServiceProcess,
) -> None:
    """One front is told to stop while a caller's stream runs on it: the stream is told
    `closing`, and the caller's next stream lands on the other front, so every call is
    answered. Before, the next stream went over the same connection to the stopping front,
    which refused it UNAVAILABLE (a router then ejected the whole worker)."""
    worker = own_worker
    channel = grpc.aio.insecure_channel(worker.address, options=OWN_CONNECTION)
    client = MultiplexClient(channel, "caller")
    request, expected = affine_request(3)
    payload = request.SerializeToString()
    try:
        np.testing.assert_allclose(answer(await client.call(payload, timeout_s=10)), expected, 1e-5)
        (carrier,) = await _carrying_front(worker)
        stopping = _front_pid(worker, carrier)
        os.kill(stopping, signal.SIGTERM)
        outcomes: list[bytes | BaseException] = []
        deadline_s = asyncio.get_running_loop().time() + 2.0
        while asyncio.get_running_loop().time() < deadline_s:
            try:
                outcomes.append(await client.call(payload, timeout_s=10))
            except UpstreamError as error:
                outcomes.append(error)
            await asyncio.sleep(0.01)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        assert failed == [], failed[:3]
        for got in outcomes:
            np.testing.assert_allclose(answer(got), expected, 1e-5)  # type: ignore[arg-type]
        await eventually(lambda: not is_alive(stopping), message="the front did not stop")
    finally:
        await client.close()
        await channel.close()
    assert worker.terminate() == 0, worker.log()


async def test_a_full_engine_is_still_seen_serving_by_its_fronts(tmp_path: Path) -> None:
    """`--max-concurrent-rpcs 2` with a front: two calls held in a stalled batch fill the
    front's limit, and the engine behind it takes them and the front's health polls anyway
    (each front holds its callers to the limit). Before, the engine had the same limit: the
    polls were refused once two calls were passed on, and the worker reported NOT_SERVING
    while it served."""
    gate = tmp_path / "gate"
    write_stalling_model(tmp_path / "repo", gate)
    worker = start_worker(
        tmp_path,
        model_repository=tmp_path / "repo",
        extra_args=("--front-processes", "1", "--max-concurrent-rpcs", "2", "--health-port", "0"),
    )
    channel = grpc.aio.insecure_channel(worker.address, options=OWN_CONNECTION)
    try:
        assert worker.health_port is not None
        health_address = f"127.0.0.1:{worker.health_port}"
        row = np.array([STALL, 0, 0, 0], dtype=np.float32)  # a row that stalls its batch
        stall = pb.InferRequest(
            model_name="stall", inputs=[pb.ModelInput(tensor=tensor_to_pb(row))]
        )
        stub = pb_grpc.WorkerServiceStub(channel)
        calls = [asyncio.ensure_future(stub.Infer(stall, timeout=60)) for _ in range(2)]

        def in_flight() -> float:
            return total(scrape(worker.metrics_port), names.WORKER_QUEUE_DEPTH, model="stall") + (
                total(
                    scrape(worker.metrics_port),
                    f"{names.WORKER_QUEUE_WAIT_SECONDS}_count",
                    model="stall",
                )
            )

        await eventually(lambda: in_flight() == 2, message="the calls did not reach the engine")
        await asyncio.sleep(1.5)  # three of the front's health polls
        assert (
            await health_status(health_address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
        )
        release_stall(gate)
        for response in await asyncio.gather(*calls):
            assert len(response.outputs) == 1
    finally:
        release_stall(gate)
        await channel.close()
        code = worker.terminate() if worker.process.poll() is None else None
    assert code == 0, worker.log()


async def test_a_front_follows_the_engines_health_past_a_failed_ready_file_write() -> None:
    """The front's first sight of its engine serving writes its ready file; a write that
    fails (a full disk) is tried again at the next poll, and the front keeps following the
    engine's health. Before, the failure ended the following: the front's health froze at
    SERVING, whatever became of its engine."""
    engine_health, front_health = health.aio.HealthServicer(), health.aio.HealthServicer()
    engine, front = grpc.aio.server(), grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(engine_health, engine)
    health_pb2_grpc.add_HealthServicer_to_server(front_health, front)
    engine_port = engine.add_insecure_port("127.0.0.1:0")
    front_port = front.add_insecure_port("127.0.0.1:0")
    await engine.start()
    await front.start()
    await engine_health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    writes: list[str] = []

    def write_ready_file() -> None:
        writes.append("tried")
        if len(writes) == 1:
            raise OSError(28, "No space left on device")

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine_port}")
    following = asyncio.ensure_future(follow_engine_health(channel, front_health, write_ready_file))
    try:
        front_address = f"127.0.0.1:{front_port}"
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        await eventually(lambda: len(writes) == 2, message="the write was not tried again")
        assert await health_status(front_address, SERVICE) == serving
        await engine_health.set(SERVICE, not_serving)  # the engine stopped serving

        async def front_not_serving() -> bool:
            return await health_status(front_address, SERVICE) == not_serving

        await eventually(front_not_serving, message="the front did not follow its engine")
        assert not following.done()
        assert len(writes) == 2  # once written, never again
    finally:
        following.cancel()
        await channel.close()
        await front.stop(None)
        await engine.stop(None)


async def test_a_stopped_engine_ends_the_streams_and_calls_passed_to_it_unavailable(
    own_worker: ServiceProcess,
) -> None:
    """The engine is stopped (SIGSTOP) with a call on a stream relayed to it and an Infer passed
    on: the stream's call fails UNAVAILABLE once the engine has not answered its front for
    ENGINE_LOST_S, not at the call's own 120 s, as does the Infer, and new streams and calls
    are refused, the calls marked not started; resumed, the engine serves new streams.
    Before, the stream's call waited for its deadline (the front answers the router's
    keepalive pings, so the router never failed it over), and a new Infer was passed on to the
    stopped engine, to wait out its own."""
    worker = own_worker
    channel = grpc.aio.insecure_channel(worker.address, options=OWN_CONNECTION)
    request, expected = affine_request(1)
    stub = pb_grpc.WorkerServiceStub(channel)
    try:
        client = MultiplexClient(channel, "caller")
        served = await client.call(request.SerializeToString(), timeout_s=10)
        np.testing.assert_allclose(answer(served), expected, 1e-5)
        os.kill(worker.process.pid, signal.SIGSTOP)
        try:
            started_s = asyncio.get_running_loop().time()
            passed_on = asyncio.ensure_future(stub.Infer(request, timeout=120))
            with pytest.raises(UpstreamError) as failed:
                await asyncio.wait_for(client.call(request.SerializeToString(), timeout_s=120), 60)
            waited_s = asyncio.get_running_loop().time() - started_s
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE, failed.value
            with pytest.raises(UpstreamError) as refused:
                await client.call(request.SerializeToString(), timeout_s=10)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as infer_failed:
                await asyncio.wait_for(passed_on, 60)
            assert infer_failed.value.code() == grpc.StatusCode.UNAVAILABLE, infer_failed.value
            # On this connection's front, which declared the engine lost: refused at once.
            with pytest.raises(grpc.aio.AioRpcError) as infer_refused:
                await stub.Infer(request, timeout=10)
            assert infer_refused.value.code() == grpc.StatusCode.UNAVAILABLE
            trailers = tuple(infer_refused.value.trailing_metadata() or ())
            assert NOT_STARTED_TRAILER in trailers, infer_refused.value
        finally:
            os.kill(worker.process.pid, signal.SIGCONT)

        async def serves_again() -> bool:
            try:
                await client.call(request.SerializeToString(), timeout_s=5)
            except UpstreamError:
                return False
            return True

        await eventually(serves_again, timeout_s=30.0, message="the engine serves again")
    finally:
        await channel.close()
    # Not at once, as a stream whose link broke would: the engine-lost rule ended it (its last
    # answer came before it stopped, by a poll on an idle machine, more on a loaded one).
    assert waited_s >= ENGINE_LOST_S / 2, waited_s


#: What grpc's client reports when the stream's write raced the front's refusal and grpc lost
#: the refusal's status (no trailers: nothing tells whether anything ran): about one stream in
#: 500 on two cores kept busy, never on an idle machine. Such a stream is tried again.
GRPC_LOST_STATUS = "Internal error from Core"
LOST_STATUS_TRIES = 10


@contextlib.asynccontextmanager
async def front_without_engine(tmp_path: Path) -> AsyncIterator[grpc.aio.Channel]:
    """A worker front whose engine is not up (nothing listens on its link), and a channel of
    its own to it."""
    metrics = FrontMetrics(CollectorRegistry())
    relay = StreamRelay(tmp_path / "no-engine.sock", metrics)
    engine = grpc.aio.insecure_channel(f"unix:{tmp_path / 'no-engine-grpc.sock'}")
    front = grpc.aio.server()
    front.add_generic_rpc_handlers((Passthrough(engine, relay, metrics),))
    port = front.add_insecure_port("127.0.0.1:0")
    await front.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION)
    try:
        yield channel
    finally:
        await channel.close()
        await front.stop(None)
        await engine.close()


async def test_a_front_whose_engine_is_not_up_refuses_its_streams_as_not_started(
    tmp_path: Path,
) -> None:
    """A front that cannot reach its engine's link refuses a router's stream UNAVAILABLE, and
    the calls on it fail marked not started (NOT_STARTED_TRAILER): they ran nowhere, so the
    router's gateway sends them again without charging their rows. Before, a call the router
    had written when the refusal came was failed as possibly run."""
    async with front_without_engine(tmp_path) as channel:
        await channel.channel_ready()
        request, _ = affine_request(2)
        for _ in range(5):  # each on a stream of its own: the last one broke
            for _ in range(LOST_STATUS_TRIES):
                client = MultiplexClient(channel, "router")
                with pytest.raises(UpstreamError) as refused:
                    await client.call(request.SerializeToString(), timeout_s=10)
                await client.close()
                if GRPC_LOST_STATUS not in str(refused.value):
                    break
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE, refused.value
            assert "engine is not up" in str(refused.value), refused.value
            assert refused.value.is_not_started, refused.value


async def test_a_front_whose_engine_is_not_up_refuses_its_unary_calls_as_not_started(
    tmp_path: Path,
) -> None:
    """Infer and Generate passed on to an engine whose socket refuses (not up yet, or just
    gone) fail UNAVAILABLE marked not started, as a stream's calls do: they reached no engine,
    so the router sends them to another worker at once. Before, grpc's own failure was passed
    back unmarked (review finding)."""
    async with front_without_engine(tmp_path) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        request, _ = affine_request(3)
        calls = (
            stub.Infer(request, timeout=10),
            stub.Generate(pb.WorkerGenerateRequest(), timeout=10).read(),
        )
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            trailers = tuple(refused.value.trailing_metadata() or ())
            assert NOT_STARTED_TRAILER in trailers, refused.value


async def test_a_write_that_fails_after_a_front_refused_its_stream_counts_as_not_started(
    tmp_path: Path,
) -> None:
    """A router's writer can write on a stream the front has just refused (its engine not up)
    before the reader sees the refusal: grpc raises a bare InvalidStateError, with no status.
    MultiplexClient then reads the stream's status, and a refusal marked not started means the
    calls it wrote ran nowhere (they are sent again without charging their rows). Before, only
    an OK end counted, and those calls failed as possibly run."""
    async with front_without_engine(tmp_path) as channel:
        request, _ = affine_request(2)
        message = pb.InferStreamRequest(
            calls=[pb.MuxCall(call_id=1, request=request.SerializeToString())]
        )
        open_stream = channel.stream_stream(
            multiplex.STREAM_METHOD,
            request_serializer=pb.InferStreamRequest.SerializeToString,
            response_deserializer=pb.InferStreamResponse.FromString,
        )
        for _ in range(LOST_STATUS_TRIES):
            stream = open_stream()
            with contextlib.suppress(grpc.aio.AioRpcError):  # the refusal may come first
                await stream.write(message)
            if await stream.details() != GRPC_LOST_STATUS:
                break
        assert await stream.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(asyncio.InvalidStateError):  # what the writer meets
            await stream.write(message)
        assert await multiplex._ran_nothing_or_ended_cleanly(stream)
