"""Start the services as real processes, the way `make run` does, and wait until ready."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.processes import ChildProcess, start_and_wait

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServiceProcess:
    child: ChildProcess
    grpc_port: int
    metrics_port: int
    #: Its plaintext health-only port, when it has one (`--health-port`).
    health_port: int | None = None

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.child.process

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.child.log()

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait, and return the exit code (SIGKILL and raise if it does not exit in
        time)."""
        code = self.child.terminate(timeout_s)
        if code is None:
            raise subprocess.TimeoutExpired(self.process.args, timeout_s)
        return code


def start_worker(
    tmp_path: Path,
    *,
    model_repository: Path = REPO_ROOT / "models",
    extra_args: tuple[str, ...] = (),
    ready_timeout_s: float = 180.0,
) -> ServiceProcess:
    """Starts `python -m services.gpu_worker` on free ports and waits for its ready file.
    Raises services.common.processes.ProcessError if it exits first or is not ready in time."""
    ready_file = tmp_path / f"worker-ready-{time.monotonic_ns()}.json"
    args = [
        sys.executable, "-m", "services.gpu_worker",
        "--model-repository", str(model_repository),
        "--grpc-port", "0", "--metrics-port", "0", *extra_args,
    ]  # fmt: skip
    child, ports = start_and_wait(
        "worker",
        args,
        log_path=ready_file.with_suffix(".log"),
        ready_file=ready_file,
        timeout_s=ready_timeout_s,
        cwd=REPO_ROOT,
    )
    return ServiceProcess(
        child, ports["grpc_port"], ports["metrics_port"], ports.get("health_port")
    )


def runs_uvloop(pid: int) -> bool:
    """Whether process `pid` has uvloop's extension loaded (its event loop is libuv's)."""
    return "uvloop" in Path(f"/proc/{pid}/maps").read_text()


async def health_status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return response.status
