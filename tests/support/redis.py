"""A real redis-server process for tests, on a free loopback port, that tests may kill and pause."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.redis_server import find_free_port, ping, redis_command


@dataclass
class RedisServer:
    port: int
    #: Redis's working directory (the AOF lives here when `appendonly`).
    data_dir: Path
    appendonly: bool
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (a clean shutdown), wait, return the exit code; a no-op if already gone."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            # A paused server would keep SIGTERM pending forever.
            self.process.send_signal(signal.SIGCONT)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

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
        self.process = _spawn(self.port, self.data_dir, self.appendonly, self.log_path)
        _wait_for_ping(self)

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
    # The free port may be taken by someone else before redis binds it: try a few.
    for _ in range(3):
        port = find_free_port()
        process = _spawn(port, data_dir, appendonly, log_path)
        server = RedisServer(port, data_dir, appendonly, log_path, process)
        try:
            _wait_for_ping(server)
        except RuntimeError:
            continue
        return server
    raise RuntimeError(f"redis-server did not start:\n{log_path.read_text(errors='replace')}")


def _spawn(port: int, data_dir: Path, appendonly: bool, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log_file:
        return subprocess.Popen(
            redis_command(port, appendonly=appendonly, dir=data_dir),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )


def _wait_for_ping(server: RedisServer, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    # Another process's readiness cannot be awaited: ask until it answers.
    while not ping(server.port, timeout_s=0.5):
        if server.process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {server.process.returncode}")
        if time.monotonic() > deadline:
            server.kill()
            raise TimeoutError(f"redis-server not answering PING after {timeout_s} s")
        time.sleep(0.01)
