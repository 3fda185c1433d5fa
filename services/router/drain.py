"""A draining router refuses new calls as never started, so that gateways resend them.

On SIGTERM the router finishes the calls it is running (within its drain grace) and answers
every later one UNAVAILABLE with the NOT_STARTED_TRAILER mark: nothing ran here, so the gateway
may send the call to another router without running it twice. Multiplexed calls are refused,
with the same mark, by the closing MultiplexServer itself; this gate covers the unary methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from services.common.errors import Unavailable

UnaryHandler = Callable[[Any, Any], Awaitable[Any]]
StreamHandler = Callable[[Any, Any], AsyncGenerator[Any, None]]


class DrainGate:
    def __init__(self) -> None:
        self.is_draining = False

    def start(self) -> None:
        """From now on every new call is refused."""
        self.is_draining = True

    def check(self) -> None:
        if self.is_draining:
            raise Unavailable("router is draining; retry on another router", is_not_started=True)

    def guard_unary(self, handler: UnaryHandler) -> UnaryHandler:
        async def guarded(request: Any, context: Any) -> Any:
            self.check()
            return await handler(request, context)

        return guarded

    def guard_stream(self, handler: StreamHandler) -> StreamHandler:
        async def guarded(request: Any, context: Any) -> AsyncGenerator[Any, None]:
            self.check()
            # Closed with this stream (its caller gone): the worker's call is cancelled now.
            async with contextlib.aclosing(handler(request, context)) as messages:
                async for message in messages:
                    yield message

        return guarded
