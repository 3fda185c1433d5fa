"""Length-prefixed frames over a local stream socket: how a worker's front processes hand the
InferStreams they receive to the engine process, without a second gRPC hop
(services.gpu_worker.front, services.gpu_worker.engine_link).

A frame is a 5-byte header, its kind (one byte) and its length (four bytes, little-endian),
then that many bytes. One connection carries one InferStream:

- front to engine: MESSAGE frames, each an `InferStreamRequest` exactly as the router sent it,
  then END once the router half-closed the stream;
- engine to front: MESSAGE frames, each an `InferStreamResponse`, then END carrying the
  stream's status as a `MuxResult` (code, message, trailers).

A connection that closes without END means its peer went away: the engine cancels the
stream's calls, and the front fails the stream UNAVAILABLE. The bytes are never parsed on
the front's side, so a frame costs a copy and two system calls, not a gRPC message.
"""

from __future__ import annotations

import asyncio
import struct

#: The kind byte and the payload's length.
HEADER = struct.Struct("<BI")
MESSAGE = 0
END = 1
KINDS = frozenset((MESSAGE, END))


class FrameError(Exception):
    """The stream of frames is broken: an unknown kind, a payload past the bound, or a
    connection cut inside a frame."""


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, bytes] | None:
    """The next frame's kind and payload; None when the peer closed between frames. Raises
    FrameError for a broken stream, ConnectionError when the connection failed."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as cut:
        if not cut.partial:
            return None
        raise FrameError("the connection closed inside a frame's header") from None
    kind, length = HEADER.unpack(header)
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if length > max_bytes:
        raise FrameError(f"a frame of {length} bytes is past the bound of {max_bytes}")
    try:
        return kind, await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise FrameError("the connection closed inside a frame") from None


def write_frame(writer: asyncio.StreamWriter, kind: int, payload: bytes = b"") -> None:
    """Queues one frame on `writer` (the caller drains)."""
    writer.writelines((HEADER.pack(kind, len(payload)), payload))
