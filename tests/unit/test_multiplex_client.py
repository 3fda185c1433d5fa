"""The calling side of InferStream (services.common.multiplex.MultiplexClient): which calls a
failed stream marks not started, so that their callers may send them elsewhere.

The stream here is a stand-in for grpc.aio's call object whose writes and reads the test
controls: what these tests pin down is the client's bookkeeping of what it wrote, which
`integration/test_multiplex.py` exercises over real streams.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.common import multiplex
from services.common.errors import UpstreamError
from services.common.multiplex import MultiplexClient
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.waiting import eventually

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


class LateStatusStream(Stream):
    """A stream whose write fails and whose status comes only once `status` is set."""

    def __init__(self) -> None:
        super().__init__(write_error=asyncio.InvalidStateError("RPC already finished."))
        self.status, self.status_asked = asyncio.Event(), asyncio.Event()

    async def code(self) -> grpc.StatusCode:
        self.status_asked.set()
        await self.status.wait()
        return grpc.StatusCode.INTERNAL


class Streams:
    """Opens each stream of `streams` in turn for the client's InferStream."""

    def __init__(self, *streams: Stream) -> None:
        self.streams = list(streams)

    def stream_stream(self, method: str, **_: Any) -> Any:
        return lambda: self.streams.pop(0)


async def test_a_call_made_while_a_failed_write_waits_for_the_status_opens_a_new_stream() -> None:
    """A write failed and the writer waits (up to a second) for the stream's status. A call
    made meanwhile was queued on that stream, to fail with it at the end of the wait (review
    finding); it goes out on a new stream at once."""
    broken, fresh = LateStatusStream(), Stream()
    client = MultiplexClient(Streams(broken, fresh), "peer")  # type: ignore[arg-type]
    first = asyncio.ensure_future(client.call(b"a", timeout_s=5.0))
    await asyncio.wait_for(broken.status_asked.wait(), timeout=5.0)
    second = asyncio.ensure_future(client.call(b"b", timeout_s=5.0))
    try:
        await eventually(lambda: fresh.messages, timeout_s=5.0, interval_s=0.001)
        assert [c.request for c in fresh.messages[0].calls] == [b"b"]
    finally:
        broken.status.set()
        await failures([first])
        second.cancel()
        await client.close()


@contextlib.asynccontextmanager
async def stalled() -> AsyncIterator[tuple[Stream, MultiplexClient, list[asyncio.Future[bytes]]]]:
    """A client whose writer waits on its first call's write (the peer reads nothing until
    `stream.written` is set); the calls the test adds to the list are cancelled at the end."""
    stream = Stream()
    client = MultiplexClient(Channel(stream), "peer")  # type: ignore[arg-type]
    calls = [asyncio.ensure_future(client.call(b"a", timeout_s=30.0))]
    try:
        await eventually(lambda: stream.messages, interval_s=0.001)
        yield stream, client, calls
    finally:
        for call in calls:
            call.cancel()
        await client.close()


async def test_calls_that_time_out_behind_a_stalled_write_are_freed_and_never_cancelled() -> None:
    """A peer that stops reading holds the writer in a write: the calls made meanwhile time
    out before they leave. Each stayed in the outbox, its request bytes with it, until the
    write returned, and its id was then sent as a cancel for a call the peer never had (review
    finding). They are freed as they time out, and the peer hears nothing of them."""
    async with stalled() as (stream, client, calls):
        late = [asyncio.ensure_future(client.call(b"b" * 1000, timeout_s=0.01)) for _ in range(100)]
        errors = await failures(late)
        assert {e.code for e in errors} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        (state,) = client._streams
        assert len(state.outbox) < 10 and not state.unsent and not state.cancelled
        calls.append(asyncio.ensure_future(client.call(b"c", timeout_s=30.0)))
        await asyncio.sleep(0)
        stream.written.set()  # the peer reads again
        await eventually(lambda: len(stream.messages) >= 2, interval_s=0.001)
        assert [c.request for c in stream.messages[1].calls] == [b"c"]
        assert list(stream.messages[1].cancelled_call_ids) == []


async def test_a_call_s_time_left_is_read_as_it_is_written() -> None:
    """A call waited 0.3 s behind a stalled write: it was sent with the time it had left when
    it was queued, and the peer worked for a caller about to give up (review finding)."""
    async with stalled() as (stream, client, calls):
        calls.append(asyncio.ensure_future(client.call(b"b", timeout_s=30.0)))
        (state,) = client._streams
        # Its time is stamped as it is queued: the 0.3 s counts from then, not from a task
        # that a slow machine starts some milliseconds after the test's sleep began.
        await eventually(lambda: len(state.unsent) == 1, interval_s=0.001)
        await asyncio.sleep(0.3)
        stream.written.set()
        await eventually(lambda: len(stream.messages) >= 2, interval_s=0.001)
        (sent,) = stream.messages[1].calls
        assert 0 < sent.timeout_us <= 29_700_000, sent.timeout_us


async def test_a_call_that_cannot_be_made_leaves_nothing_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its message failed to build after its future was registered: a future nobody awaits
    kept the stream from ever half-closing and its link from being pruned (review finding)."""

    def unmade(**fields: Any) -> pb.MuxCall:
        raise ValueError("a field the message does not take")

    stream = Stream()
    client = MultiplexClient(Channel(stream), "peer")  # type: ignore[arg-type]
    monkeypatch.setattr(multiplex.pb, "MuxCall", unmade)
    try:
        with pytest.raises(ValueError, match="does not take"):
            await client.call(b"a", timeout_s=1.0)
        assert client.num_pending == 0
    finally:
        await client.close()


async def test_an_answer_that_comes_as_the_deadline_fires_is_kept() -> None:
    """The answer is read (its future set) in the very loop turn the call's deadline fires in:
    the timeout's cancel reached the caller's task before its wake-up, and an answer that had
    come was thrown away as DEADLINE_EXCEEDED, a timeout charged to a worker that answered
    (review finding). A deadline already passed (0 s) fires in the turn after the call is
    made; the answer set in that turn, before it, is the race."""
    stream = Stream()
    client = MultiplexClient(Channel(stream), "peer")  # type: ignore[arg-type]
    answer = pb.MuxResult(call_id=1, code=0, response=b"answered")

    def answered() -> None:
        (state,) = client._streams
        state.pending.pop(1).set_result(answer)

    call = asyncio.ensure_future(client.call(b"a", timeout_s=0.0))
    asyncio.get_running_loop().call_soon(answered)
    try:
        assert await call == b"answered"
    finally:
        stream.read_fails.set()
        await client.close()
