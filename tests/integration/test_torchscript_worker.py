"""A user's TorchScript model behind a real in-process grpc.aio worker on port 0.

Where a test needs the executor held while rows queue, the repository also serves the `stall`
model (tests/support/models.py): a call with a `STALL` row blocks the worker's one executor
thread until the test opens its gate, however fast or slow the machine is. Only the test of a
refusal *predicted* from a batch's cost runs a costly model."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, generate_latest

from services.common import metric_names as names
from services.common.model_repository import load_repository
from services.common.registry_schema import RegistryKeys, WorkerRecord, connect
from services.common.tensors import NUMPY_DTYPES
from services.gpu_worker.backends import load_backend
from services.gpu_worker.backends.base import Backend
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.failure_streak import FailingConfig
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.config import HeartbeatConfig, WorkerConfig
from services.gpu_worker.registry_publisher import HeartbeatPublisher
from services.gpu_worker.server import Worker, create_worker
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router.metrics import RouterMetrics
from services.router.registry_reader import RegistrySync
from services.router.routing import Route, RouteTable
from services.router.routing_config import RoutingConfig
from services.router.worker_networks import WorkerNetworks
from tests.support.metrics import samples, total
from tests.support.models import (
    POISON,
    STALL,
    affine_reference,
    release_stall,
    row,
    write_affine_model,
    write_stalling_model,
)
from tests.support.processes import health_status
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


def row_request(
    *rows: np.ndarray, dtype: int = pb.DATA_TYPE_FP32, shape: tuple[int, ...] = (4,)
) -> pb.InferRequest:
    return pb.InferRequest(
        model_name="affine",
        inputs=[
            pb.ModelInput(tensor=pb.Tensor(dtype=dtype, shape=list(shape), raw_data=r.tobytes()))
            for r in rows
        ],
    )


async def start(
    tmp_path: Path, *, with_stall: bool = False, batching: DriverConfig | None = None, **model: int
) -> Worker:
    """A worker serving `affine` (`model`: its settings) and, `with_stall`, the `stall` model
    gated by `tmp_path / "gate"`; `batching`: the worker's batching settings (else defaults)."""
    # A generous SLO: these tests pin down ordering and statuses, not speed, and CI machines
    # are shared. Tests about deadlines set their own with the client's timeout.
    write_affine_model(tmp_path / "repo", **{"slo_p99_ms": 30_000, **model})
    if with_stall:
        write_stalling_model(tmp_path / "repo", tmp_path / "gate")
    config = WorkerConfig(model_repository=tmp_path / "repo", grpc_port=0, metrics_port=0)
    if batching is not None:
        config = dataclasses.replace(config, batching=batching)
    worker = await create_worker(config)
    await worker.load()
    return worker


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[Worker]:
    worker = await start(tmp_path)
    yield worker
    await worker.stop()


async def until_executing(worker: Worker) -> None:
    """Returns once a batch is on the executor: requests sent after this are queued behind it.
    Dispatch happens inside the worker and cannot be awaited from a client, so poll (<= 10 s)."""
    await eventually(
        lambda: worker.batching.is_executing, interval_s=0.01, message="a batch executing"
    )


async def hold_executor(worker: Worker, stub: pb_grpc.WorkerServiceStub) -> asyncio.Future:
    """Starts a `stall` call and returns it once its batch holds the executor."""
    stall = row_request(row(STALL, 0, 0, 0))
    stall.model_name = "stall"
    blocker = asyncio.ensure_future(stub.Infer(stall, timeout=60))
    await until_executing(worker)
    return blocker


def metric(worker: Worker, name: str, **labels: str) -> float:
    return total(generate_latest(worker.metrics.registry).decode(), name, **labels)


