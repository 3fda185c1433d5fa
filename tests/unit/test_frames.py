"""The frames a worker's fronts and engine exchange (services.common.frames), read back from an
asyncio StreamReader fed the bytes written: the round trip, a close between frames, and every
way a stream of frames can be broken."""

from __future__ import annotations

import asyncio

import pytest

from services.common.frames import END, HEADER, MESSAGE, FrameError, read_frame, write_frame

pytestmark = pytest.mark.unit

MAX_BYTES = 1024


class _Collect(asyncio.WriteTransport):
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def written(*frames: tuple[int, bytes]) -> bytes:
    """The bytes `write_frame` puts on the wire for `frames`."""
    transport = _Collect()
    protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
    writer = asyncio.StreamWriter(transport, protocol, None, asyncio.get_running_loop())
    for kind, payload in frames:
        write_frame(writer, kind, payload)
    return bytes(transport.data)


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_frames_come_back_as_written_and_a_close_between_frames_ends_them() -> None:
    frames = [(MESSAGE, b"first"), (MESSAGE, b""), (MESSAGE, bytes(range(256)) * 4), (END, b"ok")]
    reader = reader_of(written(*frames))
    read = [await read_frame(reader, MAX_BYTES) for _ in frames]
    assert read == frames
    assert await read_frame(reader, MAX_BYTES) is None


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        pytest.param(HEADER.pack(MESSAGE, 8)[:3], "header", id="cut-in-the-header"),
        pytest.param(HEADER.pack(MESSAGE, 8) + b"abc", "inside a frame", id="cut-in-the-payload"),
        pytest.param(HEADER.pack(7, 1) + b"x", "unknown frame kind 7", id="unknown-kind"),
        pytest.param(HEADER.pack(MESSAGE, MAX_BYTES + 1), "past the bound", id="too-large"),
    ],
)
async def test_a_broken_stream_of_frames_is_an_error(data: bytes, complaint: str) -> None:
    reader = reader_of(written((MESSAGE, b"whole")) + data)
    assert await read_frame(reader, MAX_BYTES) == (MESSAGE, b"whole")
    with pytest.raises(FrameError, match=complaint):
        await read_frame(reader, MAX_BYTES)


async def test_a_frame_past_the_bound_is_refused_before_its_payload_arrives() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(HEADER.pack(MESSAGE, 10 * MAX_BYTES))  # no payload, no EOF: it never comes
    with pytest.raises(FrameError, match="past the bound"):
        await asyncio.wait_for(read_frame(reader, MAX_BYTES), timeout=5)
