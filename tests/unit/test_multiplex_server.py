"""The serving side of InferStream (services.common.multiplex_server): what a stream keeps for
its calls, driven by a request iterator the test writes (`integration/test_multiplex.py`
serves real streams)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.multiplex_server import CallContext, _ServedStream
from services.pb.inference.v1 import worker_pb2 as pb

pytestmark = pytest.mark.unit


async def test_a_call_cancelled_before_it_first_ran_leaves_nothing_behind() -> None:
    """A call and its cancel read in one turn of the loop (frames already buffered, as on the
    engine link): its task is cancelled before it first runs, so its own `finally` never
    runs. The stream forgets its context anyway; before, it held it for the stream's life."""
    started: list[bytes] = []

    async def answer(request: bytes, context: CallContext, timeout_s: float | None) -> bytes:
        started.append(request)
        return request

    async def requests() -> AsyncIterator[pb.InferStreamRequest]:
        yield pb.InferStreamRequest(calls=[pb.MuxCall(call_id=1, request=b"a")])
        yield pb.InferStreamRequest(cancelled_call_ids=[1])
        yield pb.InferStreamRequest(calls=[pb.MuxCall(call_id=2, request=b"b")])

    served = _ServedStream(requests(), answer, asyncio.Event())
    results = [r async for message in served.responses() for r in message.results]
    assert started == [b"b"]
    assert [r.call_id for r in results] == [2]
    assert served._contexts == {}
    assert served._running == {}


async def test_a_call_id_used_again_after_its_cancel_is_the_new_call_s() -> None:
    """Call 7 cancelled while it runs, and a new call 7 in the same message: the old task ends
    a turn later, and must leave the new call's entries alone. Before, its `finally` took
    them, so a later cancel of 7 found nothing and the new call ran on, unseen by the stream."""
    started, cancelled = asyncio.Event(), []

    async def answer(request: bytes, context: CallContext, timeout_s: float | None) -> bytes:
        try:
            started.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(request)
            raise
        return request

    async def requests() -> AsyncIterator[pb.InferStreamRequest]:
        yield pb.InferStreamRequest(calls=[pb.MuxCall(call_id=7, request=b"old")])
        await started.wait()
        started.clear()
        yield pb.InferStreamRequest(
            cancelled_call_ids=[7], calls=[pb.MuxCall(call_id=7, request=b"new")]
        )
        await started.wait()
        await asyncio.sleep(0.01)  # the old task's end has run
        yield pb.InferStreamRequest(cancelled_call_ids=[7])

    served = _ServedStream(requests(), answer, asyncio.Event())
    async with asyncio.timeout(10):
        results = [r async for message in served.responses() for r in message.results]
    await asyncio.sleep(0.01)
    assert results == []
    assert cancelled == [b"old", b"new"]
    assert served._contexts == {} and served._running == {}
