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
#: stream whose writes waited forever would hold its tenant's concurrency, its connection and
#: the generation upstream for good.
WRITE_TIMEOUT_S = 30.0


class ReaderGone(ServingError):
    """The client of an event stream went away, or stopped reading it (a write waited
    `WRITE_TIMEOUT_S` for the connection's buffers to drain, and the connection was dropped)."""

    code = grpc.StatusCode.CANCELLED


class EventWriter:
    """Writes one event stream (whose headers are sent), each write within `timeout_s`
    (None: WRITE_TIMEOUT_S)."""

    def __init__(
        self, request: web.Request, answer: web.StreamResponse, timeout_s: float | None = None
    ) -> None:
        self._request = request
        self.answer = answer
        self._timeout_s = WRITE_TIMEOUT_S if timeout_s is None else timeout_s
        self._is_ending = False

    async def send(self, data: bytes) -> None:
        """Writes `data`; raises ReaderGone when the client went away or stopped reading."""
        await self._write(self.answer.write(data))

    async def end(self) -> None:
        """Ends the stream; raises ReaderGone as `send`."""
        self._is_ending = True
        await self._write(self.answer.write_eof())

    async def end_in_band(self, events: Sequence[bytes], error: Exception) -> NoReturn:
        """Sends `events` (the failure, in band) and ends the stream, then raises
        AnsweredInBand for `error`; nothing more is written once the stream's end was sent or
        its client is gone."""
        if not (self._is_ending or isinstance(error, ReaderGone)):
            with contextlib.suppress(ReaderGone):
                for event in events:
                    await self.send(event)
                await self.end()
        raise AnsweredInBand(self.answer, error) from error

    async def _write(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await write
        except TimeoutError:
            if (transport := self._request.transport) is not None:
                transport.abort()
            raise ReaderGone(
                f"the client stopped reading the stream (a write waited {self._timeout_s:g}s)"
            ) from None
        except ConnectionError as error:  # aiohttp's ClientConnectionResetError among them
            raise ReaderGone(f"the client went away: {error}") from None
