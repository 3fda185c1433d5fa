"""The batching driver's wake-up flag (services.common.wakeup): set, cleared, waited on with a
timeout, as asyncio.Event with wait_for; on asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from services.common.wakeup import Wakeup

pytestmark = pytest.mark.unit

#: Long enough never to pass in a test that expects the flag to end the wait.
NEVER_S = 60.0

LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    return LOOPS[request.param]


def test_a_flag_set_before_the_wait_returns_at_once(run: Callable[..., None]) -> None:
    async def main() -> None:
        wakeup = Wakeup()
        wakeup.set()
        assert await wakeup.wait(NEVER_S) is True
        assert await wakeup.wait(None) is True  # stays set until cleared
        wakeup.clear()
        assert not wakeup.is_set()
        assert await wakeup.wait(0.01) is False

    run(main())


def test_a_set_wakes_the_waiter_and_cancels_its_timer(run: Callable[..., None]) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        wakeup = Wakeup()
        loop.call_later(0.01, wakeup.set)
        assert await asyncio.wait_for(wakeup.wait(NEVER_S), 5.0) is True
        # Without a timeout too.
        wakeup.clear()
        loop.call_later(0.01, wakeup.set)
        assert await asyncio.wait_for(wakeup.wait(None), 5.0) is True

    run(main())


def test_the_timeout_ends_an_unset_wait(run: Callable[..., None]) -> None:
    async def main() -> None:
        wakeup = Wakeup()
        assert await asyncio.wait_for(wakeup.wait(0.02), 5.0) is False
        # The next wait is a fresh one: a set now wakes it.
        asyncio.get_running_loop().call_later(0.01, wakeup.set)
        assert await asyncio.wait_for(wakeup.wait(NEVER_S), 5.0) is True

    run(main())


def test_a_wait_of_no_time_yields_to_the_loop(run: Callable[..., None]) -> None:
    """A loop whose due time has passed waits 0: the others must still get their turn, or a
    pass that keeps finding a past due time would hold the event loop for good."""

    async def main() -> None:
        wakeup = Wakeup()
        ran: list[str] = []
        asyncio.get_running_loop().call_soon(ran.append, "other")
        assert await wakeup.wait(0.0) is False
        assert ran == ["other"]
        assert await wakeup.wait(-1.0) is False

    run(main())


def test_one_waiter_at_a_time_and_a_cancelled_wait_leaves_none(run: Callable[..., None]) -> None:
    async def main() -> None:
        wakeup = Wakeup()
        first = asyncio.ensure_future(wakeup.wait(NEVER_S))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one waiter"):
            await wakeup.wait(NEVER_S)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        # The cancelled waiter is gone: a new wait is woken by the next set.
        asyncio.get_running_loop().call_later(0.01, wakeup.set)
        assert await asyncio.wait_for(wakeup.wait(NEVER_S), 5.0) is True

    run(main())
