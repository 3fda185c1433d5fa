"""A worker front's InferStreams, relayed to its engine's link (services.gpu_worker.front):
one Unix-socket connection per stream, each message's bytes passed on as they came, and what
a front counts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common import metric_names as names
from services.common.frames import END, MESSAGE, FrameError, read_frame, write_frame
from services.common.lifecycle import MAX_MESSAGE_BYTES
from services.pb.inference.v1 import worker_pb2 as pb

log = logging.getLogger("services.gpu_worker.front")

#: How long the engine may go unanswering before its relayed streams are ended UNAVAILABLE
#: (within what a router's keepalive takes to fail a dead connection's calls over).
ENGINE_LOST_S = 10.0

#: Sent to a stream's router when its front stops: the router half-closes once answered.
CLOSING = pb.InferStreamResponse(closing=True).SerializeToString()


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
        self._open: set[asyncio.Queue[bytes | None]] = set()
        self._stopping = False
        self._is_engine_lost = False

    async def relay(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        if self._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker front is stopping")
        if self._is_engine_lost:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's engine does not answer")
        try:
            reader, writer = await asyncio.open_unix_connection(str(self._link_path))
        except OSError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's engine is not up")
        self._metrics.streams_total.inc()
        answers: asyncio.Queue[bytes | None] = asyncio.Queue()
        status: list[pb.MuxResult] = []
        loop = asyncio.get_running_loop()
        helpers = (
            loop.create_task(self._send(requests, writer)),
            loop.create_task(self._receive(reader, answers, status)),
        )
        self._open.add(answers)
        if self._stopping:  # stop() ran while this stream was connecting
            answers.put_nowait(CLOSING)
        if self._is_engine_lost:  # so did set_engine_lost, which ends the open streams
            answers.put_nowait(None)
        self._metrics.open_streams.inc()
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            self._open.discard(answers)
            self._metrics.open_streams.dec()
            for helper in helpers:
                helper.cancel()
            writer.close()
        if not status:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's engine went away")
        if status[0].code:
            await context.abort(
                _CODES.get(status[0].code, grpc.StatusCode.UNKNOWN),
                status[0].message,
                tuple(status[0].trailers.items()),
            )

    def stop(self) -> None:
        """Tells every open stream's router `closing`; new streams are refused."""
        self._stopping = True
        for answers in self._open:
            answers.put_nowait(CLOSING)

    def set_engine_lost(self, is_lost: bool) -> None:
        """While the engine is lost (ENGINE_LOST_S unanswered), every open stream ends
        UNAVAILABLE (its calls fail over) and new streams are refused."""
        if is_lost and not self._is_engine_lost:
            log.error(
                "the engine has not answered for %gs: ending its relayed streams", ENGINE_LOST_S
            )
            for answers in self._open:
                answers.put_nowait(None)
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
        answers: asyncio.Queue[bytes | None],
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
                answers.put_nowait(payload)
        except (FrameError, ConnectionError) as error:
            log.warning("the engine's link broke: %s", error)
        finally:
            answers.put_nowait(None)


#: grpc's status codes by number.
_CODES = {code.value[0]: code for code in grpc.StatusCode}
