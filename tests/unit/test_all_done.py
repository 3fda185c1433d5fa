"""`all_done` (services.gpu_worker.bundles): a bundle's wait for every one of its slices."""

from __future__ import annotations

import asyncio

import pytest

from services.gpu_worker.bundles import all_done

pytestmark = pytest.mark.unit


async def test_it_returns_once_every_future_is_done_whatever_its_outcome() -> None:
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(4)]
    futures[0].set_result(1)  # done before the wait starts
    waiting = asyncio.create_task(all_done(futures))
    await asyncio.sleep(0)
    futures[1].set_exception(ValueError("row failed"))
    futures[2].cancel()
    finished, _ = await asyncio.wait({waiting}, timeout=0.05)
    assert not finished, "one future is still pending"
    futures[3].set_result(3)
    await asyncio.wait_for(waiting, 1.0)
    assert futures[1].exception() is not None  # read, as the bundle's answer reads it


async def test_nothing_pending_returns_at_once() -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    done.set_result(None)
    await asyncio.wait_for(all_done([done]), 1.0)
    await asyncio.wait_for(all_done([]), 1.0)


async def test_cancelling_the_wait_cancels_none_of_the_futures() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []  # what a done callback that raised would report
    loop.set_exception_handler(lambda _, context: errors.append(context))
    futures = [loop.create_future() for _ in range(3)]
    waiting = asyncio.create_task(all_done(futures))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not any(future.done() for future in futures)
    for future in futures:  # answered later: their callbacks find the wait gone, quietly
        future.set_result(None)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert errors == []
