"""A wake-up flag for one waiting loop, waited on with a timeout: what `asyncio.Event` and
`asyncio.wait_for(event.wait(), timeout)` do, for a fraction of their cost (the batching
driver's loop and the registry heartbeat sleep on one).

A loop that sleeps until something happens or a time comes (the worker's batching driver, once
or twice a batch) would otherwise create a task for `Event.wait()` and a timer on every pass
(`wait_for`, 16 us here under uvloop); this waits on one future and one timer handle
(about 6 us). Like `asyncio.Event`, it is set from the event loop's thread only."""

from __future__ import annotations

import asyncio


class Wakeup:
    """`set` wakes the waiter (now, or the next time it waits, until `clear`)."""

    __slots__ = ("_is_set", "_waiter")

    def __init__(self) -> None:
        self._is_set = False
        self._waiter: asyncio.Future[None] | None = None

    def is_set(self) -> bool:
        return self._is_set

    def set(self) -> None:
        self._is_set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._is_set = False

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Returns once set (True), or once `timeout_s` passed unset (False; None: no
        timeout). A wait of 0 or less still yields to the loop once, as `wait_for` does: a
        loop whose due time has passed never starves the others. One waiter at a time."""
        if self._is_set:
            return True
        if timeout_s is not None and timeout_s <= 0.0:
            await asyncio.sleep(0)
            return self._is_set
        if self._waiter is not None:
            raise RuntimeError("a Wakeup has one waiter at a time")
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, settle, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        return self._is_set


def settle(waiter: asyncio.Future[None]) -> None:
    """Resolves `waiter` (None) unless it is done already: a timer's or a callback's wake-up
    that may come after another."""
    if not waiter.done():
        waiter.set_result(None)
