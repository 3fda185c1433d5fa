"""The peer a user would pick instead: MiniLM on Ray Serve with `@serve.batch`, as a send target.

    async with RayServePeer(max_batch_size=32, batch_wait_timeout_s=0.01) as peer:
        await peer.send("hello world")            # one POST /embed; raises unless 200
        vector = await peer.embed("hello world")  # the same, returning the 384 floats

The server is bench/fabric/peer_ray_server.py, run by the Ray venv's python
(`make .venv-ray/.installed`), never imported here: Ray Serve and its pins stay out of this
venv. The client is asyncio HTTP/1.1 over a pool of persistent keep-alive connections (no new
dependency): a few are opened before the first send, more on demand up to `max_connections`,
each carrying one request at a time. Like a gRPC channel, it neither reconnects per request
nor queues requests behind a fixed handful of connections, so the client adds about what a
gRPC channel adds (bench/fabric/http_pool.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from bench.fabric.http_pool import HTTPPool, PeerHTTPError
from services.common.procfs import descendants, read_stat

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY_VENV = REPO_ROOT / ".venv-ray"
SERVER_SCRIPT = Path(__file__).resolve().parent / "peer_ray_server.py"
ROUTE = "/embed"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RayServePeer:
    """Starts bench/fabric/peer_ray_server.py in the Ray venv and sends it requests.

    All settings are stated in `settings` (for the results file). `send(text)` raises
    PeerHTTPError on a non-200 answer and ConnectionError when the peer is unreachable.
    """

    def __init__(
        self,
        *,
        max_batch_size: int = 32,
        batch_wait_timeout_s: float = 0.01,
        num_cpus: int = 2,
        max_ongoing_requests: int = 1024,
        max_queued_requests: int = -1,
        port: int | None = None,
        connections: int = 16,
        max_connections: int = 256,
        startup_timeout_s: float = 240.0,
        stop_timeout_s: float = 30.0,
        venv: Path = RAY_VENV,
        log_path: Path | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self.num_cpus = num_cpus
        # peer_ray.DEFAULT_MAX_ONGOING_REQUESTS: past it Serve's router polls with backoff.
        self.max_ongoing_requests = max(max_ongoing_requests, max_batch_size)
        self.max_queued_requests = max_queued_requests
        self.port = port or _free_port()
        self.connections = connections
        self.max_connections = max_connections
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.python = Path(venv) / "bin" / "python"
        self.log_path = log_path
        self.startup_s: float | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._log_file: IO[bytes] | None = None
        self._pool: HTTPPool | None = None
        self._stdout_drain: asyncio.Task[None] | None = None
        self._temp_dir: str | None = None

    @property
    def settings(self) -> dict[str, object]:
        return {
            "peer": "ray-serve",
            "max_batch_size": self.max_batch_size,
            "batch_wait_timeout_s": self.batch_wait_timeout_s,
            "num_cpus": self.num_cpus,
            "torch_threads": self.num_cpus,
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "replicas": 1,
            "ingress": "Serve HTTP proxy (default), Starlette request, @serve.batch",
            "client": f"HTTP/1.1 keep-alive pool, up to {self.max_connections} connections",
        }

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{ROUTE}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    async def __aenter__(self) -> RayServePeer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        if not self.python.exists():
            raise RuntimeError(
                f"{self.python} is missing: the Ray Serve peer runs in its own venv; "
                "run make .venv-ray/.installed"
            )
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="peer-ray-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        # Ray's session directory: ours to remove even when the peer had to be killed.
        self._temp_dir = temp_dir = tempfile.mkdtemp(prefix="ray-peer-", dir="/tmp")
        started = time.monotonic()
        self._process = await asyncio.create_subprocess_exec(
            str(self.python),
            str(SERVER_SCRIPT),
            "--port",
            str(self.port),
            "--max-batch-size",
            str(self.max_batch_size),
            "--batch-wait-timeout-s",
            str(self.batch_wait_timeout_s),
            "--num-cpus",
            str(self.num_cpus),
            "--max-ongoing-requests",
            str(self.max_ongoing_requests),
            "--max-queued-requests",
            str(self.max_queued_requests),
            "--startup-timeout-s",
            str(self.startup_timeout_s),
            "--temp-dir",
            temp_dir,
            "--exit-on-stdin-eof",  # if this process dies without close(), Ray goes too
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._log_file,
            cwd=str(REPO_ROOT),
            # Its own session: a Ctrl-C meant for the benchmark reaches it only through close().
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(self.startup_timeout_s):
                await self._wait_ready()
            self._pool = HTTPPool("127.0.0.1", self.port, max_connections=self.max_connections)
            await self._pool.prefill(self.connections)
        except BaseException as error:
            await self.close()
            if isinstance(error, TimeoutError | RuntimeError):
                raise RuntimeError(
                    f"Ray Serve peer did not start ({error!r}); log {self.log_path}:\n"
                    f"{self._log_tail()}"
                ) from error
            raise
        self.startup_s = time.monotonic() - started

    async def _wait_ready(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        while True:
            line = await self._process.stdout.readline()
            if not line:
                code = await self._process.wait()
                raise RuntimeError(f"peer_ray.py exited with {code} before READY")
            if line.strip() == f"READY {self.port}".encode():
                break
        self._stdout_drain = asyncio.create_task(self._drain(self._process.stdout))

    @staticmethod
    async def _drain(stream: asyncio.StreamReader) -> None:
        while await stream.read(65536):
            pass

    def _log_tail(self, lines: int = 40) -> str:
        try:
            text = Path(str(self.log_path)).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def _post(self, text: str) -> bytes:
        if self._pool is None:
            raise RuntimeError("RayServePeer is not started")
        status, payload = await self._pool.post(ROUTE, json.dumps({"text": text}).encode())
        if status != 200:
            raise PeerHTTPError(status, payload)
        return payload

    async def send(self, text: str) -> None:
        """One embedding request; raises unless the peer answered 200."""
        await self._post(text)

    async def embed(self, text: str) -> list[float]:
        """One embedding request, returning the embedding (for checks, not for timing)."""
        return list(json.loads(await self._post(text))["embedding"])

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of every process of the peer (driver, Ray daemons, proxy,
        replica), keyed by process name, plus "total". Diff two readings around a window."""
        if self._process is None:
            return {}
        totals: dict[str, float] = {}
        for pid in [self._process.pid, *descendants(self._process.pid)]:
            stat = read_stat(pid)
            if stat is not None:
                totals[stat.name] = totals.get(stat.name, 0.0) + stat.cpu_s
        totals["total"] = sum(totals.values())
        return totals

    async def close(self) -> None:
        """Stops the peer: SIGTERM (Serve and Ray shut down cleanly), then SIGKILL to the
        whole process tree if it has not exited within `stop_timeout_s`."""
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.stop_timeout_s)
            except TimeoutError:
                tree = descendants(process.pid)
                for pid in [process.pid, *tree]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                await process.wait()
                print(
                    f"Ray Serve peer ignored SIGTERM for {self.stop_timeout_s}s: killed",
                    file=sys.stderr,
                )
        if process is not None and process.stdin is not None:
            process.stdin.close()
        if self._stdout_drain is not None:
            self._stdout_drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stdout_drain
            self._stdout_drain = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
