"""A stop's drains are bounded by the grace, and one that overran is named in the log."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common.lifecycle import drain_within

pytestmark = pytest.mark.unit


async def test_drains_that_finish_in_time_are_awaited_and_nothing_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    finished: list[str] = []

    async def drain(name: str) -> None:
        await asyncio.sleep(0.01)
        finished.append(name)

    loop = asyncio.get_running_loop()
    drains = [loop.create_task(drain(n), name=n) for n in ("a", "b")]
    with caplog.at_level(logging.WARNING):
        await drain_within(drains, 5.0)
    assert sorted(finished) == ["a", "b"]
    assert not caplog.records


async def test_a_drain_past_the_grace_is_cancelled_and_named_with_its_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cancelled = asyncio.Event()

    async def hangs() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()  # its cancel path ran (the batcher answers its rows there)
            raise

    async def quick() -> None:
        pass

    loop = asyncio.get_running_loop()
    drains = [
        loop.create_task(hangs(), name="drain batching"),
        loop.create_task(quick(), name="drain tiny-llama 1"),
    ]
    with caplog.at_level(logging.WARNING):
        await drain_within(
            drains, 0.05, lambda name: " (3 rows unanswered)" * (name == "drain batching")
        )
    assert cancelled.is_set()
    assert all(t.done() for t in drains)
    [record] = caplog.records
    assert "still running drain batching (3 rows unanswered)" in record.getMessage()
    assert "tiny-llama" not in record.getMessage()


async def test_every_failed_drain_is_logged_and_the_first_raised_after_the_others_finish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    others_done = asyncio.Event()

    async def fails(why: str) -> None:
        raise RuntimeError(why)

    async def slower() -> None:
        for _ in range(3):  # a few turns of the loop, no timer: done long before the grace
            await asyncio.sleep(0)
        others_done.set()

    async def fails_when_cut() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("shutdown broke") from None

    loop = asyncio.get_running_loop()
    drains = [
        loop.create_task(fails("engine broke"), name="a"),
        loop.create_task(slower(), name="b"),
        loop.create_task(fails("loop broke"), name="c"),
        loop.create_task(fails_when_cut(), name="d"),
    ]
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="engine broke"):
        await drain_within(drains, 1.0)
    assert others_done.is_set()
    assert [r.getMessage() for r in caplog.records] == [
        "a failed; closing anyway",
        "c failed; closing anyway",
        "d failed; closing anyway",
    ]


async def test_a_cancelled_stop_cancels_its_drains() -> None:
    async def hangs() -> None:
        await asyncio.Event().wait()

    loop = asyncio.get_running_loop()
    drain = loop.create_task(hangs(), name="drain batching")
    stop = loop.create_task(drain_within([drain], 5.0))
    await asyncio.sleep(0.01)
    stop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stop
    assert drain.cancelled()  # its cancel path ran before the stop ended
