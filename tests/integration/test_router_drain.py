"""A draining router refuses new calls as not started (RELIABILITY.md scenario 29), so that
gateways may resend them to another router; a router that is gone is "not started" too."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common.errors import NOT_STARTED_TRAILER, UpstreamError
from services.common.multiplex import MultiplexClient
from services.common.registry_schema import route_metadata
from services.gateway.predictor import GENERATE_METHOD
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router.config import RouterConfig
from services.router.server import SERVICE_NAME, Router, create_router
from tests.support.processes import health_status
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

INFER = pb.InferRequest(model_name="minilm", model_version="1").SerializeToString()
METADATA = tuple(route_metadata("minilm", "1", 1))
#: Deadline of calls that must be refused: generous, so that a busy machine cannot turn a
#: refusal into DEADLINE_EXCEEDED (each is refused at once).
PATIENT_S = 30.0


async def ready_router(redis_server: RedisServer) -> tuple[Router, asyncio.Task[None]]:
    router = await create_router(
        RouterConfig(
            redis_url=redis_server.router_url, grpc_port=0, metrics_port=0, refresh_period_s=0.05
        )
    )
    sync = asyncio.create_task(router.sync.run())
    address = f"127.0.0.1:{router.port}"

    async def ready() -> bool:
        return await health_status(address, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING

    await eventually(ready, message="router ready")
    return router, sync


async def test_s29_a_draining_router_refuses_new_calls_marked_not_started(
    redis_server: RedisServer,
) -> None:
    router, sync = await ready_router(redis_server)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            client = MultiplexClient(channel, "router")
            # Before draining, a failure here (no worker serves the model) is not marked:
            # the caller cannot know that nothing ran.
            with pytest.raises(UpstreamError) as before:
                await client.call(INFER, metadata=METADATA, timeout_s=PATIENT_S)
            assert not before.value.is_not_started
            # What Router.stop does first; the server keeps listening through its grace.
            router.drain.start()
            router.streams.close()
            for _ in range(2):  # the refused stream's successor is refused the same way
                with pytest.raises(UpstreamError) as refused:
                    await client.call(INFER, metadata=METADATA, timeout_s=PATIENT_S)
                assert refused.value.code is grpc.StatusCode.UNAVAILABLE
                assert refused.value.is_not_started
            generate = channel.unary_stream(GENERATE_METHOD)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await generate(b"", metadata=METADATA, timeout=PATIENT_S).read()
            assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
            assert NOT_STARTED_TRAILER in tuple(raised.value.trailing_metadata() or ())
            await client.close()
    finally:
        sync.cancel()
        await router.stop()


async def test_a_call_to_a_router_that_is_gone_is_not_started(redis_server: RedisServer) -> None:
    router, sync = await ready_router(redis_server)
    sync.cancel()
    await router.stop()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        client = MultiplexClient(channel, "router")
        with pytest.raises(UpstreamError) as raised:
            await client.call(INFER, metadata=METADATA, timeout_s=PATIENT_S)
        await client.close()
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE
    assert raised.value.is_not_started


async def test_a_router_that_has_not_read_the_registry_refuses_calls_not_started(
    redis_server: RedisServer,
) -> None:
    """A router just started (its registry sync not yet run) has an empty route table: its
    calls are refused marked not started, so gateways send them to another router, and its
    ListModels is refused, so that no gateway takes the empty table for the fleet's catalog
    (seen in a rolling restart: a gateway refused every call until its next catalog poll)."""
    router = await create_router(
        RouterConfig(redis_url=redis_server.router_url, grpc_port=0, metrics_port=0)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            client = MultiplexClient(channel, "router")
            with pytest.raises(UpstreamError) as refused:
                await client.call(INFER, metadata=METADATA, timeout_s=PATIENT_S)
            assert refused.value.code is grpc.StatusCode.UNAVAILABLE
            assert refused.value.is_not_started
            await client.close()
            list_models = pb_grpc.WorkerServiceStub(channel).ListModels
            with pytest.raises(grpc.aio.AioRpcError) as listing:
                await list_models(pb.ListWorkerModelsRequest(), timeout=PATIENT_S)
            assert listing.value.code() is grpc.StatusCode.UNAVAILABLE
            # Once it has read the (empty) registry, its empty catalog is the fleet's.
            await router.sync.refresh_once()
            assert not (await list_models(pb.ListWorkerModelsRequest())).versions
    finally:
        await router.stop()
