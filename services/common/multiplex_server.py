"""The server side of InferStream (see services.common.multiplex): each call of a stream runs
as the unary method it stands for, with its own deadline, metadata, status and, where tracing
needs one (tracing.needs_span), server span.

`MultiplexServer.serve` is the stream method's handler; the unary handler it runs gets a
`CallContext` offering what handlers use of a `grpc.aio.ServicerContext` (`time_remaining`,
`invocation_metadata`). Errors become statuses through `status_of`, as on a unary call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common.bundles import SliceCancels
from services.common.errors import (
    NOT_STARTED_TRAILER,
    DeadlineExceeded,
    InvalidInput,
    MessageTooLarge,
    retry_after_trailer,
)
from services.common.grpc_errors import answerable, is_bug, status_of
from services.common.multiplex import MAX_CALL_BYTES, UNARY_METHOD
from services.common.multiplex_stream import MAX_CALLS_PER_MESSAGE, take_message
from services.common.tracing import (
    context_keys,
    current_while,
    end_server_span,
    needs_span,
    start_server_span,
)
from services.pb.inference.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)


class CallContext:
    """What a unary handler uses of its ServicerContext, for one multiplexed call."""

    def __init__(
        self,
        metadata: tuple[tuple[str, str], ...],
        deadline_s: float | None,
    ) -> None:
        self._metadata = metadata
        self._deadline_s = deadline_s
        #: For a bundle: the slices its callers stopped waiting for (see services.common.bundles).
        self.slice_cancels = SliceCancels()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        if self._deadline_s is None:
            return None
        return max(0.0, self._deadline_s - time.monotonic())


Handler = Callable[[Any, Any], Awaitable[Any]]

#: How long a closing server waits for a caller it told to half-close. A MultiplexClient
#: does within a round trip once nothing it sent waits; one older than `closing` ignores it.
CLOSING_WAIT_S = 1.0
#: Calls one stream runs at once; past it a new call is refused RESOURCE_EXHAUSTED, not run
#: (each holds a task and a context: a peer sending without bound would grow them so).
#: A router's calls to a worker are bundles, each refused or queued within milliseconds.
MAX_RUNNING_CALLS = 16_384
#: The retry hint of a call refused so, seconds (jittered).
RUNNING_FULL_RETRY_S = 0.1
#: Results waiting to go out past which a stream reads no more calls until some have gone (a
#: peer that sends without reading makes no unbounded pile of refusals).
MAX_OUTBOX_RESULTS = 4 * MAX_RUNNING_CALLS


class MultiplexServer:
    """The server side of InferStream for one unary handler.

    `serve` runs `handler(request, CallContext)` for every call of a stream concurrently,
    exactly as the unary method would run, and streams the results back, batching those that
    finish while a message is being written. `close` (server shutdown) tells every stream's
    caller (`closing`), answers the calls read from then on UNAVAILABLE marked not started,
    and ends each stream once every call received is answered and its caller has half-closed
    (MultiplexClient does as soon as nothing it sent waits here), so that no caller's write
    meets the stream's end; a caller that has not half-closed CLOSING_WAIT_S after being told
    (one that predates `closing`) has its stream ended then. A long-lived stream thus never
    holds a stopping server for its grace period.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        deserialize: Callable[[bytes], Any],
        serialize: Callable[[Any], bytes],
    ) -> None:
        self._handler = handler
        self._deserialize = deserialize
        self._serialize = serialize
        self._closing = asyncio.Event()

    def close(self) -> None:
        self._closing.set()

    async def serve(
        self, requests: AsyncIterator[pb.InferStreamRequest], context: object = None
    ) -> AsyncGenerator[pb.InferStreamResponse, None]:
        del context  # each call carries its own deadline and metadata
        responses = _ServedStream(requests, self._answer, self._closing).responses()
        try:
            async for message in responses:
                yield message
        finally:  # closed early (a front that went away): its calls are cancelled now
            await responses.aclose()

    async def _answer(
        self, request_bytes: bytes, context: CallContext, timeout_s: float | None
    ) -> bytes:
        """One call's response, or the domain error it is answered with."""
        try:
            request = self._deserialize(request_bytes)
        except DecodeError:
            raise InvalidInput("request does not parse") from None
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._handler(request, context)
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded") from None
        return self._serialize(response)


