"""The status a server ended a stream with, which a grpc.aio client does not always report.

A client's write already on its way when the server ends a stream (a gateway refusing an
unauthenticated ModelStreamInfer from its metadata) fails in grpc's core, and grpc.aio then
sets the call's status to a local INTERNAL ("Internal error from Core"), whatever the server
said: if the server's status arrived first, it is replaced and lost; if it arrives after, it
usually replaces the local one (under heavy load, seen not to within 8 s in a few cases of
hundreds). `PeerStatus` keeps the first status the call gets (a done callback sees it before
anything replaces it) and, when that is the local one, waits briefly for the server's. The
fabric's own streams never meet this: a closing MultiplexServer ends a stream only after its
caller half-closes (services.common.multiplex_server).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

#: The details of the status grpc.aio sets when a write fails in its core.
LOCAL_WRITE_FAILURE = "Internal error from Core"
#: How often a local status is looked at again while waiting for the peer's.
_POLL_S = 0.005

_T = TypeVar("_T")


class PeerStatus:
    """Watches one call from its start: `await code(timeout_s)` is the peer's status code."""

    def __init__(self, call: grpc.aio.Call) -> None:
        self._call = call
        self._first: tuple[grpc.StatusCode, str] | None = None
        self._ended = asyncio.Event()
        call.add_done_callback(self._on_end)

    def _on_end(self, call: grpc.aio.Call) -> None:
        if self._first is None:
            self._first = _status_now(call)
            self._ended.set()

    async def code(self, timeout_s: float) -> grpc.StatusCode | None:
        """The code the peer ended the call with, or None if it did not arrive within
        `timeout_s` (the call has not ended, or grpc replaced the peer's status for good)."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ended.wait(), timeout=timeout_s)
        status = self._first
        while status is not None and _is_local(status):
            left_s = deadline_s - loop.time()
            if left_s <= 0:
                return None
            await asyncio.sleep(min(_POLL_S, left_s))
            status = _status_now(self._call)
        return None if status is None else status[0]

    async def code_of(self, error: grpc.aio.AioRpcError, timeout_s: float = 5.0) -> grpc.StatusCode:
        """The code the peer ended the call with, for the `error` the call raised: grpc's
        own if the peer's did not arrive within `timeout_s`."""
        return await self.code(timeout_s) or error.code()


def _is_local(status: tuple[grpc.StatusCode, str]) -> bool:
    return status == (grpc.StatusCode.INTERNAL, LOCAL_WRITE_FAILURE)


def _status_now(call: grpc.aio.Call) -> tuple[grpc.StatusCode, str] | None:
    """The status of a call that has ended, read without waiting (grpc.aio offers it only as
    coroutines, which complete at once when the call has its status)."""
    code, details = _at_once(call.code()), _at_once(call.details())
    return None if code is None else (code, details or "")


def _at_once(coroutine: Coroutine[Any, Any, _T]) -> _T | None:
    """The coroutine's result if it completes without suspending; else None (and closed)."""
    try:
        coroutine.send(None)
    except StopIteration as finished:
        result: _T = finished.value
        return result
    coroutine.close()
    return None
