"""bench.spread in a tiny setting: the stand-in stack with two gateway processes and two routers
(`services.local_stack --num-routers`), loaded by two generator processes. Its figures are the
benchmark's; the test checks that the spread happened and that every figure was measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fabric.stack import REPO_ROOT

pytestmark = pytest.mark.e2e


def test_the_spread_stack_serves_from_every_router_and_reports_each_tier(tmp_path: Path) -> None:
    output = tmp_path / "spread.json"
    subprocess.run(
        [
            sys.executable, "-m", "bench.spread", "--stand-in",
            "--gateway-processes", "2", "--routers", "2", "--generators", "2",
            "--rates", "100", "--warmup-s", "1", "--window-s", "2",
            "--state-dir", str(tmp_path / "state"), "--output", str(output),
        ],
        cwd=REPO_ROOT,
        check=True,
        timeout=240,
    )  # fmt: skip
    report = json.loads(output.read_text())
    assert (report["gateway_processes"], report["routers"], report["generators"]) == (2, 2, 2)
    # The gateway spread its calls over both routers.
    assert sorted(report["routed_by_router"]) == ["router-0", "router-1"]
    assert all(count > 0 for count in report["routed_by_router"].values())
    (rate,) = report["rates"]
    # Every call sent in the window ended with a status, and some were served (how many is the
    # benchmark's figure: a loaded machine may refuse or time out some).
    assert rate["sent_in_window"] > 0
    assert sum(rate["statuses"].values()) == rate["sent_in_window"]
    assert rate["statuses"].get("OK", 0) > 0
    assert set(rate["cpu_ms_per_request"]) == {"gateway", "router", "worker"}
    assert all(ms > 0 for ms in rate["cpu_ms_per_request"].values())
    # Each tier's busiest event loop (a process's first thread) used at most all of a core,
    # the gateway's some of it (a router's may use under one 10 ms clock tick in the window).
    loops = rate["busiest_loop_cores"]
    assert set(loops) == {"gateway", "router", "worker"}
    assert all(0 <= cores <= 1.05 for cores in loops.values())
    assert loops["gateway"] > 0
    assert report["raw"]["sequences_per_s"] > 0
