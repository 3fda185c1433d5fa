"""Event streams give up on a client that stops reading (services.gateway.http.sse): a real
aiohttp server on loopback, a real socket client."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from aiohttp import web

from services.gateway.http.errors import AnsweredInBand
from services.gateway.http.sse import SSE_CONTENT_TYPE, EventWriter

pytestmark = pytest.mark.integration

#: One event of 64 KiB: the connection's buffers (a few MB on loopback) fill within a few
#: hundred of them.
EVENT = b"data: " + b"x" * 65_536 + b"\n\n"


@contextlib.asynccontextmanager
async def streaming(events: int, outcomes: asyncio.Queue[object]) -> AsyncIterator[int]:
    """A server whose one route streams `events` EVENTs, each write within 0.5 s, and puts
    what became of each stream in `outcomes`; yields its port."""

    async def handler(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        await answer.prepare(request)
        writer = EventWriter(request, answer, timeout_s=0.5)
        try:
            for _ in range(events):
                await writer.send(EVENT)
            await writer.end()
            outcomes.put_nowait("sent")
        except Exception as error:
            try:
                await writer.end_in_band((b"data: failed\n\n",), error)
            except AnsweredInBand as answered:
                transport = request.transport
                outcomes.put_nowait((answered, transport is None or transport.is_closing()))
        return answer

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def client(port: int) -> socket.socket:
    """A connection that has asked for the stream, with a small receive buffer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
    return sock


def read_until(sock: socket.socket, expected: int) -> int:
    """Bytes read until `expected` have come or the server stops sending."""
    total = 0
    sock.settimeout(30.0)
    while total < expected and (chunk := sock.recv(1 << 16)):
        total += len(chunk)
    return total


async def test_a_client_that_stops_reading_is_dropped_and_its_stream_ends() -> None:
    outcomes: asyncio.Queue[object] = asyncio.Queue()
    async with streaming(100_000, outcomes) as port:  # 6.5 GB: never all sent
        sock = client(port)  # never reads
        try:
            outcome = await asyncio.wait_for(outcomes.get(), timeout=60.0)
        finally:
            sock.close()
    assert isinstance(outcome, tuple), outcome
    answered, is_dropped = outcome
    assert answered.code == grpc.StatusCode.CANCELLED
    assert "read none of the stream" in str(answered)
    assert is_dropped


async def test_a_client_that_reads_gets_every_event() -> None:
    outcomes: asyncio.Queue[object] = asyncio.Queue()
    expected = 200 * len(EVENT)
    async with streaming(200, outcomes) as port:
        sock = client(port)
        try:
            total = await asyncio.to_thread(read_until, sock, expected)
            outcome = await asyncio.wait_for(outcomes.get(), timeout=60.0)
        finally:
            sock.close()
    assert outcome == "sent"
    assert total >= expected
