"""The load generator's own scheduling: ahead of the stack it measures, on a share of the CPUs
(bench.fabric.measure runs its floods under `generator_priority`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: Nice value used when real-time scheduling is not permitted (or not asked for).
GENERATOR_NICE = -5


def _set_all_threads(policy: int, nice: int, cpus: set[int] | None = None) -> None:
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        with contextlib.suppress(ProcessLookupError):  # a thread may exit meanwhile
            priority = 1 if policy == os.SCHED_RR else 0
            os.sched_setscheduler(tid, policy, os.sched_param(priority))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            if cpus is not None:
                os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def generator_priority(mode: str) -> Iterator[str]:
    """Runs every thread of this process ahead of the stack for the duration, then back to
    normal. `mode`: "rr" (SCHED_RR, lowest real-time priority, on a quarter of the CPUs, at
    least one, when there are several; falls back to "nice" where not permitted), "nice"
    (nice GENERATOR_NICE; needs root too), "none". Yields what was applied.

    Why: a client on the server's own cores competes with it; a saturated server would delay
    the sends (at nice 0 a few % leave > 5 ms late, which voids the window), and the run would
    measure the generator. Real clients sit on other machines. Going first costs the stack
    more than the generator's CPU, though: each send preempts whatever stack thread shares its
    CPU. Below capacity, where an ordinary generator keeps its schedule, bench.fabric's sweeps
    run it as one (`Settings.loadgen_priority_below_capacity`; bench.fabric.tenants, whose
    flood shares the run, keeps it ahead): at 2,800 calls/s on the stand-in
    stack, SCHED_RR left 85-87% of calls good (the door refused the rest), normal priority
    100%, alternating twice (docs/benchmarks.md).

    Why not every CPU: a real-time generator may take any core at any moment, and past capacity
    (a flood at 2x needs most of a core here) it preempts the stack's threads wherever they
    run, which a client on another machine never does. Measured on 2 cores with the GPU-speed
    stand-in: unpinned, a 2x flood stalled the gateway's intake even at 8 calls in flight;
    confined to one CPU of the two, the generator still sends on time and the stack keeps
    the other."""
    applied = "default"
    all_cpus = os.sched_getaffinity(0)
    # A quarter of the CPUs, at least one: one of this machine's two; four of a 16-core box's,
    # where a generator on one core could not keep its schedule at GPU-box rates.
    own_cpus = set(sorted(all_cpus)[-max(1, len(all_cpus) // 4) :]) if len(all_cpus) > 1 else None
    for candidate in {"rr": ("rr", "nice"), "nice": ("nice",)}.get(mode, ()):
        try:
            if candidate == "rr":
                _set_all_threads(os.SCHED_RR, 0, own_cpus)
                applied = "SCHED_RR" if own_cpus is None else f"SCHED_RR on CPUs {sorted(own_cpus)}"
            else:
                _set_all_threads(os.SCHED_OTHER, GENERATOR_NICE)
                applied = f"nice {GENERATOR_NICE}"
            break
        except PermissionError:
            continue
    try:
        yield applied
    finally:
        if applied != "default":
            with contextlib.suppress(OSError):
                _set_all_threads(os.SCHED_OTHER, 0, all_cpus)
