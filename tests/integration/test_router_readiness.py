"""A router is not ready before its first registry read (issue 16): a fresh router with an
empty route table would refuse every call it was sent."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2

from services.common.registry_schema import RegistryKeys, WorkerRecord
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router.config import RouterConfig
from services.router.drain import DrainGate
from services.router.server import SERVICE_NAME, create_router, ready_after_first_read
from tests.support.processes import health_status
from tests.support.records import model_record
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


async def test_a_router_draining_before_its_first_read_stays_not_ready_after_it() -> None:
    """SIGTERM before the first registry read (Redis down at the start), then Redis back
    within the drain: the first read turned the draining router SERVING, on the health
    listener that answers probes through the drain (router review)."""
    servicer = health.aio.HealthServicer()
    drain = DrainGate()
    on_degraded_change = await ready_after_first_read(servicer, drain)
    drain.start()
    await on_degraded_change(False)

    async def status(name: str) -> int:
        check = health_pb2.HealthCheckRequest(service=name)
        return (await servicer.Check(check, None)).status  # type: ignore[arg-type]

    assert await status("fabric.registry") == SERVING  # read: the registry's own name says so
    assert await status(SERVICE_NAME) == NOT_SERVING


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
    address = f"127.0.0.1:{router.port}"
    degraded = router.metrics.registry_degraded
    try:
        sync = asyncio.create_task(router.sync.run())
        try:
            # Its reads fail for a while (every 0.05 s, backing off): the outage it starts in
            # (a read failed: what the return below must tell from a first read).
            await eventually(
                lambda: router.sync._awaits_refill, timeout_s=30.0, message="a read failed"
            )
            # It has no registry, and says so.
            assert await health_status(address, "fabric.registry") == NOT_SERVING
            assert degraded._value.get() == 1  # type: ignore[attr-defined]
            redis_server.restart()

            async def ready() -> bool:
                return await health_status(address, SERVICE_NAME) == SERVING

            await eventually(ready, timeout_s=30.0, message="ready once Redis is back")
            assert await health_status(address, "fabric.registry") == SERVING
            assert degraded._value.get() == 0  # type: ignore[attr-defined]
            async with grpc.aio.insecure_channel(address) as channel:
                list_models = pb_grpc.WorkerServiceStub(channel).ListModels
                # Answered (refused UNAVAILABLE while no snapshot is held): the empty fleet.
                listing = await list_models(pb.ListWorkerModelsRequest(), timeout=10.0)
                assert not listing.versions
        finally:
            sync.cancel()
    finally:
        await router.stop()


async def register(client: aioredis.Redis, worker_id: str, *models: str) -> None:
    """`worker_id` in the registry as its heartbeat writes it, serving `models` (version 1),
    at an address no call reaches (none is made)."""
    keys = RegistryKeys()
    seconds, micros = await client.time()
    record = WorkerRecord(
        worker_id, "127.0.0.1:9", False, 0, tuple(model_record(name=m) for m in models)
    )
    await client.zadd(keys.workers, {worker_id: seconds * 1000 + micros // 1000})
    await client.set(keys.worker(worker_id), record.to_json())


async def test_after_redis_comes_back_empty_one_returning_worker_does_not_stand_for_the_fleet(
    redis_server: RedisServer,
) -> None:
    """Workers a and b, then Redis restarted empty and only a back so far: b's model stays
    served (the snapshot held through the outage keeps b while it re-registers, its heartbeat
    backing off) instead of vanishing until b's next heartbeat."""
    router = await create_router(
        RouterConfig(
            redis_url=redis_server.router_url, grpc_port=0, metrics_port=0, refresh_period_s=0.05
        )
    )
    address = f"127.0.0.1:{router.port}"
    sync = asyncio.create_task(router.sync.run())
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            list_models = pb_grpc.WorkerServiceStub(channel).ListModels

            async def served() -> set[str]:
                listing = await list_models(pb.ListWorkerModelsRequest(), timeout=10.0)
                return {v.model_name for v in listing.versions}

            async with aioredis.from_url(redis_server.url) as client:
                await register(client, "a", "m1")
                await register(client, "b", "m2")
            await eventually(lambda: served_now(served, {"m1", "m2"}), message="both served")
            redis_server.kill()

            async def degraded() -> bool:
                return await health_status(address, "fabric.registry") == NOT_SERVING

            await eventually(degraded, message="the outage seen")
            redis_server.restart()
            async with aioredis.from_url(redis_server.url) as client:
                await register(client, "a", "m1", "m3")  # a is back, with a model more
            await eventually(
                lambda: served_now(served, {"m1", "m2", "m3"}),
                timeout_s=30.0,
                message="a's return read, b's model still served",
            )
    finally:
        sync.cancel()
        await router.stop()


async def served_now(served: Callable[[], Awaitable[set[str]]], expected: set[str]) -> bool:
    return await served() == expected
