"""RELIABILITY.md's deadline, retry, cancellation and leak scenarios (5, 8, 11, 12, 21) through
the whole path: a real redis-server, a gateway and a router on port 0 in this process
(tests/support/in_process.py), and real workers, in-process (so that their state can be read)
or, for `kill -9`, as processes.

Deadlines are checked as what was answered, by whom, and in what order of events (answered while
the blocking call still held the executor; a deadline never cut short), never as "answered
within N ms": the tiers share two cores with another test module. The lower bounds that remain
(a call is not cut before its deadline) cannot be broken by a slow machine, only by a bug.

Where a scenario needs a worker's executor held, the repository serves the `stall` model
(tests/support/models.py): a call with a `STALL` row really blocks the worker's one executor
thread until the test opens its gate, and rows sent after it queue behind it.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import math
import random
import shutil
import signal
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from services.common import metric_names as names
from services.common.model_repository import DEFAULT_TIMEOUT_MS
from services.common.registry_schema import route_metadata
from services.gateway.predictor import PredictCall, PredictResult
from services.gateway.router_retry import ROUTER_STREAMS
from services.gpu_worker.batching.slice_admission import SliceAsk
from services.gpu_worker.server import Worker
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router.config import RouterConfig
from services.router.routing import RetryBudget, RouteTable
from services.router.routing_config import RoutingConfig
from tests.support.in_process import Fabric, running_fabric
from tests.support.metrics import scrape, total
from tests.support.models import STALL, release_stall, write_affine_model, write_stalling_model
from tests.support.processes import REPO_ROOT, ServiceProcess, start_worker
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

#: Client timeout of calls that must not time out (generous: the machine is shared).
PATIENT_S = 30.0
#: A generous SLO: these tests are about deadlines the callers set, not about shedding.
SLO_MS = 30_000
#: How far past the model's default a call without a deadline is held before its release
#: (scenario 8): a call wrongly cut at the default would have been cut by then.
SLACK_S = 0.5
#: Slack below a deadline for clock granularity: gRPC counts the deadline from a moment a
#: little after the test's clock read, and timers may fire a millisecond early.
EARLY_S = 0.05


def row(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def tensor(values: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=list(values.shape), raw_data=values.tobytes())


def predict_request(model: str, values: np.ndarray) -> api.PredictRequest:
    return api.PredictRequest(model_name=model, inputs=[api.PredictInput(tensor=tensor(values))])


def infer_request(model: str, values: np.ndarray, version: str = "1") -> pb.InferRequest:
    return pb.InferRequest(
        model_name=model, model_version=version, inputs=[pb.ModelInput(tensor=tensor(values))]
    )


async def status_of_call(call: asyncio.Future[object] | object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def in_flight(worker: Worker) -> int:
    assert worker.batching is not None
    return worker.batching.num_in_flight


async def hold_executor(worker: Worker, stub: pb_grpc.WorkerServiceStub) -> asyncio.Future:
    """Starts a `stall` call straight at the worker; returns it once it holds the executor."""
    blocker = asyncio.ensure_future(
        stub.Infer(infer_request("stall", row(STALL, 0, 0, 0)), timeout=60)
    )
    batching = worker.batching
    assert batching is not None
    await eventually(lambda: batching.is_executing, interval_s=0.01, message="stalled")
    return blocker


async def hold(until_s: float) -> None:
    """Keeps a fault in place until time.monotonic() reaches `until_s`: a scenario's duration,
    not a wait for a condition."""
    await asyncio.sleep(max(0.0, until_s - time.monotonic()))


# -- 5: retries stop within the retry budget; INVALID_ARGUMENT is never retried ---------------


async def router_infer_codes(
    fabric: Fabric, rows: Sequence[np.ndarray], *, at_once: bool
) -> list[grpc.StatusCode]:
    """The statuses of one Infer of affine/1 per row, sent straight to the router, all at once
    or one after the other."""
    async with grpc.aio.insecure_channel(fabric.router_address) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)

        async def infer(values: np.ndarray) -> grpc.StatusCode:
            metadata = route_metadata("affine", "1", 1)
            call = stub.Infer(infer_request("affine", values), timeout=PATIENT_S, metadata=metadata)
            return await status_of_call(call)

        if at_once:
            return list(await asyncio.gather(*(infer(r) for r in rows)))
        return [await infer(r) for r in rows]


#: The router's retry budget (services.router.routing.RetryBudget), as it is built.
_BUDGET = inspect.signature(RetryBudget).parameters
BUDGET_RATIO = _BUDGET["ratio"].default
BUDGET_RESERVE = _BUDGET["min_per_s"].default * _BUDGET["window_s"].default
BUDGET_WINDOW_S = _BUDGET["window_s"].default


async def test_s05_retries_against_always_unavailable_workers_stop_within_the_retry_budget(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Three workers, each a real worker that has begun draining while its registry record still
    says ready (the window before its next heartbeat): every call reaching it is answered
    UNAVAILABLE. Ejection is off (`eject_s=0`) so that only the retry budget limits retries;
    otherwise the first failures would take every worker out of routing and nothing would be
    retried at all. Attempts are counted where they land, at the workers. 1,000 calls the
    router refused before earn no retries (before, they raised the budget by 200).

    The budget's withdrawals expire after its window, so a load that a busy machine stretches
    past a window could spend the reserve again: the bound on retries counts the windows the
    load spanned (one, in about 1-2 s, on an idle machine) instead of asserting a duration."""
    write_affine_model(tmp_path / "repo", slo_p99_ms=SLO_MS)
    async with running_fabric(
        tmp_path / "repo", redis_server, num_workers=3, routing=RoutingConfig(eject_s=0.0)
    ) as fabric:
        max_retries = fabric.router.config.max_retries
        # First, healthy workers: a request the worker refuses as malformed is answered once.
        num_invalid = 20
        # 3 values, the model takes 4.
        codes = await router_infer_codes(fabric, [row(1, 2, 3)] * num_invalid, at_once=True)
        assert set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}
        assert fabric.worker_metric(names.WORKER_REQUESTS_TOTAL, code="INVALID_ARGUMENT") == (
            num_invalid
        )
        assert fabric.router_metric(names.ROUTER_ROUTED_TOTAL) == num_invalid
        assert fabric.router_metric(names.ROUTER_RETRIES_TOTAL) == 0

        # Calls the router refuses (a version no worker serves) earn no retries: counted, a
        # flood refused at the router made the budget a fifth of the calls offered (review).
        num_refused = 1000
        async with grpc.aio.insecure_channel(fabric.router_address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            unserved = route_metadata("affine", "9", 1)
            refused = await asyncio.gather(*(
                status_of_call(stub.Infer(infer_request("affine", row(i, 1, 2, 3), version="9"),
                                          timeout=PATIENT_S, metadata=unserved))
                for i in range(num_refused)
            ))  # fmt: skip
        assert grpc.StatusCode.OK not in refused
        assert fabric.router_metric(names.ROUTER_ROUTED_TOTAL) == num_invalid
        for worker in fabric.workers:
            assert worker.batching is not None
            worker.batching.begin_drain()
        num_requests = 150
        # Unbounded, each request would be tried on every worker: the budget must bind.
        assert num_requests * (1 + BUDGET_RATIO) + BUDGET_RESERVE < num_requests * (1 + max_retries)
        started_s = time.monotonic()
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            public = api_grpc.InferenceServiceStub(channel)
            # One at a time: concurrent calls would travel in bundles (services.gateway.
            # coalescer), and the router routes and retries a bundle as one call.
            semaphore = asyncio.Semaphore(1)

            async def send(i: int) -> grpc.StatusCode:
                async with semaphore:
                    request = predict_request("affine", row(i, 1, 2, 3))
                    return await status_of_call(public.Predict(request, timeout=PATIENT_S))

            codes = await asyncio.gather(*(send(i) for i in range(num_requests)))
        elapsed_s = time.monotonic() - started_s
        attempts = fabric.worker_metric(names.WORKER_REQUESTS_TOTAL, code="UNAVAILABLE")
        routed = fabric.router_metric(names.ROUTER_ROUTED_TOTAL) - num_invalid
        retries = fabric.router_metric(names.ROUTER_RETRIES_TOTAL)
    assert set(codes) == {grpc.StatusCode.UNAVAILABLE}
    assert attempts == routed == num_requests + retries
    # Every request the router received (the malformed ones too) earned retries, and the
    # reserve is there once per window the load spanned: a withdrawal stays counted for at
    # least half a window (the budget's ring of slices keeps it for all but one slice).
    num_windows = 1 + math.floor(elapsed_s / (BUDGET_WINDOW_S / 2))
    earned = BUDGET_RATIO * (num_requests + num_invalid) + num_windows * (BUDGET_RESERVE + 1)
    assert retries <= earned, (attempts, retries, elapsed_s)
    # Even so, far fewer than every request tried on every worker.
    assert retries < num_requests * max_retries, (attempts, retries, elapsed_s)
    # The reserve was spent (retries did happen) before the budget stopped them.
    assert retries >= BUDGET_RESERVE - 1, (attempts, retries)


async def test_a_retry_that_no_other_worker_can_take_spends_no_retry_budget(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """One worker, answering every call UNAVAILABLE (draining while its record says ready;
    ejection off): after each failure a retry is allowed, but no other worker is there to
    take it. Such a retry neither spends a token of the router-wide budget nor counts as a
    retry (before, each took a token: a few dozen calls to one failing worker emptied the
    budget that other models' real retries need)."""
    write_affine_model(tmp_path / "repo", slo_p99_ms=SLO_MS)
    async with running_fabric(
        tmp_path / "repo", redis_server, num_workers=1, routing=RoutingConfig(eject_s=0.0)
    ) as fabric:
        (worker,) = fabric.workers
        assert worker.batching is not None
        worker.batching.begin_drain()
        num_requests = int(BUDGET_RESERVE) + 10  # more than the budget's reserve
        rows = [row(i, 1, 2, 3) for i in range(num_requests)]
        codes = await router_infer_codes(fabric, rows, at_once=False)
        assert set(codes) == {grpc.StatusCode.UNAVAILABLE}
        assert fabric.worker_metric(names.WORKER_REQUESTS_TOTAL, code="UNAVAILABLE") == (
            num_requests
        )
        assert fabric.router_metric(names.ROUTER_RETRIES_TOTAL) == 0
        # Every call deposited its share and none withdrew (deposits expire after a window,
        # the reserve never does).
        assert fabric.router_metric(names.ROUTER_RETRY_BUDGET_TOKENS) >= BUDGET_RESERVE


# -- 8: the caller's deadline, shorter or longer than the model's default, is what is used ----


#: The `stall` model's default_timeout_ms in the scenario 8 repository.
STALL_DEFAULT_TIMEOUT_S = 4.5


def write_stall_repository(tmp_path: Path) -> tuple[Path, Path]:
    """The `stall` model, with a default timeout of STALL_DEFAULT_TIMEOUT_S; (repository,
    gate)."""
    repository, gate = tmp_path / "repo", tmp_path / "gate"
    config = write_stalling_model(repository, gate) / "config.toml"
    default = f"default_timeout_ms = {round(STALL_DEFAULT_TIMEOUT_S * 1000)}\n"
    config.write_text(default + config.read_text())  # top level: before the first table
    return repository, gate


@pytest.fixture
async def stall_fabric(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fabric]:
    """One worker serving the `stall` model; its gate is opened after the test whatever happens
    (before the worker drains, which would otherwise wait for the stalled call)."""
    repository, gate = write_stall_repository(tmp_path)
    async with running_fabric(repository, redis_server) as fabric:
        try:
            yield fabric
        finally:
            release_stall(gate)


async def test_s08_a_caller_deadline_shorter_than_the_default_is_honoured_end_to_end(
    tmp_path: Path, stall_fabric: Fabric
) -> None:
    """The caller's short deadline comes back as DEADLINE_EXCEEDED at that deadline (not
    before it, and while the blocking call still holds the executor), and the worker drops the
    row it had queued: it never runs, even after the executor frees."""
    (worker,) = stall_fabric.workers
    # Shorter than the default, and long beside the milliseconds the call takes to queue at
    # the worker (which must see it, to drop it), however busy the machine: through the
    # gateway and the router, a hop or two starved of a core for a second left it unqueued
    # at 1 s.
    timeout_s = 3.0
    assert timeout_s < STALL_DEFAULT_TIMEOUT_S
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as worker_channel,
        grpc.aio.insecure_channel(stall_fabric.gateway_address) as channel,
    ):
        blocker = await hold_executor(worker, pb_grpc.WorkerServiceStub(worker_channel))
        started_s = time.monotonic()
        code = await status_of_call(
            api_grpc.InferenceServiceStub(channel).Predict(
                predict_request("stall", row(1, 2, 3, 4)), timeout=timeout_s
            )
        )
        answered_s = time.monotonic() - started_s
        assert not blocker.done()
        # The worker let go of the row (expired in its queue, or withdrawn on the cancel).
        await eventually(lambda: in_flight(worker) == 1, message="only the blocker in flight")
        release_stall(tmp_path / "gate")
        assert await status_of_call(blocker) == grpc.StatusCode.OK
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert answered_s >= timeout_s - EARLY_S, answered_s
    dropped = stall_fabric.worker_metric(names.WORKER_DROPPED_TOTAL, model="stall")
    assert dropped == 1
    assert stall_fabric.worker_metric(names.WORKER_ROWS_TOTAL, model="stall") == 1  # the blocker


async def test_s08_a_caller_deadline_longer_than_the_default_is_kept_not_capped(
    tmp_path: Path, stall_fabric: Fabric
) -> None:
    """RELIABILITY.md says "a longer one is capped"; DESIGN.md decided otherwise: the deadline
    is the caller's, never capped by the SLO or the model's default (which applies only to a
    caller that sets none; `shed_past_slo` is the opt-in for shedding). So this asserts the
    design: a call without a deadline is cut at the default, while a call whose deadline is
    longer than the default, held in the queue past the default, is served."""
    (worker,) = stall_fabric.workers
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as worker_channel,
        grpc.aio.insecure_channel(stall_fabric.gateway_address) as channel,
    ):
        blocker = await hold_executor(worker, pb_grpc.WorkerServiceStub(worker_channel))
        stub = api_grpc.InferenceServiceStub(channel)
        started_s = time.monotonic()
        without_deadline = asyncio.ensure_future(
            stub.Predict(predict_request("stall", row(1, 2, 3, 4)))
        )
        with_long_deadline = asyncio.ensure_future(
            stub.Predict(predict_request("stall", row(5, 6, 7, 8)), timeout=PATIENT_S)
        )
        assert await status_of_call(without_deadline) == grpc.StatusCode.DEADLINE_EXCEEDED
        cut_after_s = time.monotonic() - started_s
        # Held past the default by more than the slack, then released.
        await hold(started_s + STALL_DEFAULT_TIMEOUT_S + SLACK_S)
        assert not with_long_deadline.done()
        release_stall(tmp_path / "gate")
        reply = await with_long_deadline
        served_after_s = time.monotonic() - started_s
        assert await status_of_call(blocker) == grpc.StatusCode.OK
    # Cut at the model's default: not before it, and not at the fabric's default or the SLO
    # (both 30 s), which a busy machine cannot stretch it to.
    assert STALL_DEFAULT_TIMEOUT_S - EARLY_S <= cut_after_s < DEFAULT_TIMEOUT_MS / 1000 / 2
    assert served_after_s > STALL_DEFAULT_TIMEOUT_S + SLACK_S
    assert len(reply.outputs) == 1
    assert stall_fabric.worker_metric(names.WORKER_ROWS_TOTAL, model="stall") == 2


