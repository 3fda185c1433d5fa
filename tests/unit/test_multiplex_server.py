"""The serving side of InferStream (services.common.multiplex_server): what a stream keeps for
its calls, driven by a request iterator the test writes (`integration/test_multiplex.py`
serves real streams)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common import multiplex_server
from services.common.errors import NOT_STARTED_TRAILER, RETRY_AFTER_MS_KEY, InvalidInput
from services.common.multiplex_server import CallContext, _ServedStream
from services.common.multiplex_stream import MAX_CALLS_PER_MESSAGE
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


async def test_a_message_of_more_calls_than_any_caller_sends_ends_the_stream_invalid() -> None:
    """No caller of ours puts more than MAX_CALLS_PER_MESSAGE calls in a message: more is a
    peer's bug or worse. The calls of earlier messages are answered, none of that one runs,
    and the stream ends INVALID_ARGUMENT."""
    ran: list[bytes] = []

    async def answer(request: bytes, context: CallContext, timeout_s: float | None) -> bytes:
        ran.append(request)
        return request

    too_many = [pb.MuxCall(call_id=i, request=b"x") for i in range(2, MAX_CALLS_PER_MESSAGE + 3)]

    async def requests() -> AsyncIterator[pb.InferStreamRequest]:
        yield pb.InferStreamRequest(calls=[pb.MuxCall(call_id=1, request=b"first")])
        await asyncio.sleep(0.01)
        yield pb.InferStreamRequest(calls=too_many)

    served = _ServedStream(requests(), answer, asyncio.Event())
    results: list[pb.MuxResult] = []
    with pytest.raises(InvalidInput, match="calls"):
        async for message in served.responses():
            results.extend(message.results)
    assert ran == [b"first"] and [r.call_id for r in results] == [1]


async def test_calls_past_the_running_limit_are_refused_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream already running MAX_RUNNING_CALLS refuses the next call RESOURCE_EXHAUSTED
    (marked not started, with a retry hint) without running it; once one ends, calls run
    again."""
    monkeypatch.setattr(multiplex_server, "MAX_RUNNING_CALLS", 2)
    gate, ran = asyncio.Event(), []

    async def answer(request: bytes, context: CallContext, timeout_s: float | None) -> bytes:
        ran.append(request)
        await gate.wait()
        return request

    async def requests() -> AsyncIterator[pb.InferStreamRequest]:
        calls = [pb.MuxCall(call_id=i, request=b"%d" % i) for i in (1, 2, 3)]
        yield pb.InferStreamRequest(calls=calls)
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.sleep(0.01)
        yield pb.InferStreamRequest(calls=[pb.MuxCall(call_id=4, request=b"4")])

    served = _ServedStream(requests(), answer, asyncio.Event())
    results = {r.call_id: r async for message in served.responses() for r in message.results}
    assert ran == [b"1", b"2", b"4"]
    assert {i: r.code for i, r in results.items()} == {
        1: 0,
        2: 0,
        3: grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        4: 0,
    }
    trailers = dict(results[3].trailers.items())
    assert trailers[NOT_STARTED_TRAILER[0]] == NOT_STARTED_TRAILER[1]
    # With a hint, as every refusal for load: without one, no caller retried it (review).
    assert 75 <= int(trailers[RETRY_AFTER_MS_KEY]) <= 125


async def test_a_peer_that_sends_without_reading_is_read_no_further(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every call refused at once (the running limit at 0) and the peer not reading: past
    MAX_OUTBOX_RESULTS results waiting, the stream reads no more of its messages, so refusals
    do not pile up without bound; once the peer reads, the rest are read and answered."""
    monkeypatch.setattr(multiplex_server, "MAX_RUNNING_CALLS", 0)
    monkeypatch.setattr(multiplex_server, "MAX_OUTBOX_RESULTS", 4)
    num_read = 0

    async def answer(request: bytes, context: CallContext, timeout_s: float | None) -> bytes:
        raise AssertionError("no call runs")

    async def requests() -> AsyncIterator[pb.InferStreamRequest]:
        nonlocal num_read
        for m in range(20):
            num_read += 1
            yield pb.InferStreamRequest(
                calls=[pb.MuxCall(call_id=3 * m + i, request=b"x") for i in range(3)]
            )

    served = _ServedStream(requests(), answer, asyncio.Event()).responses()
    first = await anext(served)
    await asyncio.sleep(0.2)  # the peer reads nothing meanwhile
    assert num_read <= 4
    rest = [r for message in [m async for m in served] for r in message.results]
    assert len(first.results) + len(rest) == 60 and num_read == 20


async def test_a_reader_that_fails_is_logged_and_its_stream_ends_after_its_calls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failure in reading that is no peer's bad message (here a slice's cancel listener
    raising: our bug) is logged, and the stream ends OK once the calls running are answered:
    its peer sends the calls never read elsewhere, as never started. Before, it ended so
    unlogged: the bug was unseen."""

    async def answer(request: bytes, context: CallContext, timeout_s: float | None) -> bytes:
        def listener(index: int) -> None:
            raise RuntimeError(f"listener of slice {index} failed")

        context.slice_cancels.listen(listener)
        await asyncio.sleep(0.05)
        return request

    async def requests() -> AsyncIterator[pb.InferStreamRequest]:
        yield pb.InferStreamRequest(calls=[pb.MuxCall(call_id=1, request=b"first")])
        await asyncio.sleep(0.01)
        yield pb.InferStreamRequest(cancelled_slices=[pb.SliceRef(call_id=1, slice=0)])
        await asyncio.sleep(30)  # a peer that keeps its stream open

    served = _ServedStream(requests(), answer, asyncio.Event())
    async with asyncio.timeout(10):
        results = [r async for message in served.responses() for r in message.results]
    assert [r.call_id for r in results] == [1]
    (record,) = [r for r in caplog.records if "stream reader failed" in r.getMessage()]
    assert record.exc_info is not None and "listener of slice 0" in str(record.exc_info[1])
