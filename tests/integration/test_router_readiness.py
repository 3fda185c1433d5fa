"""A router is not ready before its first registry read (issue 16): a fresh router with an
empty route table would refuse every call it was sent."""

from __future__ import annotations

import asyncio

import pytest
from grpc_health.v1 import health_pb2

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
