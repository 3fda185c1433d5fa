"""The registry benchmark's (bench/registry.py) parts of its stack: the stack's Redis (paused,
killed, restarted empty on its port) and its traffic (a closed-loop Predict caller and a health
prober of every tier)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.processes import ChildProcess, launch, wait_ready
from services.common.procfs import is_alive
from services.common.redis_acl import (
    ACL_FILE_NAME,
    ADMIN,
    password_file_name,
    read_password,
)
from services.common.redis_server import ping, redis_command
from services.common.registry_schema import RegistryKeys
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Redis:
    """The stack's Redis: the launcher's process at first; after `start`, ours, on the same port
    with the same ACL file, and empty."""

    port: int
    acl_dir: Path
    pid: int
    child: ChildProcess | None = None

    @property
    def admin_password(self) -> str:
        return read_password(self.acl_dir / password_file_name(ADMIN))

    def answers(self) -> bool:
        return ping(self.port, timeout_s=0.2, auth=(ADMIN, self.admin_password))

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        if self.child is not None:
            self.child.process.wait(10)
        wait_until(lambda: not self.answers() and not is_alive(self.pid), "redis gone")

    def start(self, state_dir: Path) -> None:
        data_dir = state_dir / f"redis-{time.monotonic_ns()}"
        data_dir.mkdir()
        argv = redis_command(
            self.port, appendonly=False, dir=data_dir, acl_file=self.acl_dir / ACL_FILE_NAME
        )
        self.child = launch("redis-server", argv, log_path=data_dir.with_suffix(".log"))
        self.pid = self.child.pid
        wait_ready([self.child], timeout_s=10, is_ready=lambda _: self.answers(), poll_s=0.01)

    def registered_workers(self) -> set[str]:
        url = f"redis://{ADMIN}:{self.admin_password}@127.0.0.1:{self.port}/0"
        try:
            with redis.Redis.from_url(url, socket_timeout=1) as client:
                members = client.zrange(RegistryKeys("fabric").workers, 0, -1)
        except redis.RedisError:
            return set()
        return {m.decode() for m in members}

    def close(self) -> None:
        if self.child is not None and self.child.process.poll() is None:
            self.child.terminate(10)


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


@dataclass
class Traffic:
    """One closed-loop Predict caller and a health prober of every tier, until `stop`; each
    sample is (sent at, latency seconds; inf for a failure)."""

    gateway: str
    tiers: list[str]
    calls: list[tuple[float, float]] = field(default_factory=list)
    checks: list[tuple[float, float]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _is_stopping: bool = False

    def start(self) -> Traffic:
        self._tasks = [asyncio.create_task(self._call()), asyncio.create_task(self._probe())]
        return self

    async def _call(self) -> None:
        request = api.PredictRequest(model_name="minilm", inputs=[api.PredictInput(text="hi")])
        async with grpc.aio.insecure_channel(self.gateway) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            while not self._is_stopping:
                sent_s = time.monotonic()
                try:
                    await stub.Predict(request, timeout=20.0)
                    self.calls.append((sent_s, time.monotonic() - sent_s))
                except grpc.aio.AioRpcError:
                    self.calls.append((sent_s, float("inf")))

    async def _probe(self) -> None:
        channels = [grpc.aio.insecure_channel(address) for address in self.tiers]
        stubs = [health_pb2_grpc.HealthStub(channel) for channel in channels]
        while not self._is_stopping:
            for stub in stubs:
                sent_s = time.monotonic()
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
                    is_ok = reply.status == SERVING
                except grpc.aio.AioRpcError:
                    is_ok = False
                self.checks.append((sent_s, time.monotonic() - sent_s if is_ok else float("inf")))
            await asyncio.sleep(0.05)  # the prober's pace
        for channel in channels:
            await channel.close()

    async def stop(self) -> None:
        self._is_stopping = True
        await asyncio.gather(*self._tasks)
