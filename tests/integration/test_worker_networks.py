"""A forged registry record never attracts traffic: a router started with --worker-networks
127.0.0.0/8 ignores a record advertising 10.255.0.1, however attractive it looks (a real
redis-server, a real worker and router on port 0, calls through the router)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis

from services.common.registry_schema import RegistryKeys, WorkerRecord, connect, route_metadata
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router.server import Router
from services.router.worker_networks import WorkerNetworks
from tests.support.in_process import Fabric, running_fabric
from tests.support.models import write_affine_model
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

KEYS = RegistryKeys()
FORGED_ID = "forged"


@pytest.fixture
async def fabric(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fabric]:
    """Worker `w0` and a router admitting only loopback worker addresses; no gateway."""
    repository = tmp_path / "repo"
    write_affine_model(repository)
    async with running_fabric(
        repository,
        redis_server,
        with_gateway=False,
        worker_networks=WorkerNetworks.parse("127.0.0.0/8"),
    ) as fabric:
        yield fabric


async def forge(admin: aioredis.Redis, address: str) -> None:
    """Copies w0's record as an idle worker at `address`, heartbeating a minute ahead (fresh for
    the whole test). Written as admin: whoever holds any write right could do it."""
    raw = await admin.get(KEYS.worker("w0"))
    real = WorkerRecord.from_json(raw)
    idle = tuple(dataclasses.replace(m, queued_rows=0) for m in real.models)
    forged = dataclasses.replace(real, worker_id=FORGED_ID, address=address, models=idle)
    seconds, _ = await admin.time()
    await admin.zadd(KEYS.workers, {FORGED_ID: (seconds + 60) * 1000})
    await admin.set(KEYS.worker(FORGED_ID), forged.to_json())


def sample(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


def routed_to(router: Router) -> set[str]:
    """Worker ids the router has sent at least one call to."""
    (family,) = router.metrics.routed_total.collect()
    return {s.labels["worker"] for s in family.samples if s.name.endswith("_total") and s.value}


async def infer(router: Router) -> grpc.StatusCode:
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=np.ones(4, "<f4").tobytes())
    request = pb.InferRequest(
        model_name="affine", model_version="1", inputs=[pb.ModelInput(tensor=tensor)]
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        try:
            await pb_grpc.WorkerServiceStub(channel).Infer(
                request, timeout=10, metadata=route_metadata("affine", "1", 1)
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_a_record_outside_the_worker_networks_is_never_routed_to(
    fabric: Fabric, redis_server: RedisServer
) -> None:
    router = fabric.router
    admin = connect(redis_server.url)
    try:
        await eventually(lambda: admin.get(KEYS.worker("w0")), message="w0 registered")
        await forge(admin, "10.255.0.1:8201")
        rejected = "inference_router_rejected_worker_records_total"
        await eventually(lambda: sample(router, rejected) > 0, message="forged record read")
        assert sample(router, "inference_router_live_workers") == 1

        codes = [await infer(router) for _ in range(20)]
        assert codes == [grpc.StatusCode.OK] * 20
        assert routed_to(router) == {"w0"}

        # The same record inside the allowlist is taken: the address alone kept it out.
        await forge(admin, "127.0.0.1:1")
        await eventually(
            lambda: sample(router, "inference_router_live_workers") == 2,
            message="an allowed address is admitted",
        )
    finally:
        await admin.aclose()