# -- 11: deadlines travel as remaining time; a cancel at the gateway reaches the worker -------


async def test_s11_the_worker_gets_the_time_left_of_the_callers_deadline(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tier exports the deadline a call arrived with, so the gateway's predictor and the
    worker's batcher are watched through their public `predict` and `admit_slices`, wrapped: the
    real ones run, unchanged, and the wrappers write down the time left they were given. The
    gateway's view is the reference: gRPC's own grpc-timeout header rounds the client's
    timeout up by a few milliseconds before the gateway sees it.

    The hops take milliseconds, so "less, but not far less" is checked against bounds no busy
    machine reaches: less than the gateway had (time passed), more than half of it (not a
    shorter deadline of a tier's own). The timeout is long enough that no busy machine misses
    it."""
    write_affine_model(tmp_path / "repo", slo_p99_ms=SLO_MS)
    async with running_fabric(tmp_path / "repo", redis_server) as fabric:
        (worker,) = fabric.workers
        batching, predictor = worker.batching, fabric.gateway.predictor
        assert batching is not None
        at_gateway: list[float | None] = []
        at_worker: list[float | None] = []
        real_predict, real_admit = predictor.predict, batching.admit_slices

        async def predict(call: PredictCall) -> PredictResult:
            at_gateway.append(call.timeout_s)
            return await real_predict(call)

        def admit_slices(backend: Any, asks: Sequence[SliceAsk], **kwargs: Any) -> Any:
            at_worker.extend(ask.timeout_s for ask in asks)
            return real_admit(backend, asks, **kwargs)

        monkeypatch.setattr(predictor, "predict", predict)
        monkeypatch.setattr(batching, "admit_slices", admit_slices)
        timeout_s = 10.0
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            await stub.Predict(predict_request("affine", row(1, 2, 3, 4)), timeout=timeout_s)
            await stub.Predict(predict_request("affine", row(1, 2, 3, 4)))
    (gateway_left_s, no_deadline), (worker_left_s, default_left_s) = at_gateway, at_worker
    assert gateway_left_s is not None and no_deadline is None
    assert worker_left_s is not None and default_left_s is not None
    # Less than the gateway was given, by what the hops took (each hop sends the time left
    # when it sends: never rounded up, never the caller's whole timeout again), and not far
    # less.
    assert timeout_s / 2 < worker_left_s < gateway_left_s
    # Without a caller's deadline, the gateway's (the model's default) travels the same way.
    default_s = DEFAULT_TIMEOUT_MS / 1000.0
    assert default_s / 2 < default_left_s < default_s


async def test_s11_cancelling_a_predict_at_the_gateway_withdraws_the_workers_queued_row(
    tmp_path: Path, stall_fabric: Fabric
) -> None:
    (worker,) = stall_fabric.workers
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as worker_channel,
        grpc.aio.insecure_channel(stall_fabric.gateway_address) as channel,
    ):
        blocker = await hold_executor(worker, pb_grpc.WorkerServiceStub(worker_channel))
        call = api_grpc.InferenceServiceStub(channel).Predict(
            predict_request("stall", row(1, 2, 3, 4)), timeout=PATIENT_S
        )
        await eventually(lambda: in_flight(worker) == 2, message="the row queued at the worker")
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED

        def withdrawn() -> bool:
            labels = {"model": "stall", "reason": "cancelled"}
            return stall_fabric.worker_metric(names.WORKER_DROPPED_TOTAL, **labels) == 1

        # The cancel travels gateway -> router -> worker on their multiplexed streams.
        await eventually(withdrawn, timeout_s=30.0, message="the worker withdrew the row")
        assert in_flight(worker) == 1
        assert not blocker.done()
        release_stall(tmp_path / "gate")
        assert await status_of_call(blocker) == grpc.StatusCode.OK
    assert stall_fabric.worker_metric(names.WORKER_ROWS_TOTAL, model="stall") == 1  # the blocker
    assert stall_fabric.worker_metric(names.WORKER_DROPPED_TOTAL, reason="expired") == 0


# -- 12: after many cancels, timeouts and errors nothing per-request is left behind ---------


GENERATION = "tiny-llama"


def write_soak_repository(repository: Path) -> Path:
    """affine with a small real compute cost and a short queue (so that some rows wait, expire
    or are refused), and tiny-llama (its weights copied) for generation."""
    write_affine_model(
        repository, work_iters=20, max_batch_size=4, max_queue_size=16, slo_p99_ms=SLO_MS
    )
    shutil.copytree(REPO_ROOT / "models" / GENERATION, repository / GENERATION)
    return repository


async def test_calls_their_deadline_ends_are_counted_deadline_exceeded_at_the_gateway(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A generation whose caller's deadline ends mid-stream, ten times: grpc cancels the
    gateway's handler at that deadline, before any downstream status comes back (the stream
    downstream was given the same deadline, read later). The caller is told
    DEADLINE_EXCEEDED, and so the gateway counts it, by API and by tenant; it counted each
    CANCELLED, as a caller that went away."""
    repository = write_soak_repository(tmp_path / "repo")
    sampling = pb.SamplingParameters(max_tokens=480, ignore_eos=True)  # seconds of decoding
    async with (
        running_fabric(repository, redis_server) as fabric,
        grpc.aio.insecure_channel(fabric.gateway_address) as channel,
    ):
        stub = api_grpc.InferenceServiceStub(channel)
        for i in range(10):
            request = api.GenerateRequest(model_name=GENERATION, prompt=f"long {i}",
                                          sampling=sampling)  # fmt: skip
            code = await status_of_call(read_all(stub.Generate(request, timeout=0.5)))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED

        def counted(code: str) -> tuple[float, float]:
            by_api = fabric.gateway_metric(
                names.GATEWAY_REQUESTS_TOTAL, api="v1_generate", model=GENERATION, code=code
            )
            return by_api, fabric.gateway_metric(names.GATEWAY_TENANT_REQUESTS_TOTAL, code=code)

        codes = ("DEADLINE_EXCEEDED", "CANCELLED", "OK")
        # The caller's own timer may end its call before the gateway's handler is cancelled.
        await eventually(
            lambda: sum(counted(code)[1] for code in codes) == 10,
            message="the gateway did not count ten generations",
        )
        counts = {code: counted(code) for code in codes}
    assert counts == {"DEADLINE_EXCEEDED": (10, 10), "CANCELLED": (0, 0), "OK": (0, 0)}


#: How far up grpc rounds a deadline of 1-10 s it sends (its timeout header's encoding, in
#: 10 ms units there): the receiver may read that much more time left than its caller gave.
GRPC_DEADLINE_ROUNDING_S = 0.01


async def test_a_generations_time_at_the_gateway_comes_out_of_its_deadline_downstream(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt whose tokenizing takes 0.3 s of a 2 s deadline: the stream downstream is sent
    with what is left (at most 1.7 s), as Predict's bundles are, so the router and the worker
    admit it against the caller's own deadline. It was given the whole 2 s again, counted from
    after the tokenizing."""
    repository = write_soak_repository(tmp_path / "repo")
    async with (
        running_fabric(repository, redis_server) as fabric,
        grpc.aio.insecure_channel(fabric.gateway_address) as channel,
    ):
        predictor = fabric.gateway.predictor
        encoder = predictor.catalog.resolve(GENERATION, "").encoder
        assert encoder is not None
        encode_many = encoder.encode_many

        def slow_encode(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.3)
            return encode_many(*args, **kwargs)

        monkeypatch.setattr(encoder, "encode_many", slow_encode)
        generate, timeouts = predictor._generate, []

        def recorded(*args: Any, **kwargs: Any) -> Any:
            timeouts.append(kwargs["timeout"])
            return generate(*args, **kwargs)

        monkeypatch.setattr(predictor, "_generate", recorded)
        sampling = pb.SamplingParameters(max_tokens=4)
        request = api.GenerateRequest(model_name=GENERATION, prompt="hi", sampling=sampling)
        stub = api_grpc.InferenceServiceStub(channel)
        assert await status_of_call(read_all(stub.Generate(request, timeout=2.0))) == (
            grpc.StatusCode.OK
        )
    (timeout_s,) = timeouts
    # grpc rounds the deadline it sends up (to 10 ms between 1 and 10 s: a handler of a call
    # of 2 s may read up to 2.01 s left), so 1.7 s is the bound to 10 ms.
    assert timeout_s <= 1.7 + GRPC_DEADLINE_ROUNDING_S, timeout_s


async def read_all(stream: Any) -> None:
    async for _ in stream:
        pass


def route_tables() -> list[RouteTable]:
    """The live router's route table. The router exports no gauge of its reservations and
    keeps the table private, so it is found among live objects and read through its public
    `inflight_rows`."""
    return [o for o in gc.get_objects() if isinstance(o, RouteTable)]


async def num_futures() -> int:
    """asyncio futures (tasks included) alive in this process, after a full collection. A few
    turns of the loop first: its last callback handles still refer to what they woke."""
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()
    return sum(isinstance(o, asyncio.Future) for o in gc.get_objects())


@dataclass(frozen=True)
class SoakCall:
    kind: str
    #: Seconds after the soak starts that the call is sent.
    start_s: float
    #: The call's gRPC timeout (None: none).
    timeout_s: float | None
    #: Seconds after sending that the client cancels it (None: never).
    cancel_after_s: float | None = None


SOAK_KINDS = ("predict", "predict", "predict", "invalid", "generate", "generate")
#: Statuses the soak must produce (RESOURCE_EXHAUSTED, a full queue, may come too).
SOAK_ANSWERS = ("OK", "DEADLINE_EXCEEDED", "CANCELLED", "INVALID_ARGUMENT")


def soak_plan(rng: random.Random, num_calls: int, spread_s: float) -> list[SoakCall]:
    """Mixed calls: about a third with a deadline too short to be met, a third cancelled by
    the client at a random moment, the rest with time to spare; and invalid inputs."""
    calls = []
    for _ in range(num_calls):
        kind = rng.choice(SOAK_KINDS)
        start_s = rng.uniform(0.0, spread_s)
        fate = rng.random()
        if kind == "invalid":
            calls.append(SoakCall(kind, start_s, PATIENT_S))
        elif fate < 1 / 3:
            calls.append(SoakCall(kind, start_s, rng.uniform(0.001, 0.05)))
        elif fate < 2 / 3:
            calls.append(SoakCall(kind, start_s, PATIENT_S, rng.uniform(0.0, 0.05)))
        else:
            calls.append(SoakCall(kind, start_s, PATIENT_S))
    return calls


async def run_soak_call(stub: api_grpc.InferenceServiceStub, call: SoakCall, i: int) -> str:
    """Sends one call of the plan; returns the name of the status it ended with."""
    rpc = await soak_rpc(stub, call, i)
    return (await rpc.code()).name


async def soak_rpc(stub: api_grpc.InferenceServiceStub, call: SoakCall, i: int) -> Any:
    """Sends one call of the plan; returns it, ended. The sleeps are the plan's schedule (when
    the call is sent, when its client gives up), not waits."""
    await asyncio.sleep(call.start_s)
    rpc: Any
    if call.kind == "generate":
        sampling = pb.SamplingParameters(max_tokens=16, ignore_eos=True)
        request = api.GenerateRequest(model_name=GENERATION, prompt=f"soak {i}", sampling=sampling)
        rpc = stub.Generate(request, timeout=call.timeout_s)
        reader = asyncio.ensure_future(_drain(rpc))
    else:
        # i + 0.5: never the affine model's POISON (13.0), whose row fails INTERNAL when it
        # runs before its caller's cancel does (call 13 of the plan is cancelled after 4 ms).
        values = row(i, 1, 2) if call.kind == "invalid" else row(i + 0.5, 1, 2, 3)
        rpc = stub.Predict(predict_request("affine", values), timeout=call.timeout_s)
        reader = asyncio.ensure_future(_drain(rpc))
    if call.cancel_after_s is not None:
        await asyncio.sleep(call.cancel_after_s)
        rpc.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    return rpc


async def served_after_refusals(stub: api_grpc.InferenceServiceStub, kind: str) -> str:
    """The status of a patient call of `kind` right after the soak, sent again (a few times,
    after a pause) while the gateway's adaptive throttle refuses it: the throttle remembers the
    soak's queue-full refusals for a moment (its counts decay over 0.25 s), and a slow machine
    may meet it there. Any other refusal is returned as it came."""
    code = "RESOURCE_EXHAUSTED"
    for _ in range(5):
        rpc = await soak_rpc(stub, SoakCall(kind, 0.0, PATIENT_S), 0)
        code = (await rpc.code()).name
        if code != "RESOURCE_EXHAUSTED" or "refused at the gateway" not in await rpc.details():
            return code
        await asyncio.sleep(0.5)
    return code


async def run_soak(stub: api_grpc.InferenceServiceStub, plan: Sequence[SoakCall]) -> list[str]:
    """Sends every call of `plan` (each at its start time); returns the status names. Its own
    coroutine: the calls' tasks are gone once it returns, so counting futures sees only what
    the tiers kept."""
    return list(await asyncio.gather(*(run_soak_call(stub, c, i) for i, c in enumerate(plan))))


async def _drain(rpc: Any) -> None:
    if isinstance(rpc, grpc.aio.UnaryStreamCall):
        async for _ in rpc:
            pass
    else:
        await rpc


def generation_gauges(fabric: Fabric) -> dict[str, float]:
    return {
        name: fabric.worker_metric(name, model=GENERATION)
        for name in (
            names.GENERATION_KV_BLOCKS_USED,
            names.GENERATION_RUNNING_SEQUENCES,
            names.GENERATION_WAITING_SEQUENCES,
        )
    }


async def test_s12_a_soak_of_cancels_timeouts_and_errors_leaves_no_per_request_state(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """About 300 calls through the gateway to two workers, sent over a few seconds: short
    deadlines, client cancellations, invalid inputs, Predict and Generate mixed. Afterwards
    every gauge of per-request state is back to zero in every tier: rows in flight and queued
    at the workers, KV blocks and sequences of the generation engine, rows the router has
    reserved, and the asyncio futures of the whole process are back to what they were."""
    repository = write_soak_repository(tmp_path / "repo")
    async with running_fabric(repository, redis_server, num_workers=2) as fabric:
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            # One of each kind first: channels, streams and lazily built state exist before
            # the baseline is taken.
            warm_up = [SoakCall(kind, 0.0, PATIENT_S) for kind in set(SOAK_KINDS)]
            assert {await run_soak_call(stub, c, i) for i, c in enumerate(warm_up)} == {
                "OK",
                "INVALID_ARGUMENT",
            }
            # ... and every stream the gateway keeps to the routers (they take calls in turn).
            for i in range(ROUTER_STREAMS):
                assert await run_soak_call(stub, SoakCall("predict", 0.0, PATIENT_S), i) == "OK"
            baseline_futures = await num_futures()
            plan = soak_plan(random.Random(12), num_calls=300, spread_s=3.0)
            codes = await run_soak(stub, plan)

            def settled() -> bool:
                tables = route_tables()
                return (
                    all(in_flight(w) == 0 for w in fabric.workers)
                    and fabric.worker_metric(names.WORKER_QUEUE_DEPTH) == 0
                    and not any(generation_gauges(fabric).values())
                    and len(tables) == 1
                    and all(tables[0].inflight_rows(f"w{i}") == 0 for i in range(2))
                )

            # Cancels travel through three tiers and the engine frees blocks at its next step.
            await eventually(settled, timeout_s=30.0, message="per-request state released")
            futures_after = await num_futures()
            # Still serving, both kinds.
            assert await served_after_refusals(stub, "predict") == "OK"
            assert await served_after_refusals(stub, "generate") == "OK"
        assert generation_gauges(fabric)[names.GENERATION_KV_BLOCKS_USED] == 0
    counts = {code: codes.count(code) for code in set(codes)}
    # The soak did exercise every path: answers, timeouts, cancels and refusals.
    for code in SOAK_ANSWERS:
        assert counts.get(code, 0) > 0, counts
    # Nothing else: no crash (INTERNAL, UNKNOWN) and no tier lost (UNAVAILABLE).
    assert set(counts) <= {*SOAK_ANSWERS, "RESOURCE_EXHAUSTED"}, counts
    # A leak would keep at least one future per affected call, over a hundred here; a few
    # dozen come and go with what the soak opened (a stream to the other worker, gRPC's
    # pre-posted server calls) and the tiers' background loops.
    assert futures_after - baseline_futures < len(plan) / 5, (baseline_futures, futures_after)


# -- 21: kill -9 of a worker mid-batch ------------------------------------------------------


#: Client deadline of the scenario 21 load: retries on the other worker must fit in it
#: (generous: a call queued behind a few batches on a busy machine still fits).
KILL_LOAD_TIMEOUT_S = 15.0
#: How long the load goes on after the kill, and at least after the router dropped the killed
#: worker: calls are sent both before and after it drops it (the scenario's durations).
LOAD_AFTER_KILL_S = RoutingConfig.stale_after_s + 1.0
LOAD_AFTER_REMOVAL_S = 1.0
#: Bound on the wait for the router to drop the killed worker (heartbeat TTL 3 s plus one
#: registry refresh; generous, a condition wait).
LEAVE_ROUTING_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Outcome:
    #: time.monotonic() when the call was sent, and its latency.
    sent_s: float
    latency_s: float
    code: grpc.StatusCode


async def closed_loop(address: str, stop: asyncio.Event, concurrency: int) -> list[Outcome]:
    """`concurrency` callers, each sending one Predict after another until `stop` is set."""
    outcomes: list[Outcome] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)

        async def caller(n: int) -> None:
            i = 0
            while not stop.is_set():
                sent_s = time.monotonic()
                request = predict_request("affine", row(n, i, 1, 2))
                code = await status_of_call(stub.Predict(request, timeout=KILL_LOAD_TIMEOUT_S))
                outcomes.append(Outcome(sent_s, time.monotonic() - sent_s, code))
                i += 1

        await asyncio.gather(*(caller(n) for n in range(concurrency)))
    return outcomes


async def test_s21_a_worker_killed_mid_batch_loses_no_request_and_leaves_routing_within_the_ttl(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two worker processes serving a model whose batches take a fraction of a second, so that
    one is always running under load; the router and gateway are in this process, with the
    default heartbeat, staleness and refresh periods. One worker is killed (SIGKILL) while a
    batch runs there and more rows wait behind it.

    What is checked is what happened to each call (answered OK, or UNAVAILABLE only if it was
    in flight at the kill; none ran out its deadline), that the router stopped routing to the
    dead worker once it left the live workers, and that it did leave them. How soon it left
    (the heartbeat TTL plus a refresh, about 3.5 s) is not asserted: a condition wait bounds
    it, generously."""
    repository = tmp_path / "repo"
    write_affine_model(repository, work_iters=150, max_batch_size=4, slo_p99_ms=SLO_MS)

    def start(worker_id: str) -> ServiceProcess:
        redis_args = ("--redis-url", redis_server.worker_url, "--worker-id", worker_id)
        return start_worker(
            tmp_path,
            model_repository=repository,
            extra_args=(*redis_args, "--torch-threads", "1"),
        )

    victim_id = "p0"
    victim, survivor = await asyncio.gather(
        asyncio.to_thread(start, victim_id), asyncio.to_thread(start, "p1")
    )
    routing = RoutingConfig()
    try:
        async with running_fabric(
            repository,
            redis_server,
            num_workers=0,
            num_live_workers=2,
            refresh_period_s=RouterConfig.refresh_period_s,
            routing=routing,
        ) as fabric:
            stop = asyncio.Event()
            load = asyncio.ensure_future(closed_loop(fabric.gateway_address, stop, concurrency=6))

            def victim_is_mid_batch() -> bool:
                # Rows waiting behind a batch: the executor is busy with one.
                return total(scrape(victim.metrics_port), names.WORKER_QUEUE_DEPTH) > 0

            await eventually(
                victim_is_mid_batch,
                timeout_s=30.0,
                interval_s=0.01,
                message="a batch at the victim",
            )
            victim.process.send_signal(signal.SIGKILL)
            killed_s = time.monotonic()

            def router_sees_one_worker() -> bool:
                return fabric.router_metric(names.ROUTER_LIVE_WORKERS) == 1

            await eventually(
                router_sees_one_worker,
                interval_s=0.01,
                timeout_s=LEAVE_ROUTING_TIMEOUT_S,
                message="the killed worker left the router's live workers",
            )
            routed_to_victim = fabric.router_metric(names.ROUTER_ROUTED_TOTAL, worker=victim_id)
            await hold(max(killed_s + LOAD_AFTER_KILL_S, time.monotonic() + LOAD_AFTER_REMOVAL_S))
            stop.set()
            outcomes = await load
            assert (
                fabric.router_metric(names.ROUTER_ROUTED_TOTAL, worker=victim_id)
                == routed_to_victim
            )
            assert fabric.router_metric(names.ROUTER_RETRIES_TOTAL) >= 1
    finally:
        victim.process.kill()
        victim.process.wait()
        assert survivor.terminate() == 0, survivor.log()
    across_the_kill = [o for o in outcomes if o.sent_s < killed_s < o.sent_s + o.latency_s]
    assert across_the_kill, "no request was in flight at the kill"
    # Every request was answered within its deadline (none DEADLINE_EXCEEDED): retried
    # elsewhere, or refused UNAVAILABLE, and only a request already sent at the kill.
    failures = [o for o in outcomes if o.code != grpc.StatusCode.OK]
    assert all(o.code == grpc.StatusCode.UNAVAILABLE for o in failures), failures
    assert all(o.sent_s < killed_s for o in failures), failures
    served_after_the_kill = [o for o in outcomes if o.sent_s > killed_s]
    assert len(served_after_the_kill) > 10
    assert all(o.code == grpc.StatusCode.OK for o in served_after_the_kill)


async def test_a_generation_stream_holds_its_router_reservation_until_its_first_token(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The router reserves a stream's prompt tokens on its worker while the prompt waits, as
    the worker's heartbeat counts it; from the first token the sequence decodes, and its
    reservation is gone (held to the stream's end, every decoding stream counted as queued
    work, and new streams were refused for a wait the worker did not have)."""
    repository = tmp_path / "repo"
    repository.mkdir()
    shutil.copytree(REPO_ROOT / "models" / GENERATION, repository / GENERATION)
    request = pb.WorkerGenerateRequest(
        model_name=GENERATION,
        text="the stream decodes",
        sampling=pb.SamplingParameters(max_tokens=300, ignore_eos=True),
    )
    async with (
        running_fabric(repository, redis_server, with_gateway=False) as fabric,
        grpc.aio.insecure_channel(fabric.router_address) as channel,
    ):
        stream = pb_grpc.WorkerServiceStub(channel).Generate(
            request, timeout=PATIENT_S, metadata=route_metadata(GENERATION, "1", 20)
        )
        first = await stream.read()
        assert isinstance(first, pb.GenerateResponse)
        (table,) = route_tables()
        assert table.inflight_rows("w0") == 0
        stream.cancel()
