"""A worker front's relay of InferStreams to its engine (services.gpu_worker.stream_relay), over
a real unix socket; `integration/test_worker_fronts.py` runs real fronts and engines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.errors import NOT_STARTED_TRAILER
from services.common.frames import END, MESSAGE, write_frame
from services.gpu_worker import stream_relay
from services.gpu_worker.stream_relay import FrontMetrics, StreamRelay
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple[object, ...]) -> None:
        super().__init__(details)
        self.code = code
        self.trailers = trailers


async def no_requests() -> AsyncIterator[bytes]:
    """A router's stream that sends nothing."""
    await asyncio.Event().wait()
    yield b""  # never reached


class _Context:
    """What `relay` reads of a grpc.aio servicer context: its abort."""

    async def abort(
        self, code: grpc.StatusCode, details: str, trailers: tuple[object, ...] = ()
    ) -> None:
        raise Aborted(code, details, trailers)


async def relayed_until_aborted(relay: StreamRelay) -> Aborted:
    """How the relay ends a stream that sends nothing (within 5 s)."""
    with pytest.raises(Aborted) as aborted:
        async with asyncio.timeout(5):
            async for _ in relay.relay(no_requests(), _Context()):  # type: ignore[arg-type]
                pass
    return aborted.value


@pytest.mark.parametrize("event", ["engine lost", "front stopping"])
async def test_a_stream_connecting_as_the_engine_is_lost_or_the_front_stops_is_not_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, event: str
) -> None:
    """The engine is declared lost (ENGINE_LOST_S unanswered), or the front stops, while a
    stream connects to the engine's link (whose listen backlog still takes connections): the
    stream is refused UNAVAILABLE marked not started, nothing of it sent to the engine, so its
    calls are sent elsewhere without charging their rows. Before, the stream was in no set the
    declaration ended, and waited for answers that never came; then it ended unmarked, or (the
    front stopping) was told to close after its first calls had gone to the engine."""
    link = tmp_path / "link.sock"
    held: list[asyncio.StreamWriter] = []

    async def wedged_engine(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # takes the connection, answers nothing

    server = await asyncio.start_unix_server(wedged_engine, path=str(link))
    relay = StreamRelay(link, FrontMetrics(CollectorRegistry()))
    connect = asyncio.open_unix_connection

    async def connect_as_it_is_lost(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        connection = await connect(path)
        relay.set_engine_lost(True) if event == "engine lost" else relay.stop()
        return connection

    monkeypatch.setattr(stream_relay.asyncio, "open_unix_connection", connect_as_it_is_lost)

    try:
        aborted = await relayed_until_aborted(relay)
        assert aborted.code == grpc.StatusCode.UNAVAILABLE
        assert NOT_STARTED_TRAILER in aborted.trailers
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("num_answers", "answer_bytes", "most_written_unread"),
    [
        # Small answers: the front's MAX_HELD_ANSWERS (64), and what the link's socket
        # buffers hold (94 written in all when measured).
        (1_000, 16 * 1024, 160),
        # Answers of 1 MiB: MAX_HELD_BYTES (8 MiB) binds first (9 written when measured;
        # 65 under the count alone).
        (100, 1024 * 1024, 24),
    ],
)
async def test_a_router_that_does_not_read_holds_the_engines_writes_not_the_fronts_memory(
    tmp_path: Path, num_answers: int, answer_bytes: int, most_written_unread: int
) -> None:
    """The router stops reading its stream while the engine answers: the front holds at most
    MAX_HELD_ANSWERS of them, or MAX_HELD_BYTES, and reads no more of the link, so that the
    engine's writes wait (and its own bound on a stream's unsent results applies). Once the
    router reads again, every answer comes, in order, and the stream ends OK. Before, the front
    read the link as fast as the engine wrote, holding whatever the router left unread."""
    link = tmp_path / "link.sock"
    written = 0

    async def answering_engine(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        for index in range(num_answers):
            write_frame(writer, MESSAGE, index.to_bytes(4, "little") * (answer_bytes // 4))
            await writer.drain()
            written += 1
        write_frame(writer, END, pb.MuxResult(code=0).SerializeToString())
        await writer.drain()

    server = await asyncio.start_unix_server(answering_engine, path=str(link))
    relay = StreamRelay(link, FrontMetrics(CollectorRegistry()))

    answers = relay.relay(no_requests(), _Context())  # type: ignore[arg-type]
    try:
        received = [await anext(answers)]  # then the router reads nothing for a while

        async def engine_waits() -> bool:
            before = written
            await asyncio.sleep(0.5)
            return written == before

        await eventually(engine_waits, timeout_s=30.0, message="the engine's writes never waited")
        assert written <= most_written_unread, written
        async with asyncio.timeout(30):
            received += [answer async for answer in answers]
        assert len(received) == num_answers
        assert [int.from_bytes(a[:4], "little") for a in received] == list(range(num_answers))
    finally:
        await answers.aclose()
        server.close()
        await server.wait_closed()


async def test_a_stream_the_engine_ended_never_passes_on_the_not_started_mark(
    tmp_path: Path,
) -> None:
    """The engine ends a stream UNAVAILABLE with the not-started mark among its trailers: the
    front passes on the code, the message and the other trailers, not the mark. The stream
    reached the engine, so its calls may have run; a router told they had not would run them
    again elsewhere."""
    link = tmp_path / "link.sock"
    trailers = {NOT_STARTED_TRAILER[0]: NOT_STARTED_TRAILER[1], "x-other": "kept"}
    ended = pb.MuxResult(
        code=grpc.StatusCode.UNAVAILABLE.value[0], message="engine stopping", trailers=trailers
    )

    async def ending_engine(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        write_frame(writer, END, ended.SerializeToString())
        await writer.drain()

    server = await asyncio.start_unix_server(ending_engine, path=str(link))
    relay = StreamRelay(link, FrontMetrics(CollectorRegistry()))

    try:
        aborted = await relayed_until_aborted(relay)
        assert aborted.code == grpc.StatusCode.UNAVAILABLE
        assert str(aborted) == "engine stopping"
        assert aborted.trailers == (("x-other", "kept"),)
    finally:
        server.close()
        await server.wait_closed()


async def test_an_end_that_does_not_parse_ends_the_stream_as_a_broken_link(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An END whose status does not parse raised DecodeError out of the relay's receiving task,
    an exception no one retrieved (review finding); it is a broken link, said as one, and the
    stream ends UNAVAILABLE."""
    link = tmp_path / "link.sock"

    async def garbled_engine(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        write_frame(writer, END, b"\xff\xff\xff")
        await writer.drain()

    server = await asyncio.start_unix_server(garbled_engine, path=str(link))
    relay = StreamRelay(link, FrontMetrics(CollectorRegistry()))
    try:
        with caplog.at_level("WARNING", logger=stream_relay.__name__):
            aborted = await relayed_until_aborted(relay)
        assert aborted.code == grpc.StatusCode.UNAVAILABLE
        assert any("the engine's link broke" in r.getMessage() for r in caplog.records)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_stream_ended_for_the_engine_lost_is_not_ended_ok_by_a_late_end(
    tmp_path: Path,
) -> None:
    """The engine is declared lost, then its loop turns again and sends an answer and an OK
    END: the answer is queued behind the loss's signal and never sent. Ended OK, the stream
    told the router its calls still waiting had never run, and they ran again elsewhere
    (review finding); it ends UNAVAILABLE, unmarked, as for an engine gone."""
    link = tmp_path / "link.sock"
    go = asyncio.Event()
    first = pb.InferStreamResponse(results=[pb.MuxResult(call_id=1)]).SerializeToString()
    late = pb.InferStreamResponse(results=[pb.MuxResult(call_id=2)]).SerializeToString()

    async def slow_engine(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        write_frame(writer, MESSAGE, first)
        await writer.drain()
        await go.wait()  # stalled past ENGINE_LOST_S, as the front sees it
        write_frame(writer, MESSAGE, late)
        write_frame(writer, END, pb.MuxResult(code=0).SerializeToString())
        await writer.drain()

    server = await asyncio.start_unix_server(slow_engine, path=str(link))
    relay = StreamRelay(link, FrontMetrics(CollectorRegistry()))
    answers = relay.relay(no_requests(), _Context())  # type: ignore[arg-type]
    try:
        assert await answers.__anext__() == first
        relay.set_engine_lost(True)
        go.set()
        # The late answer and the engine's END are read in behind the loss's signal.
        (queued,) = relay._open
        await eventually(lambda: queued._queue.qsize() >= 3, interval_s=0.01)
        with pytest.raises(Aborted) as aborted:
            await answers.__anext__()
        assert aborted.value.code == grpc.StatusCode.UNAVAILABLE
        assert NOT_STARTED_TRAILER not in aborted.value.trailers
    finally:
        await answers.aclose()
        server.close()
        await server.wait_closed()
