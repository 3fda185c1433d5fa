"""A worker front's relay of InferStreams to its engine (services.gpu_worker.stream_relay), over
a real unix socket; `integration/test_worker_fronts.py` runs real fronts and engines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.gpu_worker import stream_relay
from services.gpu_worker.stream_relay import FrontMetrics, StreamRelay

pytestmark = pytest.mark.unit


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class _Context:
    """What `relay` reads of a grpc.aio servicer context: its abort."""

    async def abort(self, code: grpc.StatusCode, details: str, trailers: object = ()) -> None:
        raise Aborted(code, details)


async def test_a_stream_connecting_as_the_engine_is_declared_lost_ends_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine is declared lost (ENGINE_LOST_S unanswered) while a stream connects to its
    link, whose listen backlog still takes connections: the stream ends UNAVAILABLE as the
    open ones do, so its calls fail over. Before, it was in no set the declaration ended, and
    waited for answers that never came."""
    link = tmp_path / "link.sock"
    held: list[asyncio.StreamWriter] = []

    async def wedged_engine(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # takes the connection, answers nothing

    server = await asyncio.start_unix_server(wedged_engine, path=str(link))
    relay = StreamRelay(link, FrontMetrics(CollectorRegistry()))
    connect = asyncio.open_unix_connection

    async def connect_as_it_is_lost(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        connection = await connect(path)
        relay.set_engine_lost(True)
        return connection

    monkeypatch.setattr(stream_relay.asyncio, "open_unix_connection", connect_as_it_is_lost)

    async def no_requests() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""  # never reached

    try:
        with pytest.raises(Aborted) as aborted:
            async with asyncio.timeout(5):
                async for _ in relay.relay(no_requests(), _Context()):  # type: ignore[arg-type]
                    pass
        assert aborted.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
