"""The whole fabric as a user runs it (`python -m services.local_stack`), and the Redis helper.

Each stack test starts a stack of its own: the launcher's life is what it tests (started with
two workers and stopped, started pinned to CPUs, killed with SIGKILL, losing a tier with and
without --tolerate-exits), so no two of them can share one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Collection
from pathlib import Path

import pytest
import redis
from grpc_health.v1 import health_pb2

from services.common.procfs import read_stat
from tests.support.processes import health_status
from tests.support.redis import RedisServer, start_redis
from tests.support.stack import start_stack
from tests.support.waiting import eventually, eventually_sync

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING


def client(server: RedisServer, *, socket_timeout_s: float = 5.0) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=socket_timeout_s)


def is_gone(pid: int) -> bool:
    """True once `pid` has exited. A zombie has exited too, unless it is our own child: that one
    we must reap ourselves, so it must not count as gone before we have."""
    stat = read_stat(pid)
    return stat is None or (stat.state == "Z" and stat.parent_pid != os.getpid())


def alive(pids: Collection[int]) -> list[int]:
    return [pid for pid in pids if not is_gone(pid)]


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
    assert client(redis_server, socket_timeout_s=5).ping()
    redis_server.pause()
    # A connection to a stopped Redis is accepted by the kernel; its first reply never comes.
    with pytest.raises(redis.TimeoutError):
        client(redis_server, socket_timeout_s=0.3).ping()
    redis_server.resume()
    assert client(redis_server).ping()


async def test_stack_starts_and_stops_leaving_no_process(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, num_workers=2, extra_worker_args=("--torch-threads=1",))
    try:
        assert len(stack.workers) == 2
        assert [w.worker_id for w in stack.workers] == ["worker-0", "worker-1"]
        for tier in (stack.gateway, stack.router, *stack.workers):
            assert await health_status(tier.address) == SERVING, tier
        assert redis.Redis.from_url(stack.redis_url, socket_timeout=5).ping()
        # The banner's first examples run as printed, from where `make run` runs.
        banner = stack.log("launcher").partition("\ntry:\n")[2].partition("\nand, with grpcurl")[0]
        examples = [line.strip() for line in banner.splitlines()]
        assert len(examples) == 2 and "services.client" in examples[0], banner
        outputs = [
            await run_example(example, cwd=Path(__file__).resolve().parents[2])
            for example in examples
        ]
        embedded = json.loads(outputs[0])
        assert embedded["text"] == "hello world" and embedded["dims"] == 384, outputs[0]
        assert json.loads(outputs[1])["name"] == "minilm", outputs[1]
    finally:
        exit_code = stack.stop()
    assert exit_code == 0, stack.log("launcher")
    # The launcher waited for every child, so all are gone the moment it exits.
    assert alive(stack.pids().values()) == [], stack.pids()
    launcher_log = stack.log("launcher")
    assert "SIGTERM: stopping" in launcher_log


def test_tiers_pinned_to_cpus_run_every_thread_there(tmp_path: Path) -> None:
    """`--cpus`: the worker on one CPU, the CPU tiers on another (the deployment's separate
    nodes, on one machine); every thread of every tier, started before or after it was
    ready, keeps to its CPUs."""
    available = sorted(os.sched_getaffinity(0))
    low, high = available[0], available[-1]
    stack = start_stack(
        tmp_path,
        launcher_args=("--cpus", f"worker={high}", "--cpus", f"gateway,router,redis,jobs={low}"),
    )
    try:
        pids = stack.pids()
        for name, pid in pids.items():
            expected = {high} if name.startswith("worker") else {low}
            threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
            assert len(threads) > 1 or name == "redis", (name, threads)
            for tid in threads:
                try:
                    affinity = os.sched_getaffinity(tid)
                except ProcessLookupError:
                    continue  # the thread ended since the listing: nothing left to check
                assert affinity == expected, (name, tid)
        assert os.sched_getaffinity(stack.launcher.process.pid) == set(available)
    finally:
        assert stack.stop() == 0, stack.log("launcher")


async def run_example(command: str, *, cwd: Path) -> str:
    """Runs one of the banner's example commands in a shell, as a user pastes it."""
    process = await asyncio.create_subprocess_shell(
        command, cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, f"{command}: {stderr.decode()}"
    return stdout.decode()


def test_launcher_killed_with_sigkill_leaves_no_children(tmp_path: Path) -> None:
    stack = start_stack(tmp_path)
    pids = stack.pids()
    stack.kill()
    # PR_SET_PDEATHSIG sends each child SIGTERM; each then drains (nothing in flight) and exits.
    # They are not our children: they cannot be waited for, only looked for.
    eventually_sync(
        lambda: alive(pids.values()) == [], timeout_s=60, interval_s=0.1, message=str(pids)
    )


def test_tier_exiting_on_its_own_stops_the_stack(tmp_path: Path) -> None:
    stack = start_stack(tmp_path)
    pids = stack.pids()
    os.kill(stack.workers[0].pid, signal.SIGKILL)
    assert stack.process.wait(120) == 1
    assert "worker-0 exited with code -9" in stack.log("launcher")
    assert alive(pids.values()) == []


async def test_tolerate_exits_keeps_the_other_tiers_running(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, tolerate_exits=True)
    pids = stack.pids()
    os.kill(stack.workers[0].pid, signal.SIGKILL)
    # The launcher's reaction shows only in its log.
    await eventually(lambda: "going on without it" in stack.log("launcher"), timeout_s=30)
    assert "worker-0 exited with code -9" in stack.log("launcher")
    assert stack.process.poll() is None
    for tier in (stack.gateway, stack.router):
        assert await health_status(tier.address) == SERVING
    assert stack.stop() == 0, stack.stop_report()
    assert alive(pids.values()) == []


def test_a_closed_terminal_stops_the_stack_in_order(tmp_path: Path) -> None:
    """SIGHUP (the terminal `make run` ran in closed) stops every tier in order, as ^C does:
    it used to kill the launcher at once, its tiers then stopped by their parent-death signal
    all together, out of order. (Started under nohup, which ignores SIGHUP, it keeps running.)"""
    # The launcher inherits SIGHUP's disposition: default here, whatever ran this suite.
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        stack = start_stack(tmp_path)
    finally:
        signal.signal(signal.SIGHUP, previous)
    stack.process.send_signal(signal.SIGHUP)
    try:
        exit_code = stack.process.wait(timeout=60)
    finally:
        if stack.process.poll() is None:
            stack.stop()
    assert exit_code == 0, stack.log("launcher")
    assert alive(stack.pids().values()) == [], stack.pids()
    assert "SIGHUP: stopping" in stack.log("launcher")
