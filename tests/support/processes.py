"""Start the services as real processes, the way `make run` does, and wait until ready."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.lifecycle import terminate_process

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServiceProcess:
    process: subprocess.Popen[bytes]
    grpc_port: int
    metrics_port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait, and return the exit code (SIGKILL and raise if it does not exit in
        time)."""
        code = terminate_process(self.process, timeout_s)
        if code is None:
            raise subprocess.TimeoutExpired(self.process.args, timeout_s)
        return code


def start_worker(
    tmp_path: Path,
    *,
    model_repository: Path = REPO_ROOT / "models",
    extra_args: tuple[str, ...] = (),
    ready_timeout_s: float = 180.0,
    wait_ready: bool = True,
) -> ServiceProcess:
    """Starts `python -m services.gpu_worker` on free ports and waits for its ready file."""
    ready_file = tmp_path / f"worker-ready-{time.monotonic_ns()}.json"
    log_path = ready_file.with_suffix(".log")
    args = [
        sys.executable, "-m", "services.gpu_worker",
        "--model-repository", str(model_repository),
        "--grpc-port", "0", "--metrics-port", "0",
        "--ready-file", str(ready_file), *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            args, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env
        )
    service = ServiceProcess(process=process, grpc_port=0, metrics_port=0, log_path=log_path)
    if not wait_ready:
        return service
    deadline = time.monotonic() + ready_timeout_s
    # A child process's readiness cannot be awaited; the ready file is its signal.
    while not ready_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"worker exited with {process.returncode}:\n{service.log()}")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"worker not ready in {ready_timeout_s}s:\n{service.log()}")
        time.sleep(0.1)
    ports = json.loads(ready_file.read_text())
    service.grpc_port, service.metrics_port = ports["grpc_port"], ports["metrics_port"]
    return service


async def health_status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return response.status
