"""Servers of the per-call CPU benchmarks (`bench.stream_floor`, `bench.registered_methods`):
each in a fresh interpreter (grpc does not survive a fork of a process using it), on a
loopback port it reports, until told to stop; and the CPU a process has used, and its threads'
context switches."""

from __future__ import annotations

import asyncio
import multiprocessing
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import grpc

from services.common.procfs import read_stat

PROCESSES = multiprocessing.get_context("spawn")


async def serve_until(server: grpc.aio.Server, ports: Any, stop: Event) -> None:
    """Starts `server` on a loopback port, puts the port on `ports`, and stops the server once
    `stop` is set."""
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ports.put(port)
    while not stop.is_set():
        await asyncio.sleep(0.05)
    await server.stop(0)


def start_server(target: Any, *args: Any) -> tuple[multiprocessing.Process, int, Event]:
    """Runs `target(*args, ports, stop)` (which calls `serve_until`) in a spawned process;
    returns the process, the port it reported and its stop event. A daemon: a benchmark that
    fails midway does not wait for it on exit."""
    ports: Any = PROCESSES.Queue()
    stop = PROCESSES.Event()
    process = PROCESSES.Process(target=target, args=(*args, ports, stop), daemon=True)
    process.start()
    try:
        return process, ports.get(timeout=60), stop
    except BaseException:
        process.terminate()
        raise


def stop_servers(servers: list[tuple[multiprocessing.Process, int, Event]]) -> None:
    """Stops each server in turn, and ends one that has not stopped within 10 s."""
    for process, _, event in servers:
        event.set()
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()


def cpu_s(pid: int | None) -> float:
    """CPU seconds process `pid` has used; raises if it is gone."""
    stat = None if pid is None else read_stat(pid)
    if stat is None:
        raise RuntimeError(f"process {pid} is gone")
    return stat.cpu_s


def thread_switches(pid: int) -> dict[int, int]:
    """Context switches of each thread of process `pid` so far, voluntary and involuntary
    together, by thread id (`switches_between` reads two of these); a thread gone while it is
    read is left out."""
    switches: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        count = 0
        for line in status.splitlines():
            name, _, value = line.partition(":")
            if name in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                count += int(value)
        switches[int(task.name)] = count
    return switches


def switches_between(pid: int, before: dict[int, int], after: dict[int, int]) -> tuple[int, int]:
    """The switches from `before` to `after` (`thread_switches` of `pid`): its main thread's
    (where a grpc.aio server's event loop runs), and its other threads' (grpc's
    completion-queue poller and its engine's threads: each of theirs counts a wake-up),
    thread by thread: a thread that began meanwhile counts from 0, one that ended is left out
    (its last count is unknown)."""
    main = after.get(pid, 0) - before.get(pid, 0)
    others = sum(count - before.get(tid, 0) for tid, count in after.items() if tid != pid)
    return main, others
