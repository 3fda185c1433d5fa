"""A router ejects a worker whose calls only time out (issue 16): a real redis-server, real
in-process workers and a router on port 0, calls through the router. Worker w1 is alive (it
heartbeats) but its executor is held by a real model call that blocks, so every call routed
there times out; after `timeouts_to_eject` of them the router stops sending it anything while
another worker can take its calls, and requests reach the healthy worker w2."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.common.registry_schema import route_metadata
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.config import HeartbeatConfig, WorkerConfig
from services.gpu_worker.server import Worker, create_worker
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router.config import RouterConfig
from services.router.routing_config import RoutingConfig
from services.router.server import Router, create_router
from tests.support.models import STALL, release_stall, write_stalling_model
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

TIMEOUTS_TO_EJECT = 2
#: Deadline of the calls that reach the wedged worker: they can only time out, so it sets how
#: long each takes, not whether it passes.
WEDGED_CALL_TIMEOUT_S = 0.5
#: Deadline of the calls that must be answered (OK, or refused at once): generous, so that a
#: busy machine cannot turn an answer into DEADLINE_EXCEEDED (or a healthy worker's timeout).
PATIENT_S = 30.0


def request(*values: float) -> pb.InferRequest:
    tensor = pb.Tensor(
        dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=np.array(values, "<f4").tobytes()
    )
    return pb.InferRequest(
        model_name="stall", model_version="1", inputs=[pb.ModelInput(tensor=tensor)]
    )


async def start_worker(tmp_path: Path, redis_server: RedisServer, worker_id: str) -> Worker:
    write_stalling_model(tmp_path / worker_id, tmp_path / f"{worker_id}.gate")
    worker = await create_worker(
        WorkerConfig(
            model_repository=tmp_path / worker_id,
            grpc_port=0,
            metrics_port=0,
            redis_url=redis_server.worker_url,
            worker_id=worker_id,
            heartbeat=HeartbeatConfig(period_s=0.05),
            # The worker's own watchdog would answer UNAVAILABLE; here it never fires, so the
            # router sees nothing but timeouts.
            batching=DriverConfig(watchdog_s=600.0),
        )
    )
    await worker.load()
    return worker


@pytest.fixture
async def router(redis_server: RedisServer) -> AsyncIterator[Router]:
    router = await create_router(
        RouterConfig(
            redis_url=redis_server.router_url,
            grpc_port=0,
            metrics_port=0,
            refresh_period_s=0.05,
            routing=RoutingConfig(timeouts_to_eject=TIMEOUTS_TO_EJECT, timeout_eject_s=60.0),
        )
    )
    sync = asyncio.create_task(router.sync.run())
    try:
        yield router
    finally:
        await router.stop()
        sync.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sync


def sample(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


def live_workers(router: Router) -> float:
    return sample(router, "inference_router_live_workers")


async def infer(router: Router, timeout_s: float = PATIENT_S) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        try:
            await pb_grpc.WorkerServiceStub(channel).Infer(
                request(1, 2, 3, 4),
                timeout=timeout_s,
                metadata=route_metadata("stall", "1", 1),
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_a_worker_whose_calls_only_time_out_is_ejected_and_traffic_goes_elsewhere(
    tmp_path: Path, redis_server: RedisServer, router: Router
) -> None:
    wedged = await start_worker(tmp_path, redis_server, "w1")
    healthy: Worker | None = None
    routed = "inference_router_routed_total"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{wedged.port}") as channel:
            stuck = asyncio.ensure_future(
                pb_grpc.WorkerServiceStub(channel).Infer(request(STALL, 0, 0, 0), timeout=60)
            )
            await eventually(lambda: wedged.batching.is_executing, interval_s=0.01)
            await eventually(lambda: live_workers(router) == 1, message="w1 in routing")
            timeouts = [
                await infer(router, WEDGED_CALL_TIMEOUT_S) for _ in range(TIMEOUTS_TO_EJECT)
            ]
            # The router's own deadline on the call ends a moment after the client's.
            ejections = await eventually(
                lambda: sample(router, "inference_router_ejections_total", worker="w1")
            )
            # Ejected, but the only worker of its model: still routed there (Envoy's panic
            # mode), since every worker timing out is more likely an overloaded machine than a
            # wedged one, and ejecting the last would answer nobody.
            alone = await infer(router, WEDGED_CALL_TIMEOUT_S)
            routed_alone = sample(router, routed, model="stall", version="1", worker="w1")
            healthy = await start_worker(tmp_path, redis_server, "w2")
            await eventually(lambda: live_workers(router) == 2, message="w2 in routing")
            sent_to_w1 = sample(router, routed, model="stall", version="1", worker="w1")
            codes = [await infer(router) for _ in range(5)]
            after = sample(router, routed, model="stall", version="1", worker="w1")
            release_stall(tmp_path / "w1.gate")
            await stuck
    finally:
        release_stall(tmp_path / "w1.gate")
        await wedged.stop()
        if healthy is not None:
            await healthy.stop()
    assert timeouts == [grpc.StatusCode.DEADLINE_EXCEEDED] * TIMEOUTS_TO_EJECT
    assert ejections == 1
    assert alone == grpc.StatusCode.DEADLINE_EXCEEDED
    assert routed_alone == TIMEOUTS_TO_EJECT + 1
    # With another worker to take them, the ejected one gets nothing.
    assert codes == [grpc.StatusCode.OK] * 5
    assert after == sent_to_w1 == TIMEOUTS_TO_EJECT + 1
