"""An asyncio HTTP/1.1 client over a pool of persistent keep-alive connections (no new
dependency), for the Ray Serve peer (bench/fabric/peer_client.py): a few connections are opened
before the first request, more on demand up to `max_connections`, each carrying one request at
a time."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Code:
    name: str


class PeerHTTPError(Exception):
    """A non-200 answer. `code().name` is "HTTP_<status>", which is how the load generator
    (bench.fabric.loadgen.status_of) records rejections by status code."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status
        self.body = body

    def code(self) -> _Code:
        return _Code(f"HTTP_{self.status}")


class _Connection:
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = False

    @classmethod
    async def open(cls, host: str, port: int) -> _Connection:
        reader, writer = await asyncio.open_connection(host, port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes, bool]:
        """Sends one request; returns (status, body, keep_alive)."""
        self.writer.write(head + body)
        self.used = True
        status_line, _, header_block = (
            (await self.reader.readuntil(b"\r\n\r\n"))[:-4].decode("latin-1").partition("\r\n")
        )
        status = int(status_line.split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in header_block.split("\r\n"):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            payload = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            payload = await self._read_chunked()
        else:  # no length: the body runs to the end of the connection
            payload = await self.reader.read()
            return status, payload, False
        keep_alive = headers.get("connection", "").lower() != "close"
        return status, payload, keep_alive

    async def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                # Trailers (rare), then an empty line.
                while (await self.reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return b"".join(parts)
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)

    def close(self) -> None:
        self.writer.close()


class HTTPPool:
    """Persistent HTTP/1.1 connections to one host, reused most-recently-idle first."""

    def __init__(self, host: str, port: int, *, max_connections: int = 256) -> None:
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self._idle: deque[_Connection] = deque()
        self._open = 0
        self._released = asyncio.Condition()
        self._host_header = f"{host}:{port}"

    async def prefill(self, count: int) -> None:
        connections = await asyncio.gather(
            *(_Connection.open(self.host, self.port) for _ in range(count))
        )
        self._open += len(connections)
        self._idle.extend(connections)

    async def _acquire(self) -> _Connection:
        while True:
            if self._idle:
                return self._idle.pop()
            if self._open < self.max_connections:
                self._open += 1
                try:
                    return await _Connection.open(self.host, self.port)
                except BaseException:
                    self._open -= 1
                    raise
            async with self._released:
                await self._released.wait_for(
                    lambda: bool(self._idle) or self._open < self.max_connections
                )

    async def _release(self, connection: _Connection | None) -> None:
        if connection is None:
            self._open -= 1
        else:
            self._idle.append(connection)
        async with self._released:
            self._released.notify()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        for attempt in (0, 1):
            connection = await self._acquire()
            reused = connection.used
            try:
                status, payload, keep_alive = await connection.request(head, body)
            except (ConnectionError, asyncio.IncompleteReadError) as error:
                connection.close()
                await self._release(None)
                # The server may close an idle keep-alive connection just as it is reused: one
                # retry on a fresh connection (the request is idempotent).
                if reused and attempt == 0:
                    continue
                raise ConnectionError(f"peer connection failed: {error!r}") from error
            except BaseException:  # cancelled or timed out mid-request: state unknown
                connection.close()
                await self._release(None)
                raise
            if keep_alive:
                await self._release(connection)
            else:
                connection.close()
                await self._release(None)
            return status, payload
        raise AssertionError("unreachable")

    async def close(self) -> None:
        while self._idle:
            connection = self._idle.pop()
            connection.close()
            with contextlib.suppress(Exception):
                await connection.writer.wait_closed()
        self._open = 0
