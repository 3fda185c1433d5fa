"""What Linux's /proc says about processes and the machine: CPU seconds, parents, states.

Mostly for whoever watches the tiers from outside (the benchmark's CPU accounting, tests
checking that no process outlives the stack); a worker reads the memory it may still take
before a hot load (services.gpu_worker.memory_budget).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """One process's line of /proc/<pid>/stat, the fields we use."""

    #: The command name, truncated by the kernel to 15 characters.
    name: str
    #: R running, S sleeping, D disk wait, Z zombie, T stopped, ...
    state: str
    parent_pid: int
    #: User + system CPU seconds of every thread of the process.
    cpu_s: float
    #: When it started, in clock ticks since boot: a pid (or thread id) reused by a later
    #: process (or thread) has another.
    start_ticks: int = 0


@dataclass(frozen=True)
class ThreadStat:
    """One thread of a process (/proc/<pid>/task/<tid>), the fields we use."""

    tid: int
    #: The thread's name: a Python thread's is the interpreter's (`python`), grpc's own
    #: threads name themselves (`event_engine`, ...).
    name: str
    #: User + system CPU seconds of this thread.
    cpu_s: float
    #: Times it gave up its core to wait (I/O, a lock, a timer), and times it was preempted.
    voluntary_switches: int
    involuntary_switches: int
    #: When it started (ProcStat.start_ticks): a thread id reused by a later thread has another.
    start_ticks: int = 0


def read_stat(pid: int) -> ProcStat | None:
    """The process's stat; None once it is gone (reaped)."""
    return _read_stat(f"/proc/{pid}/stat")


def _read_stat(path: str) -> ProcStat | None:
    try:
        with open(path) as stat:
            text = stat.read()
        # The command name may hold spaces and parentheses: the fields start after the last ')'.
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
        start_ticks = int(fields[19])  # starttime (field 22)
    except (OSError, ValueError, IndexError):  # gone, or gone while being read
        return None
    return ProcStat(name, fields[0], int(fields[1]), ticks / _CLK_TCK, start_ticks)


def read_thread_stat(pid: int, tid: int) -> ProcStat | None:
    """One thread's stat (its own CPU seconds; `read_thread_stat(pid, pid)`: the process's
    first thread); None once it is gone."""
    return _read_stat(f"/proc/{pid}/task/{tid}/stat")


def read_threads(pid: int) -> list[ThreadStat]:
    """Every thread of `pid` still there (none once the process is gone)."""
    try:
        tids = sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []
    threads = []
    for tid in tids:
        stat = read_thread_stat(pid, tid)
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                lines = dict(line.split(":", 1) for line in status if ":" in line)
            switches = (int(lines["voluntary_ctxt_switches"]),
                        int(lines["nonvoluntary_ctxt_switches"]))  # fmt: skip
        except (OSError, KeyError, ValueError):  # the thread ended while being read
            continue
        if stat is not None:
            threads.append(ThreadStat(tid, stat.name, stat.cpu_s, *switches, stat.start_ticks))
    return threads


def is_alive(pid: int) -> bool:
    """True while `pid` exists and has not exited (a zombie its parent has yet to reap has);
    never raises, whenever the process goes."""
    stat = read_stat(pid)
    return stat is not None and stat.state not in ("Z", "X")


def descendants(root: int) -> list[int]:
    """Every live process under `root` (children, grandchildren...), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None:
                children.setdefault(stat.parent_pid, []).append(int(entry))
    found: list[int] = []
    frontier = [root]
    while frontier:
        pid = frontier.pop(0)
        found += children.get(pid, [])
        frontier += children.get(pid, [])
    return found


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (every core), from /proc/stat."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    with open("/proc/loadavg") as loadavg:
        return [float(v) for v in loadavg.read().split()[:3]]


def available_memory_bytes(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory new allocations can take without swapping: the machine's (MemAvailable), and in
    a container with a memory limit (cgroup v2, `cgroup` its directory) no more than the limit
    leaves beside the container's working set (what it uses less the page cache the kernel
    can drop, as the kubelet counts it): past that limit the container is OOM-killed, however
    much the machine has free."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
        else:
            raise OSError("/proc/meminfo has no MemAvailable")
    room = _cgroup_room_bytes(cgroup)
    return available if room is None else min(available, room)


def _cgroup_room_bytes(cgroup: Path) -> int | None:
    """memory.max less the working set; None without a limit (or without cgroup v2)."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        current = int((cgroup / "memory.current").read_text())
        stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
        working_set = current - int(stat.get("inactive_file", 0))
        return max(0, int(limit) - working_set)
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: those it may run on, and in a container with a CPU limit
    (cgroup v2 `cpu.max`, `cgroup` its directory) no more than the limit, rounded up. A pod
    limited to 2 CPUs on a 64-core node may run on all 64, but gets 2 CPUs' time."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus
