"""The engine's end of its fronts' InferStreams (`--front-processes`).

Each connection to the link's Unix socket is one InferStream a front received from a router,
its messages relayed as frames (services.common.frames). The engine serves it through the
same MultiplexServer as an InferStream on its own gRPC port, so every call keeps its deadline,
metadata, status, cancellation and span, and `close` (the worker's drain) tells these callers
`closing` as it tells the others. A front that goes away without ending the stream takes its
callers with it: the stream's calls are cancelled, and their queued rows withdrawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import InvalidInput
from services.common.frames import END, MESSAGE, FrameError, read_frame, write_frame
from services.common.grpc_errors import answerable, is_bug, status_of
from services.common.multiplex_server import MultiplexServer
from services.pb.inference.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)

#: How long `close` waits for the streams still open to end after the server told them
#: `closing` (MultiplexServer.close): their callers half-close within a round trip.
CLOSE_WAIT_S = 2.0


class EngineLink:
    """Serves InferStreams relayed by the worker's fronts on a Unix socket at `path`."""

    def __init__(self, streams: MultiplexServer, path: Path, max_message_bytes: int) -> None:
        self._streams = streams
        self.path = path
        self._max_bytes = max_message_bytes
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def close(self) -> None:
        """Stops taking connections; waits up to CLOSE_WAIT_S for the open streams to end (call
        after MultiplexServer.close), then cuts the rest."""
        if self._server is not None:
            self._server.close()
        if self._connections:
            await asyncio.wait(set(self._connections), timeout=CLOSE_WAIT_S)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._relay(reader, writer, task)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        task: asyncio.Task[None],
    ) -> None:
        front_gone = False
        watch: asyncio.Task[None] | None = None

        def gone() -> None:  # the front went without ending the stream: so did its callers
            nonlocal front_gone
            front_gone = True
            task.cancel()

        async def watch_after_end() -> None:
            """After END the front writes nothing until it has read ours: its connection
            ending first (or bytes coming) is the stream cut short. grpc.aio ends a handler's
            request iterator alike for a half-close and for the router's cancel or a dropped
            connection, so a front may relay a cancel as END, then close (review finding: the
            stream's queued rows stayed admitted until their deadlines)."""
            with contextlib.suppress(ConnectionError):
                await reader.read(1)
            gone()

        async def requests() -> AsyncIterator[pb.InferStreamRequest]:
            nonlocal watch
            while True:
                try:
                    frame = await read_frame(reader, self._max_bytes)
                except FrameError as error:
                    log.warning("a front's stream broke: %s", error)
                    frame = None
                except ConnectionError as error:  # a front ends a stream cut short so
                    log.debug("a front's stream was cut: %s", error)  # (its router's cancel)
                    frame = None
                if frame is None:  # gone without ending the stream: so are its callers
                    gone()
                    return
                kind, payload = frame
                if kind == END:  # the router half-closed (or, alike to grpc, went away)
                    watch = asyncio.create_task(watch_after_end(), name="front-after-end")
                    return
                try:
                    yield pb.InferStreamRequest.FromString(payload)
                except DecodeError:
                    raise InvalidInput("a stream message does not parse") from None

        status = pb.MuxResult(code=grpc.StatusCode.OK.value[0])
        try:
            # Closed however this ends, so that a stream cut short cancels its calls now.
            async with contextlib.aclosing(self._streams.serve(requests())) as responses:
                async for response in responses:
                    write_frame(writer, MESSAGE, response.SerializeToString())
                    await writer.drain()
        except asyncio.CancelledError:
            if front_gone:
                return
            raise
        except ConnectionError:
            return  # the front went away while answers were going out
        except Exception as raised:
            error = answerable(raised)
            if is_bug(error):
                log.error("unhandled error in a relayed stream", exc_info=raised)
            answer = status_of(error)
            status = pb.MuxResult(
                code=answer.code.value[0], message=answer.message, trailers=dict(answer.trailers)
            )
        finally:  # every call answered (or the relay cut): nothing left for the watch to cancel
            if watch is not None:
                watch.cancel()
        try:
            write_frame(writer, END, status.SerializeToString())
            await writer.drain()
        except ConnectionError:
            pass
