"""Small scenarios run end to end through the fleet, and their outputs are sane; the planner
and the command line. (A sharded run's processes and the import check are in
tests/integration/test_sim_processes.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.sim.__main__ import main
from services.sim.planner import closed_form, plan
from services.sim.scenario import load_scenario, parse_scenario
from services.sim.shards import shard_of
from services.sim.simulation import Scenario, run
from tests.support.plans import assert_fewest_meeting

pytestmark = pytest.mark.unit

SCENARIOS = Path(__file__).resolve().parents[2] / "services" / "sim" / "scenarios"


def make_scenario(**overrides: Any) -> Scenario:
    """2 workers, 500 req/s for 6 s of a curve each worker serves ~2,000 rows/s of."""
    raw: dict[str, Any] = {
        "name": "small",
        "duration_s": 6,
        "warmup_s": 1,
        "curve": {"fixed_ms": 5.0, "per_token_us": 20.0},
        "model": {"name": "m", "slo_ms": 200, "max_batch_size": 32, "length_buckets": [16, 64]},
        "fleet": {"workers": 2},
        "traffic": {"streams": [{"rate_per_s": 500, "lengths": [[12, 0.8], [50, 0.2]]}]},
    }
    raw.update(overrides)
    return parse_scenario(raw, base_dir=Path("."), default_name="small")


def test_a_lightly_loaded_fleet_answers_everything_within_the_slo() -> None:
    summary = run(make_scenario()).summary
    assert summary["offered_per_s"] == pytest.approx(500, rel=0.1)
    assert summary["refusals"] == {}
    assert summary["slo_attainment"] == 1.0
    assert summary["goodput_per_s"] == pytest.approx(summary["offered_per_s"])
    latency = summary["latency_ms"]
    # At least one batch of compute (5 ms + 12 tokens x 20 us), at most the SLO.
    assert 5.2 < latency["p50"] <= latency["p99"] <= 200
    rows = sum(int(size) * n for size, n in summary["batch_sizes"].items())
    assert rows >= summary["answered"]
    assert summary["worker_hours"] == pytest.approx(2 * 6 / 3600)
    assert summary["max_replicas"] == summary["final_replicas"] == 2


def test_an_overloaded_worker_refuses_rather_than_answering_late() -> None:
    summary = run(make_scenario(fleet={"workers": 1}, duration_s=4, traffic={
        "streams": [{"rate_per_s": 6000, "timeout_ms": 200}]
    })).summary  # fmt: skip
    assert sum(summary["refusals"].values()) > 0.2 * summary["offered_per_s"] * 3
    assert summary["latency_ms"]["p99"] <= 200 + 10
    assert summary["mean_batch_size"] > 16


def test_a_worker_lost_mid_run_costs_retries_not_the_slo() -> None:
    scenario = make_scenario(
        fleet={"workers": 3}, worker_loss=[{"at_s": 3.0, "num_workers": 1}], duration_s=8
    )
    result = run(scenario)
    assert result.fleet.num_replicas == 2
    assert result.summary["slo_attainment"] > 0.99
    assert result.summary["worker_hours"] == pytest.approx((3 * 3 + 2 * 5) / 3600)


def test_the_hpa_adds_workers_when_queue_wait_exceeds_its_target() -> None:
    scenario = make_scenario(
        duration_s=25,
        fleet={"workers": 1, "startup_s": 5},
        hpa={"metric": "queue_wait", "target": 0.002, "min_replicas": 1, "max_replicas": 8},
        traffic={"streams": [{"rate_per_s": 1500}]},
    )
    result = run(scenario)
    counts = [replicas for _, replicas, _ in result.recorder.replicas]
    assert counts[0] == 1
    assert max(counts) > 1
    assert result.recorder.hpa_metric


def test_the_planner_finds_the_fewest_workers_meeting_the_slo() -> None:
    scenario = make_scenario(duration_s=4, traffic={"streams": [{"rate_per_s": 4000}]})
    answer = plan(scenario, percentile=99, headroom=0.0, max_workers=16)
    workers = assert_fewest_meeting(answer)
    assert workers >= closed_form(scenario, headroom=0.0).workers
    assert answer.hpa_queue_wait_target_ms is not None
    assert answer.hpa_backlog_target_ms is not None
    assert 0.0 <= answer.hpa_backlog_target_ms <= answer.hpa_queue_wait_target_ms


def test_a_shard_is_an_equal_part_of_the_fleet_and_its_traffic() -> None:
    scenario = make_scenario(fleet={"workers": 4, "cell_size": 2})
    shard = shard_of(scenario, 1, 2)
    assert shard.fleet.workers == 2
    assert shard.traffic.total_rate_per_s(0.0) == pytest.approx(250.0)
    assert shard.seed != shard_of(scenario, 0, 2).seed
    with pytest.raises(ValueError, match="fixed fleet"):
        shard_of(make_scenario(hpa={"target": 0.01}), 0, 2)
    with pytest.raises(ValueError, match="do not split"):
        shard_of(make_scenario(fleet={"workers": 3}), 0, 2)
    # With tier costs each shard's gateways and routers queue only its part of the traffic.
    tiered = {"workers": 4, "gateways": 4, "routers": 2,
              "tier_cpu": {"gateway_s_per_request": 0.001}}  # fmt: skip
    shard = shard_of(make_scenario(fleet=tiered), 0, 2)
    assert (shard.fleet.gateways, shard.fleet.routers) == (2, 1)
    with pytest.raises(ValueError, match="must each split"):
        shard_of(make_scenario(fleet={**tiered, "routers": 3}), 0, 2)


def test_a_scenario_reads_the_curve_bench_model_writes(tmp_path: Path) -> None:
    points = [
        {"num_tokens": tokens, "batch_size": size, "sequences_per_s": size / (0.004 + 1e-5 * size)}
        for tokens in (16, 64)
        for size in (1, 8, 32)
    ]
    (tmp_path / "raw_model.json").write_text(json.dumps({"device": "cpu", "points": points}))
    (tmp_path / "s.toml").write_text(
        'latency_curve = "raw_model.json"\ncurve_scale = 0.5\nduration_s = 2\nwarmup_s = 0.5\n'
        '[model]\nname = "m"\nlength_buckets = [16, 64]\n'
        "[[traffic.streams]]\nrate_per_s = 200\n"
    )
    scenario = load_scenario(tmp_path / "s.toml")
    assert scenario.curve.scale == 0.5
    assert dict(scenario.curve.points)[(16, 8)] == pytest.approx(0.004 + 8e-5)
    key = scenario.model.key(16)
    # The executor's truth is the measured curve times curve_scale (a GPU twice as fast).
    assert scenario.curve.truth({16: key}).predict(key, 8) == pytest.approx(0.5 * (0.004 + 8e-5))
    summary = run(scenario).summary
    assert summary["slo_attainment"] == 1.0
    assert summary["answered"] > 200


def test_every_shipped_scenario_file_parses() -> None:
    files = sorted(SCENARIOS.glob("*.toml"))
    assert len(files) >= 8
    for path in files:
        assert load_scenario(path).name == path.stem


def test_the_command_line_reports_a_bad_scenario(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\n[model]\nname = "m"\nslo = 1\n')
    assert main(["run", str(bad)]) == 2
