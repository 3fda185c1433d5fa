"""The whole fabric as a user runs it (`python -m services.local_stack`), and the Redis helper."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Collection
from pathlib import Path

import pytest
import redis
from grpc_health.v1 import health_pb2

from tests.support.processes import health_status
from tests.support.redis import RedisServer, start_redis
from tests.support.stack import start_stack

SERVING = health_pb2.HealthCheckResponse.SERVING


def client(server: RedisServer, *, socket_timeout_s: float = 5.0) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=socket_timeout_s)


def is_gone(pid: int) -> bool:
    """True once `pid` has exited. A zombie has exited too, unless it is our own child: that one
    we must reap ourselves, so it must not count as gone before we have."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return state == "Z" and int(ppid) != os.getpid()


def wait_gone(pids: Collection[int], timeout_s: float) -> list[int]:
    """Waits until every pid is gone; returns those still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    # Processes that are not our children cannot be waited for: look until they are gone.
    while True:
        alive = [pid for pid in pids if not is_gone(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def test_redis_helper_start_and_stop(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    db = client(server)
    assert db.ping()
    db.set("key", "value")
    assert db.get("key") == b"value"
    assert server.stop() == 0
    assert is_gone(server.pid)
    with pytest.raises(redis.ConnectionError):
        db.ping()


def test_redis_helper_restart_is_empty_on_the_same_port(redis_server: RedisServer) -> None:
    port = redis_server.port
    client(redis_server).set("key", "value")
    redis_server.restart()
    assert redis_server.port == port
    assert client(redis_server).get("key") is None


def test_redis_helper_restart_with_appendonly_keeps_data(tmp_path: Path) -> None:
    server = start_redis(tmp_path, appendonly=True)
    try:
        client(server).set("key", "value")
        server.restart()
        assert client(server).get("key") == b"value"
    finally:
        server.stop()


def test_redis_helper_kill_then_restart(redis_server: RedisServer) -> None:
    old_pid = redis_server.pid
    redis_server.kill()
    assert is_gone(old_pid)
    with pytest.raises(redis.ConnectionError):
        client(redis_server).ping()
    redis_server.restart()
    assert client(redis_server).ping()


def test_redis_helper_pause_and_resume(redis_server: RedisServer) -> None:
    db = client(redis_server, socket_timeout_s=0.3)
    assert db.ping()
    redis_server.pause()
    with pytest.raises(redis.TimeoutError):
        db.ping()
    redis_server.resume()
    assert client(redis_server).ping()


async def test_stack_starts_and_stops_leaving_no_process(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, num_workers=2, extra_worker_args=("--torch-threads=1",))
    try:
        assert len(stack.workers) == 2
        assert [w.worker_id for w in stack.workers] == ["worker-0", "worker-1"]
        for tier in (stack.gateway, stack.router, *stack.workers):
            assert await health_status(tier.address) == SERVING, tier
        assert redis.Redis(port=stack.redis_port, socket_timeout=5).ping()
    finally:
        exit_code = stack.stop()
    assert exit_code == 0, stack.log("launcher")
    # The launcher waited for every child, so all are gone the moment it exits.
    assert wait_gone(stack.pids().values(), timeout_s=0) == [], stack.pids()
    launcher_log = stack.log("launcher")
    assert "SIGTERM: stopping" in launcher_log


def test_launcher_killed_with_sigkill_leaves_no_children(tmp_path: Path) -> None:
    stack = start_stack(tmp_path)
    pids = stack.pids()
    stack.kill()
    # PR_SET_PDEATHSIG sends each child SIGTERM; each then drains (nothing in flight) and exits.
    alive = wait_gone(pids.values(), timeout_s=60)
    assert alive == [], {name: pid for name, pid in pids.items() if pid in alive}


def test_tier_exiting_on_its_own_stops_the_stack(tmp_path: Path) -> None:
    stack = start_stack(tmp_path)
    pids = stack.pids()
    os.kill(stack.workers[0].pid, signal.SIGKILL)
    assert stack.process.wait(120) == 1
    assert "worker-0 exited with code -9" in stack.log("launcher")
    assert wait_gone(pids.values(), timeout_s=0) == []


async def test_tolerate_exits_keeps_the_other_tiers_running(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, tolerate_exits=True)
    pids = stack.pids()
    os.kill(stack.workers[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    # The launcher's reaction shows only in its log.
    while "going on without it" not in stack.log("launcher") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "worker-0 exited with code -9" in stack.log("launcher")
    assert stack.process.poll() is None
    for tier in (stack.gateway, stack.router):
        assert await health_status(tier.address) == SERVING
    assert stack.stop() == 0, stack.log("launcher")
    assert wait_gone(pids.values(), timeout_s=0) == []
