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
