"""A loop told to stop stops, even when a library swallowed its cancellation or turned it into
an error."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import cast

import pytest
import redis.asyncio as aioredis

from services.common.lifecycle import sleep_unless_stopped, stop_if_cancelled
from services.gpu_worker.hot_swap import ModelSwapper
from services.gpu_worker.loaded_models import LoadedModels
from services.gpu_worker.repository_follower import RepositoryFollower

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


async def _written_as_the_stop_arrives() -> str:
    """What redis-py's write of a command does on Python 3.11 when a stop arrives just as the
    write completes (it writes through `asyncio.wait_for` when a socket timeout is set): the
    stdlib's wait_for returns the result, and the task's cancellation is lost."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    written: asyncio.Future[str] = loop.create_future()
    loop.call_soon(written.set_result, "written")
    loop.call_soon(task.cancel)
    return await asyncio.wait_for(written, timeout=5)


#: Whether this Python's wait_for loses a cancel that races its result (it did before 3.12).
WAIT_FOR_SWALLOWS = sys.version_info < (3, 12)


async def test_a_round_that_swallowed_the_stop_ends_the_loop_before_it_sleeps() -> None:
    rounds_completed = 0

    async def loop() -> None:
        nonlocal rounds_completed
        while True:
            await _written_as_the_stop_arrives()
            rounds_completed += 1
            await sleep_unless_stopped(60)

    task = asyncio.get_running_loop().create_task(loop())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert rounds_completed == (1 if WAIT_FOR_SWALLOWS else 0)


async def test_sleep_unless_stopped_sleeps_in_a_task_not_cancelled() -> None:
    started_s = time.monotonic()
    await sleep_unless_stopped(0.01)
    assert time.monotonic() - started_s >= 0.01


class _RedisSwallowingTheFirstStop:
    """The follower's Redis client: its first read completes as the stop arrives."""

    def __init__(self) -> None:
        self.num_reads = 0

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        self.num_reads += 1
        if self.num_reads == 1:
            await _written_as_the_stop_arrives()
        return {}


async def test_the_repository_follower_stops_when_a_read_swallowed_its_stop(
    tmp_path: Path,
) -> None:
    """A worker's stop once waited on its follower until the stop bound killed the process
    (exit 1): the stop arrived as a Redis write completed, and the follower slept and read
    again, once a second, never to stop."""
    client = _RedisSwallowingTheFirstStop()
    follower = RepositoryFollower(
        client=cast(aioredis.Redis, client),
        registry_prefix="fabric",
        repository_dir=tmp_path,  # empty: nothing to load or unload
        pool=(),
        models=LoadedModels(),
        swapper=cast(ModelSwapper, None),  # never called: nothing to load or unload
    )
    task = asyncio.get_running_loop().create_task(follower.run())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert client.num_reads == 1
