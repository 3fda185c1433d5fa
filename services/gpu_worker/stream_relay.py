"""A worker front's InferStreams, relayed to its engine's link (services.gpu_worker.front):
one Unix-socket connection per stream, each message's bytes passed on as they came, and what
a front counts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common import metric_names as names
from services.common.errors import NOT_STARTED_TRAILER
from services.common.frames import END, MESSAGE, FrameError, read_frame, write_frame
from services.common.lifecycle import MAX_MESSAGE_BYTES
from services.pb.inference.v1 import worker_pb2 as pb

log = logging.getLogger("services.gpu_worker.front")

#: How long the engine may go unanswering before its relayed streams are ended UNAVAILABLE
#: (within what a router's keepalive takes to fail a dead connection's calls over).
ENGINE_LOST_S = 10.0
#: What a call on a lost engine is told.
ENGINE_LOST_DETAILS = "the worker's engine does not answer"

#: Sent to a stream's router when its front stops: the router half-closes once answered.
CLOSING = pb.InferStreamResponse(closing=True).SerializeToString()

#: A stream's engine messages a front holds for a router that does not read them, and their
#: bytes: past either, the front reads no more of the link, whose socket fills, so that the
#: engine's writes wait and its own bound on a stream's unsent results applies
#: (MultiplexServer). A message past the bytes alone is still held, alone.
MAX_HELD_ANSWERS = 64
MAX_HELD_BYTES = 8 * 1024 * 1024

#: Refusals of a stream the front passes nothing of: its calls ran nowhere, and the router
#: sends them again without charging their rows (NOT_STARTED_TRAILER).
_NOT_STARTED = (NOT_STARTED_TRAILER,)


class _Answers:
    """One stream's answers on their way to its router: the engine's messages wait for room
    past MAX_HELD_ANSWERS or MAX_HELD_BYTES, the stream's signals (CLOSING, None: its end)
    never wait."""

    __slots__ = ("_held_bytes", "_queue", "_room", "is_engine_lost")

    def __init__(self) -> None:
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._room = asyncio.Event()
        self._room.set()
        self._held_bytes = 0
        #: Ended for the engine lost (StreamRelay.set_engine_lost), whatever came after.
        self.is_engine_lost = False

    def signal(self, signal: bytes | None) -> None:
        self._queue.put_nowait(signal)
        if signal is not None:  # counted as get() will count it out
            self._held_bytes += len(signal)

    async def put(self, message: bytes) -> None:
        self._queue.put_nowait(message)
        self._held_bytes += len(message)
        if not self._has_room():
            self._room.clear()
            await self._room.wait()

    async def get(self) -> bytes | None:
        answer = await self._queue.get()
        if answer is not None:
            self._held_bytes -= len(answer)
        if self._has_room():
            self._room.set()
        return answer

    def _has_room(self) -> bool:
        return self._queue.qsize() < MAX_HELD_ANSWERS and self._held_bytes < MAX_HELD_BYTES


class FrontMetrics:
    """What a front counts, beside its process's CPU and its event loop's lag."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.streams_total = Counter(
            names.WORKER_FRONT_STREAMS_TOTAL.removesuffix("_total"),
            "InferStreams this front relayed to the engine (each a router's stream)",
            registry=registry,
        )
        self.open_streams = Gauge(
            names.WORKER_FRONT_OPEN_STREAMS,
            "InferStreams this front is relaying now",
            registry=registry,
        )
        self.calls_total = Counter(
            names.WORKER_FRONT_CALLS_TOTAL.removesuffix("_total"),
            "Calls other than InferStream this front passed on to the engine",
            ("method",),
            registry=registry,
        )


