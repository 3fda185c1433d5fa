"""What the process may use of the machine, within a container's cgroup v2 limits (the cgroup
files written to a temporary directory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common.procfs import usable_cpus

pytestmark = pytest.mark.unit


def test_a_containers_cpu_limit_bounds_the_cpus_it_may_use(tmp_path: Path) -> None:
    """`--processes 0` starts a gateway per usable CPU: on a 64-core node a pod limited to 2
    CPUs must start 2, not 64 (before, the CPU limit was not read)."""
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # no cgroup files: every CPU it may run on
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: one process
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{(affinity + 5) * 100000} 100000\n")
    assert usable_cpus(tmp_path) == affinity  # a limit above the CPUs it may run on


def test_a_processs_threads_are_read_with_their_cpu_and_switches() -> None:
    """read_threads: the main thread (its id the process's), a thread this test starts, each
    with its CPU seconds and its context switches; a thread that burns CPU is seen doing so,
    one that waits is seen giving up its core; nothing for a process that is gone."""
    import threading
    import time

    from services.common.procfs import read_threads

    spun, done = threading.Event(), threading.Event()
    started: list[int] = []

    def spin() -> None:
        started.append(threading.get_native_id())
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait()

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert spun.wait(timeout=30)
        threads = {t.tid: t for t in read_threads(os.getpid())}
        time.sleep(0.05)  # the main thread waits: it gives up its core
        later = {t.tid: t for t in read_threads(os.getpid())}
    finally:
        done.set()
        thread.join()
    main = threads[os.getpid()]  # the main thread's id is the process's
    assert later[os.getpid()].voluntary_switches > main.voluntary_switches
    assert later[os.getpid()].start_ticks == main.start_ticks > 0
    spinner = threads[started[0]]
    assert spinner.cpu_s >= 0.1  # it spun 0.2 s of its own CPU (ticks of 10 ms)
    assert spinner.start_ticks >= main.start_ticks  # started after it
    assert read_threads(2**22 + 1) == []  # past pid_max: no such process
