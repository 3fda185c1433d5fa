"""A router is not ready before its first registry read (issue 16): a fresh router with an
empty route table would refuse every call it was sent."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router.config import RouterConfig
from services.router.server import SERVICE_NAME, create_router
from tests.support.processes import health_status
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_s33_ready_only_after_the_first_registry_read(redis_server: RedisServer) -> None:
    router = await create_router(
        RouterConfig(
            redis_url=redis_server.router_url, grpc_port=0, metrics_port=0, refresh_period_s=0.05
        )
    )
    address = f"127.0.0.1:{router.port}"
    try:
        # Alive (liveness must not restart it), not ready: the registry has not been read.
        assert await health_status(address) == SERVING
        assert await health_status(address, SERVICE_NAME) == NOT_SERVING
        sync = asyncio.create_task(router.sync.run())
        try:

            async def ready() -> bool:
                return await health_status(address, SERVICE_NAME) == SERVING

            await eventually(ready, message="ready after the first read")
            # Redis going away later flips only the registry's own name: routing goes on
            # from the last snapshot, so the router stays ready.
            redis_server.kill()

            async def degraded() -> bool:
                return await health_status(address, "fabric.registry") == NOT_SERVING

            await eventually(degraded, message="registry NOT_SERVING")
            assert await health_status(address, SERVICE_NAME) == SERVING
        finally:
            sync.cancel()
    finally:
        await router.stop()


async def test_a_router_started_while_redis_was_down_takes_the_registry_it_finds_empty(
    redis_server: RedisServer,
) -> None:
    """Redis down at the router's start, then back empty: the router reads the empty registry
    as its snapshot (there is no earlier one to keep frozen), so its readiness and what it
    answers agree: an empty fleet's (empty) catalog, not 'registry not loaded yet' for as
    long as no worker registers."""
    redis_server.kill()
    router = await create_router(
        RouterConfig(
            redis_url=redis_server.router_url, grpc_port=0, metrics_port=0, refresh_period_s=0.05
        )
    )
    try:
        sync = asyncio.create_task(router.sync.run())
        try:
            # Its reads fail for a while (every 0.05 s, backing off): the outage it starts in.
            await asyncio.sleep(0.5)
            redis_server.restart()
            address = f"127.0.0.1:{router.port}"

            async def ready() -> bool:
                return await health_status(address, SERVICE_NAME) == SERVING

            await eventually(ready, timeout_s=30.0, message="ready once Redis is back")
            async with grpc.aio.insecure_channel(address) as channel:
                list_models = pb_grpc.WorkerServiceStub(channel).ListModels
                # Answered (refused UNAVAILABLE while no snapshot is held): the empty fleet.
                listing = await list_models(pb.ListWorkerModelsRequest(), timeout=10.0)
                assert not listing.versions
        finally:
            sync.cancel()
    finally:
        await router.stop()
