"""The engine's end of its fronts' streams (services.gpu_worker.engine_link) on a real Unix
socket, its frames written as a front writes them: a stream that half-closes is answered
whole, and one whose front goes away after END has its calls cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from services.common.frames import END, MESSAGE, read_frame, write_frame
from services.common.multiplex_server import MultiplexServer
from services.gpu_worker.engine_link import EngineLink
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

MAX_BYTES = 1 << 20


@dataclass
class HeldCalls:
    """A handler whose calls wait for `release`, and what became of them."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    started: int = 0
    cancelled: int = 0

    async def handle(self, request: bytes, context: object) -> bytes:
        del context
        self.started += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return request


@pytest.fixture
async def link(tmp_path: Path) -> AsyncIterator[tuple[EngineLink, HeldCalls]]:
    calls = HeldCalls()
    streams = MultiplexServer(calls.handle, deserialize=bytes, serialize=bytes)
    link = EngineLink(streams, tmp_path / "engine.sock", MAX_BYTES)
    await link.start()
    yield link, calls
    calls.release.set()
    streams.close()
    await link.close()


async def send_call_then_end(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """One call sent as a front relays it, then END (the router half-closed, or went away:
    grpc.aio ends the front's request iterator alike for both)."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    call = pb.MuxCall(call_id=1, request=b"row", timeout_us=60_000_000)
    write_frame(writer, MESSAGE, pb.InferStreamRequest(calls=[call]).SerializeToString())
    write_frame(writer, END)
    await writer.drain()
    return reader, writer


async def test_a_stream_that_half_closed_is_answered_whole(
    link: tuple[EngineLink, HeldCalls],
) -> None:
    engine, calls = link
    reader, writer = await send_call_then_end(engine.path)
    try:
        await eventually(lambda: calls.started == 1, message="the call did not start")
        calls.release.set()
        message = await read_frame(reader, MAX_BYTES)
        assert message is not None and message[0] == MESSAGE
        (result,) = pb.InferStreamResponse.FromString(message[1]).results
        assert (result.call_id, result.code, result.response) == (1, 0, b"row")
        end = await read_frame(reader, MAX_BYTES)
        assert end is not None and end[0] == END
        assert pb.MuxResult.FromString(end[1]).code == grpc.StatusCode.OK.value[0]
    finally:
        writer.close()
    assert calls.cancelled == 0


async def test_a_front_gone_after_end_has_its_calls_cancelled(
    link: tuple[EngineLink, HeldCalls],
) -> None:
    """A front relays its router's cancel as END (grpc.aio ended its request iterator as for
    a half-close), then aborts the connection: its calls were left queued and admitted until
    their deadlines, as nothing read the link after END (review finding). A connection that
    ends before the engine's own END now cancels them, as one that ends without END does."""
    engine, calls = link
    _, writer = await send_call_then_end(engine.path)
    await eventually(lambda: calls.started == 1, message="the call did not start")
    writer.transport.abort()  # as the front's relay ends a stream its router left
    await eventually(lambda: calls.cancelled == 1, message="the call was not cancelled")
