"""Many unary calls over one long-lived stream: how the tiers amortize their hops.

A grpc.aio unary call costs each side a fixed slice of CPU however small its payload (about
3k calls/s per process on a small machine), and every request crosses two internal hops
(gateway -> router -> worker). Here each caller keeps one bidirectional `InferStream` per
peer; calls made while the previous message is being written travel together in the next
one, and so do their results on the way back. Under light load a message carries one call
and adds nothing; under heavy load one message carries many, and the per-call cost falls.

Every call keeps the semantics of the unary method it stands for: its own deadline (sent as
the time left), its own metadata (routing facts, W3C trace context), its own status, message
and trailers (the retry hint), and cancellation (a caller that stops waiting tells the
server, which withdraws the call's queued work). If the stream breaks, every call in flight
on it fails UNAVAILABLE (the peer is gone: safe to retry elsewhere) and the next call opens
a new stream.

`MultiplexClient.call` is the client (here, with what both sides share);
`services.common.multiplex_server.MultiplexServer` turns a unary handler into the stream's
server side.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

import grpc

from services.common.bundles import SliceCancels
from services.common.errors import NOT_STARTED_TRAILER, TOO_LARGE, UpstreamError
from services.common.lifecycle import MAX_MESSAGE_BYTES
from services.common.multiplex_stream import (
    MuxStream,
    take_message,
    timeout_us_of,
)
from services.common.write_linger import DEFAULT_LINGER, LingerConfig, WriteLinger
from services.pb.inference.v1 import worker_pb2 as pb

STREAM_METHOD = "/inference.v1.WorkerService/InferStream"
#: The unary method each multiplexed call stands for (its server span is named after it).
UNARY_METHOD = "/inference.v1.WorkerService/Infer"
#: A stream takes new calls for this long, then the next call opens a new one and the old
#: stream closes once its calls are answered. Servers end connections after a maximum age
#: (services.common.lifecycle.new_server: GOAWAY at 300 s, streams cut 600 s later) so that
#: clients spread over new replicas; a stream retired well within that grace never has a
#: call cut, and its successor lands on the new connection.
STREAM_MAX_AGE_S = 20.0
#: Largest request (or response) of one call: the message limit, less room for the call's
#: envelope (its id, metadata, deadline or status). A call past it fails alone.
MAX_CALL_BYTES = MAX_MESSAGE_BYTES - 64 * 1024


class MultiplexClient:
    """The calling side: `await call(request_bytes, metadata, timeout_s)` -> response bytes,
    or UpstreamError carrying the call's status, message and retry hint."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        name: str,
        *,
        max_age_s: float = STREAM_MAX_AGE_S,
        linger: LingerConfig = DEFAULT_LINGER,
        streams: int = 1,
    ) -> None:
        """`linger`: how a message is held back to gather calls under load (write_linger).
        `streams`: how many streams take calls at once, in turn. On a channel that balances
        over several servers (round_robin), each stream goes to the next one, so calls
        spread over them all instead of one for a stream's whole life."""
        if streams < 1:
            raise ValueError("streams must be at least 1")
        self._open_stream: grpc.aio.StreamStreamMultiCallable[
            pb.InferStreamRequest, pb.InferStreamResponse
        ] = channel.stream_stream(
            STREAM_METHOD,
            request_serializer=pb.InferStreamRequest.SerializeToString,
            response_deserializer=pb.InferStreamResponse.FromString,
        )
        self._name = name
        self._max_age_s = max_age_s
        self._ids = itertools.count(1)
        #: The streams taking new calls, one per slot (None: the next call opens one).
        self._slots: list[MuxStream | None] = [None] * streams
        self._turns = itertools.count()
        #: Every stream not yet finished: the current one and those retiring.
        self._streams: list[MuxStream] = []
        #: Stream messages written, for tests and metrics: calls / messages is the fan-in.
        self.messages_sent = 0
        self.calls_sent = 0
        self._linger = WriteLinger(linger)

    async def call(
        self,
        request: bytes,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        timeout_s: float | None = None,
        slice_cancels: SliceCancels | None = None,
    ) -> bytes:
        """`slice_cancels`: for a bundle, the slices its callers stop waiting for, which this
        call tells the peer of as they come."""
        if len(request) > MAX_CALL_BYTES:  # as a unary call's send fails
            raise UpstreamError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{TOO_LARGE}: {self._name}: a call of {len(request)} bytes is past the message "
                f"limit of {MAX_MESSAGE_BYTES} bytes",
            )
        stream = self._current_stream()
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        now_s = time.monotonic()
        self._linger.arrived(now_s)
        # Made before the call is registered: a call that cannot be made waits on nothing.
        mux_call = pb.MuxCall(
            call_id=call_id,
            request=request,
            metadata=dict(metadata),
            timeout_us=timeout_us_of(timeout_s),
        )
        future: asyncio.Future[pb.MuxResult] = loop.create_future()
        stream.pending[call_id] = future
        stream.outbox.append(mux_call)
        stream.unsent.add(call_id)
        if timeout_s is not None:
            stream.deadlines[call_id] = now_s + timeout_s
        stream.wake.set()
        stop_listening = (
            None
            if slice_cancels is None
            else slice_cancels.listen(lambda index: self._cancel_slice(stream, call_id, index))
        )
        try:
            async with asyncio.timeout(timeout_s):
                result = await future
        except TimeoutError:
            # Not cancelled with the task, but answered in the deadline's own loop turn: kept.
            if future.cancelled() or not future.done():
                self._cancel(stream, call_id)
                raise UpstreamError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"{self._name}: deadline exceeded"
                ) from None
            result = future.result()
        except asyncio.CancelledError:
            self._cancel(stream, call_id)
            raise
        finally:
            if stop_listening is not None:
                stop_listening()
        if result.code == 0:
            return result.response
        error = UpstreamError.from_status(result.code, result.message, result.trailers)
        if error.is_not_started:
            self._retire(stream)  # the peer is closing it: the next call opens a new one
        raise error

    @property
    def num_pending(self) -> int:
        """Calls sent and not yet answered, on every stream."""
        return sum(len(stream.pending) for stream in self._streams)

    async def close(self) -> None:
        streams, self._streams = self._streams, []
        self._slots = [None] * len(self._slots)
        for stream in streams:
            stream.fail_all("client closed")
            stream.call.cancel()
            for task in stream.tasks:
                task.cancel()
        await asyncio.gather(*(t for s in streams for t in s.tasks), return_exceptions=True)

    def _cancel(self, stream: MuxStream, call_id: int) -> None:
        if stream.pending.pop(call_id, None) is None or stream.broken is not None:
            return
        stream.deadlines.pop(call_id, None)
        if call_id in stream.unsent:  # never left: the peer need not hear of it
            stream.unsent.discard(call_id)
            if 2 * len(stream.unsent) < len(stream.outbox):  # behind a stalled write: freed
                stream.outbox[:] = [c for c in stream.outbox if c.call_id in stream.unsent]
            return
        stream.cancelled.append(call_id)
        stream.wake.set()

    def _cancel_slice(self, stream: MuxStream, call_id: int, index: int) -> None:
        if call_id in stream.pending and stream.broken is None:
            stream.cancelled_slices.append(pb.SliceRef(call_id=call_id, slice=index))
            stream.wake.set()

    def _retire(self, stream: MuxStream) -> None:
        self._slots = [None if s is stream else s for s in self._slots]
        stream.is_retiring = True
        stream.wake.set()

    def _current_stream(self) -> MuxStream:
        loop = asyncio.get_running_loop()
        slot = next(self._turns) % len(self._slots)
        stream = self._slots[slot]
        if stream is not None and stream.broken is None:
            if time.monotonic() - stream.opened_s < self._max_age_s:
                return stream
            stream.is_retiring = True
            stream.wake.set()
        stream = self._slots[slot] = MuxStream(self._open_stream(), self._name, time.monotonic())
        self._streams = [s for s in self._streams if not all(t.done() for t in s.tasks)]
        self._streams.append(stream)
        stream.tasks = [
            loop.create_task(self._write(stream), name=f"mux-write-{self._name}"),
            loop.create_task(self._read(stream), name=f"mux-read-{self._name}"),
        ]
        return stream

    async def _write(self, stream: MuxStream) -> None:
        try:
            while stream.broken is None:
                await stream.wake.wait()
                # Let every task that is ready now run first: the calls they make in this turn
                # of the event loop leave in one message. Under load, also those of the next
                # millisecond (write_linger); at light load no timer, so no added latency.
                # With one call in flight (callers taking turns) there is nobody to wait for,
                # and a turn of the loop costs a wake-up of its own: it leaves at once.
                if len(stream.pending) > 1:
                    await asyncio.sleep(0)
                delay_s = self._linger.delay_s(len(stream.outbox), len(stream.pending))
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                stream.wake.clear()
                while stream.outbox or stream.cancelled or stream.cancelled_slices:
                    calls = take_message(stream.outbox, _request_bytes)
                    # Calls cancelled before they left need not leave at all.
                    calls = [c for c in calls if c.call_id in stream.unsent]
                    now_s = time.monotonic()
                    for c in calls:  # its time left as it leaves
                        stream.unsent.discard(c.call_id)
                        if (deadline_s := stream.deadlines.pop(c.call_id, None)) is not None:
                            c.timeout_us = timeout_us_of(deadline_s - now_s)
                    cancelled, stream.cancelled = stream.cancelled, []
                    # A slice's cancel waits for its call to leave (the peer drops the cancels
                    # of calls it has not read).
                    slices, stream.cancelled_slices = stream.cancelled_slices, []
                    if slices and (unsent := stream.unsent):
                        stream.cancelled_slices = [r for r in slices if r.call_id in unsent]
                        slices = [r for r in slices if r.call_id not in unsent]
                    if not calls and not cancelled and not slices:
                        continue
                    message = pb.InferStreamRequest(
                        calls=calls, cancelled_call_ids=cancelled, cancelled_slices=slices
                    )
                    try:
                        await stream.call.write(message)
                    except Exception:  # refused (finished, or grpc's send op failed): the
                        stream.outbox[:0] = calls  # peer has none of it, as of those queued
                        stream.unsent.update(c.call_id for c in calls)
                        raise
                    self.messages_sent += 1
                    self.calls_sent += len(calls)
                if stream.is_retiring and not stream.pending:
                    await stream.call.done_writing()  # the server ends the stream in turn
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the stream broke under us, or ended (see _read)
            self._retire(stream)  # no new call waits on it for its status (up to a second)
            is_not_started = _never_sent(error) or await _ran_nothing_or_ended_cleanly(stream.call)
            stream.fail_all(
                f"stream write failed: {_describe(error)}", is_not_started=is_not_started
            )
            stream.call.cancel()

    async def _read(self, stream: MuxStream) -> None:
        # A stream that ends cleanly has answered every call the peer read (MultiplexServer's
        # contract), so the calls still waiting were never read there; nor were those of a
        # stream that never found a connection.
        reason, is_not_started = "stream ended", True
        try:
            while True:
                message = await stream.call.read()
                if not isinstance(message, pb.InferStreamResponse):  # grpc.aio.EOF
                    break
                for result in message.results:
                    future = stream.pending.pop(result.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(result)
                if message.closing:
                    self._retire(stream)  # the peer refuses what it reads from now on
                if stream.is_retiring and not stream.pending:
                    stream.wake.set()  # the writer half-closes it
        except asyncio.CancelledError:  # closed, or the channel closed under us
            stream.fail_all("stream cancelled")
            raise
        except Exception as error:
            reason, is_not_started = f"stream failed: {_describe(error)}", _never_sent(error)
        stream.fail_all(reason, is_not_started=is_not_started)
        stream.call.cancel()  # no-op once finished; frees a stream that only half-failed


def _request_bytes(call: pb.MuxCall) -> int:
    return len(call.request)


#: How grpc fails a call that found no connection to send it on (pick_first, round_robin).
_NO_CONNECTION = ("failed to connect to all addresses", "connections to all backends failing")


#: How long a failed write waits for the stream's status (see _ran_nothing_or_ended_cleanly).
_STATUS_WAIT_S = 1.0


def found_no_connection(error: grpc.aio.AioRpcError) -> bool:
    """True when the call failed before reaching any peer (grpc found no connection to send
    it on): nothing of it ran anywhere."""
    return error.code() == grpc.StatusCode.UNAVAILABLE and (error.details() or "").startswith(
        _NO_CONNECTION
    )


def _never_sent(error: BaseException) -> bool:
    """True when the stream failed before reaching any peer, or its peer refused it whole as
    not started (a worker front that passed nothing of it on): nothing on it ran anywhere."""
    if not isinstance(error, grpc.aio.AioRpcError) or error.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    if found_no_connection(error):
        return True
    return NOT_STARTED_TRAILER in tuple(error.trailing_metadata() or ())


async def _ran_nothing_or_ended_cleanly(
    call: grpc.aio.StreamStreamCall[pb.InferStreamRequest, pb.InferStreamResponse],
) -> bool:
    """Whether the peer ended the stream OK (so it answered every call it read), or refused it
    whole as not started (so it ran none). A write fails when the peer has just ended the
    stream, a moment before its status reaches us, and grpc then raises a bare
    InvalidStateError that carries no status: wait for the status briefly rather than take a
    stream still closing for a broken one."""
    try:
        code = await asyncio.wait_for(call.code(), timeout=_STATUS_WAIT_S)
    except TimeoutError:
        return False
    if code == grpc.StatusCode.OK:
        return True
    return code == grpc.StatusCode.UNAVAILABLE and NOT_STARTED_TRAILER in tuple(
        await call.trailing_metadata() or ()
    )


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name} {error.details()}"
    return repr(error)