class _ServedStream:
    """One InferStream being served: the calls running and the results waiting to go out."""

    def __init__(
        self,
        requests: AsyncIterator[pb.InferStreamRequest],
        answer: Callable[[bytes, CallContext, float | None], Awaitable[bytes]],
        closing: asyncio.Event,
    ) -> None:
        self._requests = requests
        self._answer = answer
        self._closing = closing
        self._running: dict[int, asyncio.Task[None]] = {}
        #: The contexts of the calls running, for slices cancelled while they run.
        self._contexts: dict[int, CallContext] = {}
        self._outbox: list[pb.MuxResult] = []
        #: Set each time results went out: a reader waiting on a full outbox reads on.
        self._sent = asyncio.Event()
        self._context_keys = context_keys()
        self._wake = asyncio.Event()
        self._is_reading_done = False
        #: Why reading stopped early (a request that did not parse): the stream's status once
        #: every call already received is answered.
        self._read_error: InvalidInput | None = None
        #: Told `closing` CLOSING_WAIT_S ago: ends without the caller's half-close.
        self._is_done_waiting = False

    async def responses(self) -> AsyncGenerator[pb.InferStreamResponse, None]:
        """Results as they finish, until the caller half-closes (or, once the server closes,
        CLOSING_WAIT_S have passed) and every call received is answered."""
        loop = asyncio.get_running_loop()
        helpers = [loop.create_task(self._read()), loop.create_task(self._wake_on_close())]
        told_closing = False
        try:
            while True:
                await self._wake.wait()
                if self._running:  # results finished in this turn of the loop go together
                    await asyncio.sleep(0)
                self._wake.clear()
                if self._closing.is_set() and not told_closing and not self._is_reading_done:
                    told_closing = True
                    yield pb.InferStreamResponse(closing=True)
                    # Counted from the telling, not from close(): a stream slow to take the
                    # message (flow control) still gives its caller the whole wait.
                    helpers.append(loop.create_task(self._stop_waiting_later()))
                while self._outbox:
                    results = take_message(self._outbox, _response_bytes)
                    yield pb.InferStreamResponse(results=results)
                    self._sent.set()
                if (self._is_reading_done or self._is_done_waiting) and not self._running:
                    break
            if self._read_error is not None:
                raise self._read_error
        finally:
            running = list(self._running.values())
            for task in [*helpers, *running]:
                task.cancel()
            await asyncio.gather(*helpers, *running, return_exceptions=True)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for message in self._requests:
                for call_id in message.cancelled_call_ids:
                    task = self._running.pop(call_id, None)
                    if task is not None:
                        # Here, not in `_run`'s own `finally`, which a task cancelled before it
                        # first ran never reaches.
                        self._contexts.pop(call_id, None)
                        task.cancel()
                        self._wake.set()  # a cancelled call sends nothing: its last may end it
                if len(message.calls) > MAX_CALLS_PER_MESSAGE:  # no caller of ours sends more
                    raise InvalidInput(
                        f"a stream message of {len(message.calls)} calls (at most"
                        f" {MAX_CALLS_PER_MESSAGE})"
                    )
                for call in message.calls:
                    if self._closing.is_set():
                        self._send(_shutting_down(call.call_id))
                    elif call.call_id in self._running:  # a peer's bug: no answer could tell
                        raise InvalidInput(f"call id {call.call_id} is already running here")
                    elif len(self._running) >= MAX_RUNNING_CALLS:
                        self._send(_too_many_running(call.call_id))
                    else:
                        context = self._contexts[call.call_id] = _context_of(call)
                        self._running[call.call_id] = loop.create_task(self._run(call, context))
                # After the calls: a slice may be cancelled in the message that carries it.
                for ref in message.cancelled_slices:
                    if (running := self._contexts.get(ref.call_id)) is not None:
                        running.slice_cancels.cancel(ref.slice)
                while len(self._outbox) > MAX_OUTBOX_RESULTS:  # a peer that does not read:
                    self._sent.clear()  # read nothing more of it (refusals pile up otherwise)
                    await self._sent.wait()
        except InvalidInput as error:
            self._read_error = error
        except Exception:  # our bug (a slice's cancel listener, say): logged, not unseen. The
            # stream still ends OK once its calls are answered: its peer sends the calls this
            # reader never read elsewhere, as never started, which they were.
            log.exception("stream reader failed; its calls not read go elsewhere")
        finally:
            self._is_reading_done = True
            self._wake.set()

    async def _wake_on_close(self) -> None:
        await self._closing.wait()
        self._wake.set()

    async def _stop_waiting_later(self) -> None:
        await asyncio.sleep(CLOSING_WAIT_S)
        self._is_done_waiting = True
        self._wake.set()

    async def _run(self, call: pb.MuxCall, context: CallContext) -> None:
        timeout_s = context.time_remaining()
        result = pb.MuxResult(call_id=call.call_id)
        metadata = context.invocation_metadata()
        span = None
        # None while tracing is off and the caller sent no trace context (tracing.needs_span):
        # nothing is current then, as the stream's own method is never traced.
        if needs_span(metadata, self._context_keys):
            span = start_server_span(UNARY_METHOD, metadata)
        code, failure = grpc.StatusCode.OK, None
        try:
            with current_while(span):
                response = await self._answer(call.request, context, timeout_s)
                if len(response) > MAX_CALL_BYTES:  # alone in a message, it would end the stream
                    raise MessageTooLarge(
                        f"an answer of {len(response)} bytes is past the message limit"
                    )
                result.response = response
        except BaseException as raised:
            error = answerable(raised)
            if is_bug(error):  # our bug: log it, answer INTERNAL, keep serving
                log.error("unhandled error in a multiplexed call", exc_info=raised)
            status = status_of(error)
            code, result.message, failure = status.code, status.message, raised
            result.trailers.update(status.trailers)
            if not isinstance(error, Exception):
                # Cancelled: the caller cancelled the call, or the stream went away. Nobody
                # waits for an answer; its span, if any, still ends CANCELLED.
                raise
        finally:
            # Only this call's own: a call cancelled while it ran may have its id in use again
            # by a new call, read before this task ended.
            if self._running.get(call.call_id) is asyncio.current_task():
                del self._running[call.call_id]
            if self._contexts.get(call.call_id) is context:
                del self._contexts[call.call_id]
            if span is not None:
                end_server_span(span, code, result.message, failure)
        result.code = code.value[0]
        self._send(result)

    def _send(self, result: pb.MuxResult) -> None:
        self._outbox.append(result)
        self._wake.set()


def _context_of(call: pb.MuxCall) -> CallContext:
    timeout_s = call.timeout_us / 1e6 if call.timeout_us else None
    deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
    return CallContext(tuple(call.metadata.items()), deadline_s)


def _too_many_running(call_id: int) -> pb.MuxResult:
    # Never run here: a stream's calls each hold a task and a context while they run. With a
    # retry hint, as every refusal for load has: without one no caller retried it, and the
    # not-started mark of a RESOURCE_EXHAUSTED sends it nowhere else (review finding).
    return pb.MuxResult(
        call_id=call_id,
        code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        message=f"{MAX_RUNNING_CALLS} calls already running on this stream",
        trailers=dict((NOT_STARTED_TRAILER, retry_after_trailer(RUNNING_FULL_RETRY_S))),
    )


def _shutting_down(call_id: int) -> pb.MuxResult:
    # Never run here: marked so that the caller may send it to another server.
    return pb.MuxResult(
        call_id=call_id,
        code=grpc.StatusCode.UNAVAILABLE.value[0],
        message="server is shutting down",
        trailers=dict((NOT_STARTED_TRAILER,)),
    )


def _response_bytes(result: pb.MuxResult) -> int:
    return len(result.response)