async def test_outputs_equal_the_module_row_by_row(worker: Worker) -> None:
    rows = [row(i, -i, 0.5 * i, 1.0) for i in range(5)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        response = await stub.Infer(row_request(*rows), timeout=10)
    expected = affine_reference(torch.from_numpy(np.stack(rows))).numpy()
    got = np.stack([np.frombuffer(t.raw_data, dtype="<f4") for t in response.outputs])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert [list(t.shape) for t in response.outputs] == [[2]] * 5


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (row_request(np.zeros(4, dtype=np.int32), dtype=pb.DATA_TYPE_INT32), "must be FP32"),
        (row_request(np.zeros(3, dtype=np.float32), shape=(3,)), "shape [4]"),
        (row_request(row(1, 2, float("nan"), 4)), "NaN or Inf"),
        (row_request(row(1, 2, float("inf"), 4)), "NaN or Inf"),
        (row_request(np.zeros(4, dtype=np.float32), shape=(5,)), "needs 20"),
        (row_request(np.zeros(4, dtype=np.float32), dtype=pb.DATA_TYPE_UNSPECIFIED), "unspecified"),
        (pb.InferRequest(model_name="affine", inputs=[pb.ModelInput(text="hi")]), "tensor inputs"),
    ],
)
async def test_s38_malformed_tensors_are_invalid_argument(
    worker: Worker, request_, message: str
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Infer(request_, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in raised.value.details()
    assert metric(worker, names.WORKER_ROWS_TOTAL) == 0


async def test_s17_one_bad_row_fails_only_its_own_request(tmp_path: Path) -> None:
    # A held executor: the next requests all queue, then share one batch.
    worker = await start(tmp_path, with_stall=True, max_batch_size=8)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            blocker = await hold_executor(worker, stub)
            batch = [row(POISON, 1, 1, 1) if i == 3 else row(i, 1, 1, 1) for i in range(6)]
            calls = [asyncio.ensure_future(stub.Infer(row_request(r), timeout=30)) for r in batch]
            await eventually(lambda: worker.batching.num_in_flight == 7, interval_s=0.01)
            release_stall(tmp_path / "gate")
            results = await asyncio.gather(*calls, return_exceptions=True)
            await blocker
    finally:
        release_stall(tmp_path / "gate")
        await worker.stop()
    failed = [i for i, r in enumerate(results) if isinstance(r, Exception)]
    assert failed == [3]
    assert results[3].code() == grpc.StatusCode.INTERNAL
    assert "poisoned row" in results[3].details()
    assert metric(worker, names.WORKER_ROW_FAILURES_TOTAL) == 1
    # The six rows went to the model as one batch (a failure inside it reaches only its row).
    assert metric(worker, f"{names.WORKER_BATCH_SIZE}_count", model="affine") < 6, (
        "the good rows shared a batch"
    )


def heartbeat(worker: Worker) -> WorkerRecord:
    """The worker's registry record now (as its RegistryPublisher writes it), as `w0`."""
    assert worker.models is not None and worker.batching is not None
    models = tuple(
        m.model_record(is_ready=True, batching=worker.batching) for m in worker.models.all
    )
    return WorkerRecord("w0", f"127.0.0.1:{worker.port}", False, 0, models)


async def test_a_version_whose_batches_all_fail_is_routed_around_until_one_succeeds(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A worker whose every row fails in the model (here each call a poison row: a worker
    whose weights went bad answers so) answers at once, so it won the least predicted wait and
    drew more than its share (routing review: a worker that fails fast was never ejected).
    Its heartbeat now marks the version failing, and a router reading the registry routes to
    a busier peer instead; a batch that succeeds clears the mark. A real worker and model, a
    real Redis, the router's own registry sync and route table; three failed batches mark it
    here (`--failing-batches-to-mark`), over the second they must span."""
    worker = await start(tmp_path, batching=DriverConfig(failing_batches_to_mark=3))
    table = RouteTable(RoutingConfig(), random.Random(0))
    writer, reader = connect(redis_server.worker_url), connect(redis_server.router_url)
    sync = RegistrySync(
        reader, RegistryKeys(), table, RouterMetrics(CollectorRegistry()), period_s=0.05,
        on_degraded_change=nothing, worker_networks=WorkerNetworks.parse("127.0.0.0/8"),
    )  # fmt: skip
    try:
        version = heartbeat(worker).models[0].version
        busy_peer = dataclasses.replace(
            heartbeat(worker), worker_id="w1", address="127.0.0.1:1",
            models=(dataclasses.replace(heartbeat(worker).models[0], queued_rows=50),),
        )  # fmt: skip
        publishers = [HeartbeatPublisher(writer, RegistryKeys(), HeartbeatConfig(), record)
                      for record in (lambda: heartbeat(worker), lambda: busy_peer)]  # fmt: skip

        async def routed_to() -> str:
            for publisher in publishers:
                await publisher.publish_once()
            await sync.refresh_once()  # what the router's sync does every period
            decision = table.route("affine", version, 1, 10.0, time.monotonic())
            assert isinstance(decision, Route), decision
            table.release(decision.reservation_id)
            return decision.worker_id

        assert await routed_to() == "w0"  # idle: the least predicted wait
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            for num_failed in range(1, 4):
                if num_failed > 1:
                    await asyncio.sleep(0.6 * FailingConfig.min_span_s)
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.Infer(row_request(row(POISON, 1, 1, 1)), timeout=10)
                assert raised.value.code() == grpc.StatusCode.INTERNAL
                assert metric(worker, names.WORKER_ROW_FAILURES_TOTAL) == num_failed
                # Marked at the third only: routed to it until then.
                assert await routed_to() == ("w0" if num_failed < 3 else "w1")
            assert metric(worker, names.WORKER_MODEL_FAILING, model="affine") == 1
            await stub.Infer(row_request(row(1, 2, 3, 4)), timeout=10)
            assert metric(worker, names.WORKER_MODEL_FAILING, model="affine") == 0
            assert await routed_to() == "w0"
    finally:
        await writer.aclose()
        await reader.aclose()
        await worker.stop()


async def nothing(_: bool) -> None:
    """The registry sync's degraded-change callback, where nothing is to be done."""


async def test_s07_row_that_cannot_meet_its_deadline_is_refused_at_once_and_never_runs(
    tmp_path: Path,
) -> None:
    # A batch with a real cost (hundreds of matmuls, about 0.6 s here) holds the executor; the
    # next row's deadline is one batch's measured cost away, so the row cannot run in time
    # (the batch must end and the row run) while its call easily reaches the worker within
    # it: both margins are one batch's cost, which a busy machine stretches alike. The worker
    # predicts that and refuses the row on arrival instead of letting it time out. (A held
    # `stall` batch would not do: its cost as measured is short, so the row would be admitted.)
    worker = await start(tmp_path, work_iters=600, max_batch_size=1)
    assert worker.models is not None and worker.batching is not None
    (affine,) = worker.models.fixed_cost
    timeout_s = worker.batching.load_report(affine).min_batch_s
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            blocker = asyncio.ensure_future(stub.Infer(row_request(row(1, 1, 1, 1)), timeout=60))
            await until_executing(worker)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Infer(row_request(row(2, 2, 2, 2)), timeout=timeout_s)
            # Promptly: the answer came while the blocking batch was still running.
            assert not blocker.done()
            await blocker
    finally:
        await worker.stop()
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "past the request's deadline" in (raised.value.details() or "")
    hint = dict(raised.value.trailing_metadata() or ()).get("retry-after-ms")
    assert hint is not None and int(hint) > 0
    assert metric(worker, names.WORKER_ROWS_TOTAL) == 1, "the refused row must never run"
    assert metric(worker, names.WORKER_REJECTED_TOTAL, reason="deadline") == 1


async def test_s09_cancelled_queued_request_is_never_executed(tmp_path: Path) -> None:
    worker = await start(tmp_path, with_stall=True, max_batch_size=1)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            blocker = await hold_executor(worker, stub)
            doomed = stub.Infer(row_request(row(2, 2, 2, 2)), timeout=30)
            survivor = asyncio.ensure_future(stub.Infer(row_request(row(3, 3, 3, 3)), timeout=30))
            # Both queued behind the blocker before one is cancelled.
            await eventually(lambda: worker.batching.num_in_flight == 3, interval_s=0.01)
            doomed.cancel()
            await eventually(
                lambda: metric(worker, names.WORKER_DROPPED_TOTAL, reason="cancelled") == 1,
                message="the cancelled row left the queue",
            )
            assert not blocker.done()
            release_stall(tmp_path / "gate")
            await asyncio.gather(blocker, survivor)
    finally:
        release_stall(tmp_path / "gate")
        await worker.stop()
    assert metric(worker, names.WORKER_ROWS_TOTAL, model="affine") == 1  # the survivor
    assert metric(worker, names.WORKER_DROPPED_TOTAL, reason="cancelled") == 1


async def test_s01_queue_full_is_resource_exhausted_with_retry_hint(tmp_path: Path) -> None:
    worker = await start(tmp_path, with_stall=True, max_batch_size=1, max_queue_size=2)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            blocker = await hold_executor(worker, stub)
            calls = [
                asyncio.ensure_future(stub.Infer(row_request(row(i, 0, 0, 0)), timeout=30))
                for i in range(2, 6)
            ]
            await eventually(lambda: sum(c.done() for c in calls) >= 2, interval_s=0.01)
            # Refused at once: while the blocking batch still holds the executor.
            assert not blocker.done()
            release_stall(tmp_path / "gate")
            results = await asyncio.gather(*calls, return_exceptions=True)
            await blocker
    finally:
        release_stall(tmp_path / "gate")
        await worker.stop()
    rejected = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    # Two queue behind the held batch, the other two are refused.
    assert len(rejected) == 2
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in rejected)
    hints = [dict(r.trailing_metadata()).get("retry-after-ms") for r in rejected]
    assert all(h is not None and int(h) > 0 for h in hints), hints
    assert metric(worker, names.WORKER_REJECTED_TOTAL, reason="queue_full") == 2


async def test_s33_not_serving_until_loaded_then_drain_refuses_new_work(tmp_path: Path) -> None:
    write_affine_model(tmp_path / "repo")
    worker = await create_worker(
        WorkerConfig(model_repository=tmp_path / "repo", grpc_port=0, metrics_port=0)
    )
    address = f"127.0.0.1:{worker.port}"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        assert await health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Infer(row_request(row(1, 2, 3, 4)), timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        await worker.load()
        assert await health_status(address) == health_pb2.HealthCheckResponse.SERVING
        await stub.Infer(row_request(row(1, 2, 3, 4)), timeout=5)
        worker.batching.begin_drain()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Infer(row_request(row(1, 2, 3, 4)), timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    await worker.stop()


async def test_s34_queue_wait_is_exported_at_zero_load_and_rises_with_load(worker: Worker) -> None:
    # Before any request the series exists at zero, so a rate over it is defined (0, not absent).
    idle = generate_latest(worker.metrics.registry).decode()
    assert samples(
        idle, f"{names.WORKER_QUEUE_WAIT_SECONDS}_count", model="affine", version="1"
    ) == [({"model": "affine", "version": "1"}, 0.0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        await asyncio.gather(
            *(stub.Infer(row_request(row(i, 1, 1, 1)), timeout=10) for i in range(5))
        )
    assert metric(worker, f"{names.WORKER_QUEUE_WAIT_SECONDS}_count", model="affine") == 5


async def test_a_dead_batching_loop_turns_the_worker_not_serving(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 16: a worker whose loop died stayed SERVING, a black hole for its traffic.
    def broken_poll(*args: object, **kwargs: object) -> None:
        raise RuntimeError("batcher invariant broken")

    monkeypatch.setattr(Batcher, "poll", broken_poll)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Infer(row_request(row(1, 2, 3, 4)), timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        address = f"127.0.0.1:{worker.port}"
        for service in ("", "inference.v1.WorkerService"):
            await eventually(lambda s=service: _not_serving(address, s), message=f"{service!r}")
    assert str(worker.fatal_error) == "batcher invariant broken"


async def _not_serving(address: str, service: str) -> bool:
    return await health_status(address, service) == health_pb2.HealthCheckResponse.NOT_SERVING


def backend_declaring(
    tmp_path: Path, declared: str, module: torch.nn.Module | None = None
) -> Backend:
    """The affine model's backend (or `module`'s, in its place), its config declaring its
    output `declared`."""
    model_dir = write_affine_model(tmp_path / "repo")
    if module is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript
            torch.jit.script(module).save(str(model_dir / "1" / "model.pt"))
    config = model_dir / "config.toml"
    config.write_text(
        config.read_text().replace(
            '[outputs.y]\ndtype = "FP32"', f'[outputs.y]\ndtype = "{declared}"'
        )
    )
    (version,) = load_repository(tmp_path / "repo")
    return load_backend(version, torch.device("cpu"))


@pytest.mark.parametrize(
    ("declared", "is_taken"), [("FP32", True), ("FP16", True), ("INT64", False)]
)
def test_a_module_whose_outputs_are_not_of_its_configs_kind_fails_its_rows(
    tmp_path: Path, declared: str, is_taken: bool
) -> None:
    """The affine module returns float32 rows. Declared FP16 they are narrowed, as a float
    model's may be; declared INT64 they were cut to integers without a word (review finding),
    where they now fail (at warm-up too: the version does not load)."""
    backend = backend_declaring(tmp_path, declared)
    rows = backend.prepare_many([row(1.5, 0, 0, 2)])
    if is_taken:
        (output,) = backend.run(rows)
        assert output.dtype == NUMPY_DTYPES[declared]
    else:
        with pytest.raises(
            RuntimeError, match=f"returned float32 rows, config declares {declared}"
        ):
            backend.run(rows)


class _Scaled(torch.nn.Module):
    """The first two inputs times 2**33, as integers or as floats."""

    def __init__(self, as_integers: bool) -> None:
        super().__init__()
        self.as_integers = as_integers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.as_integers:
            return x[:, :2].long() * 8589934592
        return x[:, :2] * 8589934592.0


@pytest.mark.parametrize(
    ("as_integers", "declared", "is_taken"),
    [(True, "INT64", True), (True, "INT32", False), (False, "FP32", True), (False, "FP16", False)],
)
def test_outputs_past_the_range_of_the_declared_type_fail_their_rows(
    tmp_path: Path, as_integers: bool, declared: str, is_taken: bool
) -> None:
    """int64 values narrowed into a declared INT32 wrapped, and float32 ones past FP16's range
    became inf, without a word (review finding): those rows fail now. Values that fit a
    narrower type are still taken (the affine test above)."""
    backend = backend_declaring(tmp_path, declared, _Scaled(as_integers))
    rows = backend.prepare_many([row(3, 1, 0, 0)])
    if is_taken:
        (output,) = backend.run(rows)
        assert output.tolist() == [3 * 2**33, 2**33]
    else:
        with pytest.raises(RuntimeError, match=f"past the range of {declared}"):
            backend.run(rows)
