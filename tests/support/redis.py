"""A real redis-server process for tests, on a free loopback port, that tests may kill and pause.

It runs with the fabric's ACL (services.common.redis_acl) and random per-role passwords: `url`
is the admin's, `router_url` and `worker_url` are what a router or worker is started with.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.processes import (
    ChildProcess,
    ProcessError,
    launch,
    request_stop,
    wait_or_kill,
    wait_ready,
)
from services.common.redis_acl import ADMIN, ROUTER, WORKER, new_passwords, write_acl_files
from services.common.redis_server import find_free_port, ping, redis_command


@dataclass
class RedisServer:
    port: int
    #: Redis's working directory (the AOF lives here when `appendonly`).
    data_dir: Path
    appendonly: bool
    child: ChildProcess
    #: Role -> password (services.common.redis_acl.ROLES).
    passwords: dict[str, str]

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.child.process

    def role_url(self, role: str) -> str:
        return f"redis://{role}:{self.passwords[role]}@127.0.0.1:{self.port}/0"

    @property
    def url(self) -> str:
        """The admin's URL: every command on every key."""
        return self.role_url(ADMIN)

    @property
    def router_url(self) -> str:
        return self.role_url(ROUTER)

    @property
    def worker_url(self) -> str:
        return self.role_url(WORKER)

    @property
    def anonymous_url(self) -> str:
        """No credentials: Redis answers NOAUTH."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (a clean shutdown), wait, return the exit code; a no-op if already gone."""
        if self.process.poll() is None:
            request_stop(self.process)
            # A paused server would keep SIGTERM pending forever.
            self.process.send_signal(signal.SIGCONT)
        code = wait_or_kill(self.process, timeout_s)
        if code is None:
            raise subprocess.TimeoutExpired(self.process.args, timeout_s)
        return code

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def restart(self) -> None:
        """Stops the server and starts a new one on the same port: empty unless `appendonly`."""
        self.stop()
        if not self.appendonly:
            shutil.rmtree(self.data_dir)
            self.data_dir.mkdir()
        self.child = _start(
            self.port, self.data_dir, self.appendonly, self.child.log_path, self.passwords
        )

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung server)."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)


def start_redis(tmp_path: Path, *, appendonly: bool = False) -> RedisServer:
    """Starts redis-server on a free loopback port and returns once it answers PING."""
    data_dir = tmp_path / f"redis-{time.monotonic_ns()}"
    data_dir.mkdir(parents=True)
    log_path = data_dir.with_suffix(".log")
    passwords = new_passwords()
    # The free port may be taken by someone else before redis binds it: try a few.
    for _ in range(3):
        port = find_free_port()
        try:
            child = _start(port, data_dir, appendonly, log_path, passwords)
        except ProcessError:
            continue
        return RedisServer(port, data_dir, appendonly, child, passwords)
    raise ProcessError(f"redis-server did not start:\n{log_path.read_text(errors='replace')}")


def _start(
    port: int, data_dir: Path, appendonly: bool, log_path: Path, passwords: dict[str, str]
) -> ChildProcess:
    """Starts redis-server and waits until it answers PING (a server's readiness cannot be
    awaited); kills it and raises ProcessError if it exits first or is not up in 10 s."""
    # Beside the data directory, which `restart` empties.
    acl_file = write_acl_files(data_dir.with_name(data_dir.name + "-acl"), passwords)
    argv = redis_command(port, appendonly=appendonly, dir=data_dir, acl_file=acl_file)
    child = launch("redis-server", argv, log_path=log_path, append_log=True)
    admin = (ADMIN, passwords[ADMIN])
    try:
        wait_ready(
            [child],
            timeout_s=10.0,
            is_ready=lambda _: ping(port, timeout_s=0.5, auth=admin),
            poll_s=0.01,
        )
    except ProcessError:
        child.process.kill()
        child.process.wait()
        raise
    return child
