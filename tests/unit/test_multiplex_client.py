"""The calling side of InferStream (services.common.multiplex.MultiplexClient): which calls a
failed stream marks not started, so that their callers may send them elsewhere.

The stream here is a stand-in for grpc.aio's call object whose writes and reads the test
controls: what these tests pin down is the client's bookkeeping of what it wrote, which
`integration/test_multiplex.py` exercises over real streams.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from services.common.errors import UpstreamError
from services.common.multiplex import MultiplexClient
from services.pb.inference.v1 import worker_pb2 as pb

pytestmark = pytest.mark.unit


class Stream:
    """One stream call: a write waits for `written` (or raises `write_error`), a read waits
    for `read_error`'s event and raises it; the status is INTERNAL (not a clean end)."""

    def __init__(self, write_error: BaseException | None = None) -> None:
        self.write_error = write_error
        self.written = asyncio.Event()
        self.messages: list[pb.InferStreamRequest] = []
        self.read_fails = asyncio.Event()

    async def write(self, message: pb.InferStreamRequest) -> None:
        if self.write_error is not None:
            raise self.write_error
        self.messages.append(message)
        await self.written.wait()

    async def read(self) -> pb.InferStreamResponse:
        await self.read_fails.wait()
        raise RuntimeError("the stream failed")

    async def done_writing(self) -> None:
        pass

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INTERNAL

    def cancel(self) -> bool:
        self.written.set()
        return True


class Channel:
    """Opens `stream` for the client's InferStream."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def stream_stream(self, method: str, **_: Any) -> Any:
        return lambda: self.stream


async def failures(calls: list[asyncio.Future[bytes]]) -> list[UpstreamError]:
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, UpstreamError) for o in outcomes), outcomes
    return [o for o in outcomes if isinstance(o, UpstreamError)]


async def test_calls_still_in_the_outbox_when_the_stream_fails_are_marked_not_started() -> None:
    """The first call's message is being written when the stream fails: it may have reached
    the peer. The calls made meanwhile waited behind it and never left: not started."""
    stream = Stream()
    client = MultiplexClient(Channel(stream), "peer")  # type: ignore[arg-type]
    first = asyncio.ensure_future(client.call(b"a", timeout_s=5.0))
    while not stream.messages:  # the writer took it up alone, and waits on its write
        await asyncio.sleep(0)
    behind = [asyncio.ensure_future(client.call(b"b", timeout_s=5.0)) for _ in range(2)]
    await asyncio.sleep(0)
    stream.read_fails.set()
    errors = await failures([first, *behind])
    assert [e.code for e in errors] == [grpc.StatusCode.UNAVAILABLE] * 3
    assert [e.is_not_started for e in errors] == [False, True, True]
    assert [c.request for c in stream.messages[0].calls] == [b"a"]
    await client.close()


@pytest.mark.parametrize(
    "write_error",
    [
        asyncio.InvalidStateError("RPC already finished."),
        # Before, only InvalidStateError was: a write failed so lost its calls' mark, and the
        # gateway did not send them to another router.
        grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "send failed"
        ),
    ],
    ids=["finished", "send-failed"],
)
async def test_a_write_grpc_refused_unsent_leaves_its_calls_not_started(
    write_error: Exception,
) -> None:
    """grpc.aio refuses a write on a stream that has finished before sending a byte
    (InvalidStateError), and raises the call's status when it finished while the write waited
    or grpc's send operation failed (AioRpcError, INTERNAL when the peer's status is lost):
    either way the message's calls never reached the peer, so they are marked not started."""
    stream = Stream(write_error=write_error)
    client = MultiplexClient(Channel(stream), "peer")  # type: ignore[arg-type]
    errors = await failures([asyncio.ensure_future(client.call(b"a", timeout_s=5.0))])
    assert [(e.code, e.is_not_started) for e in errors] == [(grpc.StatusCode.UNAVAILABLE, True)]
    await client.close()
