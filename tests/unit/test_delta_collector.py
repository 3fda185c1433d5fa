"""A generation request's collector: deltas a busy reader has not taken merge into one."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ExecutionFailed
from services.gpu_worker.generation.request_stream import Delta, DeltaCollector

pytestmark = pytest.mark.unit


async def test_deltas_produced_while_the_reader_is_busy_arrive_as_one() -> None:
    collector = DeltaCollector()
    collector.put_nowait(Delta((1,), "a"))
    collector.put_nowait(Delta((2,), "b"))
    collector.put_nowait(
        Delta((3,), "c", finish_reason="length", prompt_tokens=4, completion_tokens=3)
    )
    assert await collector.get() == Delta(
        (1, 2, 3), "abc", finish_reason="length", prompt_tokens=4, completion_tokens=3
    )


async def test_a_waiting_reader_gets_each_delta_as_it_comes() -> None:
    collector = DeltaCollector()
    reader = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    assert not reader.done()
    collector.put_nowait(Delta((7,), "x"))
    assert await reader == Delta((7,), "x")
    reader = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    collector.put_nowait(Delta((8,), "y"))
    assert await reader == Delta((8,), "y")


async def test_an_error_is_read_after_the_deltas_before_it() -> None:
    collector = DeltaCollector()
    collector.put_nowait(Delta((1,), "a"))
    error = ExecutionFailed("generation failed: device lost")
    collector.put_nowait(error)
    assert await collector.get() == Delta((1,), "a")
    assert await collector.get() is error


async def test_a_second_reader_waiting_at_once_is_a_bug() -> None:
    collector = DeltaCollector()
    first = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one reader"):
        await collector.get()
    collector.put_nowait(Delta((5,), "z"))
    assert await first == Delta((5,), "z")
