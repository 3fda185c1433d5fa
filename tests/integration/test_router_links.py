"""A router closes its link (channel and stream) to a worker that left the registry, once it
has been gone for the linger with no call on it: a rollout's old pods otherwise leave a
channel each for the router's whole life. Real grpc servers on loopback: a worker front that
holds every call it is sent, and a real router with real in-process workers on a real
redis-server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.common.metric_names import ROUTER_WORKER_LINKS
from services.common.multiplex import STREAM_METHOD
from services.common.registry_schema import route_metadata
from services.common.tls import ClientTls
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router.worker_links import WorkerLinks
from tests.support.in_process import running_fabric, start_in_process_worker
from tests.support.models import write_affine_model
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

LINGER_S = 1.0


@contextlib.asynccontextmanager
async def holding_server() -> AsyncIterator[str]:
    """A grpc server on loopback whose InferStream reads every call and answers none."""

    async def hold(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        async for _ in requests:
            pass
        await asyncio.Event().wait()

    service, method = STREAM_METHOD.strip("/").split("/")
    handler = grpc.method_handlers_generic_handler(
        service, {method: grpc.stream_stream_rpc_method_handler(hold)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


async def test_a_link_closes_only_after_its_address_left_for_the_linger_with_no_call_on_it() -> (
    None
):
    links = WorkerLinks(ClientTls(), linger_s=LINGER_S)
    async with holding_server() as address:
        stream = links.stream(address)
        # Live and idle: kept, whatever the time.
        await links.prune({address}, 0.0)
        await links.prune({address}, 100.0)
        assert len(links) == 1
        call = asyncio.create_task(stream.call(b"held", timeout_s=60))
        await eventually(lambda: stream.num_pending == 1, interval_s=0.01)
        # Gone from 101 s on: kept for the linger, then kept while its call runs.
        await links.prune(set(), 101.0)
        await links.prune(set(), 101.0 + LINGER_S / 2)
        assert len(links) == 1
        await links.prune(set(), 101.0 + 2 * LINGER_S)
        assert len(links) == 1 and links.stream(address) is stream
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        assert stream.num_pending == 0
        await links.prune(set(), 101.0 + 2 * LINGER_S)
        assert len(links) == 0
        # Routed to again (a worker back at its address): a new link.
        assert links.stream(address) is not stream and len(links) == 1
        # Back in the snapshot before the linger ended: its time gone starts again.
        await links.prune(set(), 200.0)
        await links.prune({address}, 200.0 + LINGER_S / 2)
        await links.prune(set(), 200.0 + LINGER_S)
        assert len(links) == 1
        # A generation stream (on the channel, not the stream) holds the link too.
        links.generation_started(address)
        await links.prune(set(), 200.0 + 3 * LINGER_S)
        assert len(links) == 1
        links.generation_ended(address)
        await links.prune(set(), 200.0 + 3 * LINGER_S)
        assert len(links) == 0
        # `close` while a prune closes the same link (a router stopping mid-read): each once.
        links.stream(address)
        await asyncio.gather(links.close(), links.prune(set(), 1_000.0 + 3 * LINGER_S))
        assert len(links) == 0
    await links.close()


async def test_a_router_closes_its_link_to_a_worker_that_left_the_registry(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    repository = tmp_path / "repo"
    write_affine_model(repository, slo_p99_ms=30_000)
    async with running_fabric(repository, redis_server, with_gateway=False) as fabric:
        router = fabric.router
        router.forwarder.links.linger_s = LINGER_S

        def links() -> float:
            return fabric.router_metric(ROUTER_WORKER_LINKS)

        async def infer() -> None:
            tensor = pb.Tensor(
                dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=np.ones(4, "<f4").tobytes()
            )
            request = pb.InferRequest(
                model_name="affine", model_version="1", inputs=[pb.ModelInput(tensor=tensor)]
            )
            async with grpc.aio.insecure_channel(fabric.router_address) as channel:
                await pb_grpc.WorkerServiceStub(channel).Infer(
                    request, timeout=30, metadata=route_metadata("affine", "1", 1)
                )

        await infer()
        assert links() == 1
        newcomer = await start_in_process_worker(repository, redis_server, "w-new")
        try:
            await fabric.worker.stop()  # deregisters: gone from the next read
            fabric.workers.clear()
            await eventually(lambda: links() == 0, timeout_s=30, interval_s=0.05)
            await infer()  # the newcomer serves it, over a new link
            assert links() == 1
            assert newcomer.metrics.registry.get_sample_value(
                "inference_worker_requests_total",
                {"model": "affine", "version": "1", "code": "OK"},
            )
        finally:
            await newcomer.stop()
