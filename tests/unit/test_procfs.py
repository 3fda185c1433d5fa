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
