"""A status names no network address (review finding): a worker the router cannot reach fails
in grpc's words ("failed to connect to all addresses; last error: UNKNOWN:
ipv4:127.0.0.1:9: ..."), on a link the router names by the worker's address, and that status
passes through every tier to callers outside the fabric. A real redis-server, a router on port
0 and a worker registered at an address where nothing listens."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis

from services.common.registry_schema import route_metadata
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router.config import RouterConfig
from services.router.server import create_router
from tests.integration.test_router_readiness import register
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


async def test_a_worker_out_of_reach_fails_its_call_without_naming_where_it_lives(
    redis_server: RedisServer,
) -> None:
    router = await create_router(
        RouterConfig(
            redis_url=redis_server.router_url,
            grpc_port=0,
            metrics_port=0,
            refresh_period_s=0.05,
            max_retries=0,  # the worker's failure is the caller's answer
        )
    )
    sync = asyncio.create_task(router.sync.run())
    try:
        async with aioredis.from_url(redis_server.url) as client:
            await register(client, "w1", "m")  # at 127.0.0.1:9, where nothing listens
        tensor = pb.Tensor(
            dtype=pb.DATA_TYPE_FP32, shape=[1], raw_data=np.zeros(1, "<f4").tobytes()
        )
        request = pb.InferRequest(
            model_name="m", model_version="1", inputs=[pb.ModelInput(tensor=tensor)]
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)

            async def is_served() -> bool:
                listing = await stub.ListModels(pb.ListWorkerModelsRequest(), timeout=10.0)
                return any(v.model_name == "m" for v in listing.versions)

            await eventually(is_served, message="the registry read")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Infer(request, timeout=30.0, metadata=route_metadata("m", "1", 1))
        error = raised.value
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        details = error.details() or ""
        assert "<address>" in details, details  # the failure said where, and it is gone
        assert "127.0.0.1" not in details and ":9" not in details, details
    finally:
        sync.cancel()
        await router.stop()
