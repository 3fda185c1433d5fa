"""A loop told to stop stops, even when a library turned its cancellation into an error."""

from __future__ import annotations

import asyncio

import pytest

from services.common.lifecycle import stop_if_cancelled

pytestmark = pytest.mark.unit


async def test_a_loop_whose_cancellation_a_library_swallowed_still_stops() -> None:
    rounds = 0

    async def library_call() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:  # what a racing timeout does on Python 3.11
            raise TimeoutError("timed out") from None

    async def loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            try:
                await library_call()
            except TimeoutError:
                stop_if_cancelled()
            await asyncio.sleep(0.001)

    task = asyncio.get_running_loop().create_task(loop())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert rounds == 1  # stopped where the error was caught, not on a later round


async def test_an_error_in_a_task_not_cancelled_is_left_to_the_loop() -> None:
    stop_if_cancelled()  # nothing asked this task to stop: returns
