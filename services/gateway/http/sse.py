"""Server-sent events, as Triton's generate_stream and the OpenAI API send them: framing, and
writes that give up on a client that stopped reading."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Sequence
from typing import Any, NoReturn

import grpc
from aiohttp import web

from services.common.errors import ServingError
from services.gateway.http.errors import AnsweredInBand

#: The OpenAI stream's last event.
DONE_EVENT = b"data: [DONE]\n\n"
#: Content type of an event stream.
SSE_CONTENT_TYPE = "text/event-stream"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One `data:` event holding `payload` as compact JSON (JSON never holds a raw newline, so
    one data line always suffices)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


#: Longest one write of an event stream may wait for its client to read (the connection's
#: buffers full): past it the client has stopped reading, and its connection is dropped. A
#: stream whose writes wait forever would hold what it holds for good: a place in the process's
#: door, its tenant's concurrency, the generation's sequence.
WRITE_TIMEOUT_S = 30.0


class StalledReader(ServingError):
    """The client of an event stream read none of it for `WRITE_TIMEOUT_S`; its connection
    was dropped."""

    code = grpc.StatusCode.CANCELLED


class EventWriter:
    """Writes one event stream (whose headers are sent), each write within `timeout_s`."""

    def __init__(
        self, request: web.Request, answer: web.StreamResponse, timeout_s: float = WRITE_TIMEOUT_S
    ) -> None:
        self._request = request
        self.answer = answer
        self._timeout_s = timeout_s

    async def send(self, data: bytes) -> None:
        """Writes `data`; raises StalledReader, the connection dropped, past the timeout."""
        await self._within_timeout(self.answer.write(data))

    async def end(self) -> None:
        """Ends the stream; raises StalledReader as `send`."""
        await self._within_timeout(self.answer.write_eof())

    async def end_in_band(self, events: Sequence[bytes], error: Exception) -> NoReturn:
        """Sends `events` (the failure, in band) and ends the stream, then raises
        AnsweredInBand for `error`; a client that stopped reading gets neither."""
        if not isinstance(error, StalledReader):
            with contextlib.suppress(StalledReader):
                for event in events:
                    await self.send(event)
                await self.end()
        raise AnsweredInBand(self.answer, error) from error

    async def _within_timeout(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await write
        except TimeoutError:
            if (transport := self._request.transport) is not None:
                transport.abort()
            raise StalledReader(
                f"the client read none of the stream for {self._timeout_s:g}s"
            ) from None
