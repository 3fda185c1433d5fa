"""A gateway's stop drains both its listeners at once, within its one grace: an HTTP request
that never completes is cut at the grace, and gRPC takes no new call meanwhile (a real
in-process gateway on port 0, raw sockets and a stock-shaped KServe call)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from tests.support.in_process import start_lone_gateway
from tests.support.models import write_affine_model
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

#: Long enough that the refusal below is seen within it on a loaded machine.
DRAIN_GRACE_S = 3.0
#: Far past the grace: the stop must not wait for the request (aiohttp's own default is 60 s).
STOP_BOUND_S = 30.0


async def test_a_request_that_never_completes_holds_neither_the_stop_nor_grpc_open(
    tmp_path: Path,
) -> None:
    write_affine_model(tmp_path / "repo")
    gateway = await start_lone_gateway(
        tmp_path / "repo", allow_unauthenticated=True, drain_grace_s=DRAIN_GRACE_S
    )
    assert gateway.http is not None
    address = f"127.0.0.1:{gateway.port}"
    # Headers and half a body: the handler waits for the rest, which never comes.
    _, writer = await asyncio.open_connection("127.0.0.1", gateway.http.port)
    writer.write(
        b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\n"
        b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"inputs": ['
    )
    await writer.drain()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            live = kserve_grpc.GRPCInferenceServiceStub(channel).ServerLive
            assert (await live(kserve.ServerLiveRequest(), timeout=5)).live
            stopping = asyncio.ensure_future(gateway.stop())

            async def refused_now() -> bool:
                """Refused UNAVAILABLE: a call that met the server's stop as it began may end
                CANCELLED instead; the next is refused."""
                try:
                    await live(kserve.ServerLiveRequest(), timeout=5)
                except grpc.aio.AioRpcError as error:
                    return error.code() == grpc.StatusCode.UNAVAILABLE
                return False

            await eventually(refused_now, timeout_s=STOP_BOUND_S, message="refused")
            # Within the grace, gRPC already takes no new call: the stop still waits for the
            # HTTP request (before, gRPC served until the HTTP drain had ended).
            assert not stopping.done()
            await asyncio.wait_for(stopping, STOP_BOUND_S)
    finally:
        writer.close()