class StreamRelay:
    """InferStreams relayed to the engine's link, one connection each."""

    def __init__(self, link_path: Path, metrics: FrontMetrics) -> None:
        self._link_path = link_path
        self._metrics = metrics
        #: Each open stream's queue of answers on their way to its router.
        self._open: set[_Answers] = set()
        self._stopping = False
        self._is_engine_lost = False

    async def relay(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        if refusal := self._refusal():
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal, _NOT_STARTED)
        try:
            reader, writer = await asyncio.open_unix_connection(str(self._link_path))
        except OSError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the worker's engine is not up", _NOT_STARTED
            )
        if refusal := self._refusal():  # stop() or set_engine_lost ran while it connected
            writer.transport.abort()  # nothing of the stream was sent
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal, _NOT_STARTED)
        self._metrics.streams_total.inc()
        answers = _Answers()
        status: list[pb.MuxResult] = []
        loop = asyncio.get_running_loop()
        helpers = (
            loop.create_task(self._send(requests, writer)),
            loop.create_task(self._receive(reader, answers, status)),
        )
        self._open.add(answers)
        self._metrics.open_streams.inc()
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            self._open.discard(answers)
            self._metrics.open_streams.dec()
            for helper in helpers:
                helper.cancel()
            writer.transport.abort()  # close() would hold what the engine did not read
        if not status or answers.is_engine_lost:
            # Not OK, even if the engine's END came after the loss was said: answers queued
            # behind the signal were not sent, and a stream ended OK would tell the router
            # its calls still waiting never ran (review finding).
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's engine went away")
        if status[0].code:
            # Never the not-started mark: the stream reached the engine, so its calls may have
            # run, and a router told otherwise would run them again elsewhere.
            trailers = tuple(t for t in status[0].trailers.items() if t != NOT_STARTED_TRAILER)
            await context.abort(
                _CODES.get(status[0].code, grpc.StatusCode.UNKNOWN), status[0].message, trailers
            )

    def _refusal(self) -> str:
        """Why a new stream is refused before anything of it reaches the engine ('': it is
        not)."""
        if self._stopping:
            return "this worker front is stopping"
        if self._is_engine_lost:
            return ENGINE_LOST_DETAILS
        return ""

    def stop(self) -> None:
        """Tells every open stream's router `closing`; new streams are refused."""
        self._stopping = True
        for answers in self._open:
            answers.signal(CLOSING)

    def set_engine_lost(self, is_lost: bool) -> None:
        """While the engine is lost (ENGINE_LOST_S unanswered), every open stream ends
        UNAVAILABLE (its calls fail over) and new streams are refused."""
        if is_lost and not self._is_engine_lost:
            log.error(
                "the engine has not answered for %gs: ending its relayed streams", ENGINE_LOST_S
            )
            for answers in self._open:
                answers.is_engine_lost = True
                answers.signal(None)
        elif self._is_engine_lost and not is_lost:
            log.info("the engine answers again")
        self._is_engine_lost = is_lost

    async def _send(self, requests: AsyncIterator[bytes], writer: asyncio.StreamWriter) -> None:
        try:
            async for message in requests:
                write_frame(writer, MESSAGE, message)
                await writer.drain()
            write_frame(writer, END)
            await writer.drain()
        except ConnectionError:
            pass  # the engine went away: _receive ends the stream

    async def _receive(
        self,
        reader: asyncio.StreamReader,
        answers: _Answers,
        status: list[pb.MuxResult],
    ) -> None:
        try:
            # At most MAX_MESSAGE_BYTES, the engine's bound on what it sends over gRPC:
            # --max-message-bytes bounds only what callers send.
            while (frame := await read_frame(reader, MAX_MESSAGE_BYTES)) is not None:
                kind, payload = frame
                if kind == END:
                    status.append(pb.MuxResult.FromString(payload))
                    break
                await answers.put(payload)
        except (FrameError, ConnectionError, DecodeError) as error:  # an END that does not
            log.warning("the engine's link broke: %s", error)  # parse: the stream ends alike
        finally:
            answers.signal(None)


#: grpc's status codes by number.
_CODES = {code.value[0]: code for code in grpc.StatusCode}
