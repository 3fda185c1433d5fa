"""OpenAI streams whose client stops reading, or goes away, through the gateway's own stream
writer (services.gateway.http.sse) and error middleware, served by aiohttp on loopback to a
real socket: the stream is dropped and counted CANCELLED, its generation closed; a client that
reads gets every event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.gateway.http import sse
from services.gateway.http.openai_api import _stream
from services.gateway.http.openai_codec import ResponseShape
from services.gateway.metrics import GatewayMetrics
from tests.support.http_app import serving_route
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

#: One chunk's text: 64 KiB, so that the connection's buffers (a few MB on loopback) fill
#: within a few hundred chunks.
TEXT = "x" * 65_536


class Generation:
    """Chunks as a generation's: `count` of TEXT (None: without end), then a finish."""

    def __init__(self, count: int | None) -> None:
        self.count = count
        self.is_closed = False

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        try:
            sent = 0
            while self.count is None or sent < self.count:
                sent += 1
                yield {"text_output": TEXT, "finish_reason": None}
                await asyncio.sleep(0)
            yield {"text_output": "", "finish_reason": "stop"}
        finally:
            self.is_closed = True


@contextlib.asynccontextmanager
async def serving(generation: Generation, metrics: GatewayMetrics) -> AsyncIterator[int]:
    """The OpenAI completions route streaming `generation`, behind the gateway's middleware;
    yields its port."""

    async def completions(request: web.Request) -> web.StreamResponse:
        shape = ResponseShape("cmpl-1", "m", 0, is_chat=False)
        with metrics.observe_request("v1", "m"):  # as the OpenAI routes count their requests
            return await _stream(request, shape, generation.chunks(), include_usage=False)

    async with serving_route("/v1/completions", completions) as port:
        yield port


def counted(metrics: GatewayMetrics) -> Callable[[str], float | None]:
    def count(code: str) -> float | None:
        return metrics.registry.get_sample_value(
            names.GATEWAY_REQUESTS_TOTAL, {"api": "v1", "model": "m", "code": code}
        )

    return count


def ask(port: int) -> socket.socket:
    """A connection that has asked for the stream, with a small receive buffer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = b"{}"
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


async def test_a_client_that_stops_reading_is_dropped_and_counted_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sse, "WRITE_TIMEOUT_S", 0.5)
    metrics, generation = GatewayMetrics(CollectorRegistry()), Generation(None)
    count = counted(metrics)
    async with serving(generation, metrics) as port:
        sock = ask(port)  # never reads
        try:
            await eventually(lambda: count("CANCELLED") or count("INTERNAL"), timeout_s=60.0,
                             message="the stalled stream was never ended")  # fmt: skip
            await eventually(lambda: generation.is_closed, timeout_s=10.0,
                             message="the generation was not closed")  # fmt: skip
        finally:
            sock.close()
    assert count("CANCELLED") == 1
    assert count("INTERNAL") is None  # not taken for a bug


async def test_a_client_that_goes_away_is_counted_cancelled() -> None:
    metrics, generation = GatewayMetrics(CollectorRegistry()), Generation(None)
    count = counted(metrics)
    async with serving(generation, metrics) as port:
        sock = ask(port)
        assert await asyncio.to_thread(sock.recv, 1 << 16)  # the stream began
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # a reset: gone
        await eventually(lambda: count("CANCELLED") or count("INTERNAL"), timeout_s=60.0,
                         message="a gone client's stream was never ended")  # fmt: skip
    assert count("CANCELLED") == 1
    assert count("INTERNAL") is None  # not taken for a bug


async def test_a_client_that_reads_gets_every_event(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "WRITE_TIMEOUT_S", 5.0)
    metrics, generation = GatewayMetrics(CollectorRegistry()), Generation(200)
    async with serving(generation, metrics) as port:
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json={}) as answer:
            assert answer.status == 200
            body = (await answer.read()).decode()
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    texts = [json.loads(event)["choices"][0]["text"] for event in events[:-1]]
    assert texts[:200] == [TEXT] * 200
    assert counted(metrics)("OK") == 1
