"""The job runner's channel to the public gateway: the gateway's server (not internal) keeps
grpc's own ping policy, one ping a 5 min without data, GOAWAY "too many pings" past two
strikes. With the internal channels' 10 s keepalive, a Predict the gateway answered nothing
for 50 s failed UNAVAILABLE, and every other call on the connection with it (review finding).
A real gRPC server built as the gateway's is, on loopback; about 55 s."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.channel_options import channel_options
from services.common.lifecycle import new_server
from services.jobs.__main__ import PUBLIC_KEEPALIVE_S

pytestmark = pytest.mark.integration

#: Longer than the strikes' ~50 s with pings every 10 s.
QUIET_S = 55.0


async def test_a_call_the_gateway_answers_late_survives_the_runners_keepalive() -> None:
    server = new_server()  # as the gateway's: not internal

    async def quiet(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(QUIET_S)
        return request

    handlers = {"Predict": grpc.unary_unary_rpc_method_handler(quiet)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Quiet", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        options = channel_options(PUBLIC_KEEPALIVE_S)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            predict = channel.unary_unary("/t.Quiet/Predict")
            assert await predict(b"x", timeout=QUIET_S + 30) == b"x"
    finally:
        await server.stop(None)
