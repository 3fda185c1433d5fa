"""The simulator's parts that start processes: a sharded run (one process per shard), the plots
(matplotlib runs `fc-list` to build its font cache on a fresh machine), and the check, in a fresh
interpreter, that neither simulator imports asyncio or gRPC (the simulated clock drives the same
pure policies the services' event loops drive)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.sim.__main__ import main
from services.sim.report import write_outputs
from services.sim.shards import run_sharded
from services.sim.simulation import run
from tests.unit.test_sim_quotas import make_scenario as make_tenant_scenario
from tests.unit.test_sim_run import SCENARIOS, make_scenario

pytestmark = pytest.mark.integration


def test_a_sharded_run_merges_its_shards_measurements() -> None:
    scenario = make_scenario(fleet={"workers": 4, "cell_size": 2}, duration_s=3)
    summary = run_sharded(scenario, 2)
    assert summary["shards"] == 2
    assert summary["offered_per_s"] == pytest.approx(500, rel=0.15)
    assert summary["answered"] == pytest.approx(summary["offered_per_s"] * 2, rel=0.01)
    assert summary["max_replicas"] == 4
    assert summary["worker_hours"] == pytest.approx(4 * 3 / 3600)
    assert summary["latency_ms"]["p50"] <= summary["latency_ms"]["p99"] <= 200


def test_a_shard_enforces_its_part_of_each_fleet_wide_limit() -> None:
    """Two shards, each with half of tenant b's 200 requests/s: together they serve 200/s of it
    (tests/unit/test_sim_quotas.py checks each shard's half of every limit)."""
    scenario = make_tenant_scenario(
        fleet={"workers": 2, "cell_size": 1},
        tenants={"b": {"requests_per_s": 200, "burst_s": 0.5}},
    )
    summary = run_sharded(scenario, 2)
    assert summary["goodput_per_s_by_tenant"]["b"] == pytest.approx(200, rel=0.1)
    assert summary["p99_ms_by_tenant"]["a"] <= 200


def test_a_run_writes_its_summary_and_series(tmp_path: Path) -> None:
    result = run(make_scenario())
    paths = write_outputs(result, tmp_path)
    assert {p.name for p in paths} == {
        "summary.json",
        "latency.csv",
        "replicas.csv",
        "latency.png",
        "replicas.png",
    }
    for png in ("latency.png", "replicas.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["scenario"] == "small"
    header, *rows = (tmp_path / "latency.csv").read_text().splitlines()
    assert header == "t_s,rate,goodput,p50,p99"
    assert len(rows) >= 6


def test_the_simulator_never_imports_asyncio_or_grpc() -> None:
    code = (
        "import sys, services.sim.__main__\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('asyncio', 'grpc'))\n"
        "assert not bad, bad\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_the_generation_simulator_never_imports_asyncio_or_grpc() -> None:
    code = (
        "import sys, services.sim.generation, services.sim.generation_run\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('asyncio', 'grpc'))\n"
        "assert not bad, bad\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_the_command_line_runs_a_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole command, plots included (here, not in tests/unit: see the module's note)."""
    status = main(
        ["run", str(SCENARIOS / "steady.toml"), "--duration-s", "8", "--out", str(tmp_path)]
    )
    assert status == 0
    assert "goodput (req/s, within SLO)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["offered_per_s"] > 0  # past the scenario's 5 s warm-up
    assert summary["goodput_per_s"] > 0
