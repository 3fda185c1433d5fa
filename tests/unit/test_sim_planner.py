"""The planner's gateway count (peak offered rate, headroom, gateway_rps) and its HPA targets,
taken where the plan holds: the planned count under the scenario's own traffic."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from services.sim.__main__ import main
from services.sim.plan_text import format_plan
from services.sim.planner import gateway_plan, plan
from services.sim.scenario import load_scenario, parse_scenario
from services.sim.simulation import Scenario, run
from services.sim.traffic import Arrival, Traffic
from tests.support.plans import assert_fewest_meeting

pytestmark = pytest.mark.unit


def make_scenario(**overrides: Any) -> Scenario:
    raw: dict[str, Any] = {
        "name": "small",
        "duration_s": 4,
        "warmup_s": 1,
        "curve": {"fixed_ms": 5.0, "per_token_us": 20.0},
        "model": {"name": "m", "slo_ms": 200, "max_batch_size": 32, "length_buckets": [16, 64]},
        "fleet": {"workers": 2},
        "traffic": {"streams": [{"rate_per_s": 2000, "lengths": [[12, 0.8], [50, 0.2]]}]},
    }
    raw.update(overrides)
    return parse_scenario(raw, base_dir=Path("."), default_name="small")


def test_gateways_are_sized_on_the_peak_rate_with_headroom() -> None:
    burst = {"start_s": 2.0, "duration_s": 1.0, "multiplier": 3.0}
    scenario = make_scenario(traffic={"streams": [{"rate_per_s": 2000}], "bursts": [burst]})
    answer = gateway_plan(scenario, headroom=0.2, gateway_rps=3000)
    assert answer.peak_offered_per_s == pytest.approx(6000)
    assert answer.gateways == 3  # ceil(6000 x 1.2 / 3000)
    assert gateway_plan(scenario, headroom=0.0, gateway_rps=3000).gateways == 2
    assert gateway_plan(scenario, headroom=0.0, gateway_rps=1e6).gateways == 1


def test_a_burst_shorter_than_the_sampling_step_still_sets_the_peak() -> None:
    burst = {"start_s": 1.03, "duration_s": 0.02, "multiplier": 10.0}
    scenario = make_scenario(traffic={"streams": [{"rate_per_s": 100}], "bursts": [burst]})
    assert gateway_plan(scenario, headroom=0.0, gateway_rps=100).peak_offered_per_s == 1000


def test_a_traces_peak_is_its_busiest_second() -> None:
    times = [0.1, 0.5, 1.2, 1.3, 1.4, 1.9, 3.5]
    trace = tuple(Arrival(t, "m", "a", "interactive", 12) for t in times)
    scenario = dataclasses.replace(make_scenario(), traffic=Traffic(trace=trace))
    answer = gateway_plan(scenario, headroom=0.5, gateway_rps=2)
    assert answer.peak_offered_per_s == 4
    assert answer.gateways == 3


def test_gateway_rps_comes_from_the_fleet_table_unless_given() -> None:
    scenario = make_scenario(fleet={"workers": 2, "gateway_rps": 500.0})
    answer = plan(scenario, headroom=0.0, max_workers=8)
    assert answer.gateways.gateway_rps == 500.0
    assert answer.gateways.gateways == 4  # 2000 / 500
    assert plan(scenario, headroom=0.0, max_workers=8, gateway_rps=1000).gateways.gateways == 2


def test_hpa_targets_are_measured_at_the_plan_under_the_scenarios_own_traffic() -> None:
    scenario = make_scenario()
    answer = plan(scenario, headroom=0.5, max_workers=16)
    assert answer.workers is not None
    fleet = dataclasses.replace(scenario.fleet, workers=answer.workers)
    own = run(dataclasses.replace(scenario, fleet=fleet)).summary
    assert answer.hpa_backlog_target_ms == own["mean_backlog_ms"]
    assert answer.hpa_queue_wait_target_ms == own["mean_queue_wait_ms"]
    # The deployed HPA's target: the p90 of the same run.
    assert answer.hpa_p90_queue_wait_target_ms == own["p90_queue_wait_ms"]
    text = format_plan(answer, percentile=99, headroom=0.5, slo_ms=200)
    assert f"{answer.gateways.gateways} gateways" in text
    assert f"target {answer.hpa_p90_queue_wait_target_ms:.1f} ms" in text


def test_the_command_line_plans_workers_and_gateways(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        "duration_s = 3\nwarmup_s = 1\n[curve]\nfixed_ms = 5.0\nper_token_us = 20.0\n"
        '[model]\nname = "m"\nslo_ms = 200\nlength_buckets = [16]\n'
        "[[traffic.streams]]\nrate_per_s = 1000\n"
    )
    status = main(["plan", str(path), "--headroom", "0", "--gateway-rps", "400"])
    assert status == 0
    out = capsys.readouterr().out
    assert "1000 x 1.00 / 400 -> 3 gateways" in out
    (plan_line,) = [line for line in out.splitlines() if line.startswith("plan: ")]
    assert plan_line.endswith(", 3 gateways")


def test_the_h200_scenario_plans_from_the_gpu_curve_measured_there() -> None:
    """scenarios/plan_h200.toml reads curves/minilm_h200.json (`make bench-model` on an H200)."""
    path = Path(__file__).resolve().parents[2] / "services" / "sim" / "scenarios" / "plan_h200.toml"
    scenario = dataclasses.replace(load_scenario(path), duration_s=3.0, warmup_s=1.0)
    curve = dict(scenario.curve.points)
    assert {bucket for bucket, _ in curve} == {16, 32, 64, 128, 256}
    # A GPU's curve: 64 short rows cost a few times one row, not 64 times as on a CPU.
    assert curve[(16, 64)] < 4 * curve[(16, 1)]
    answer = plan(scenario, percentile=99, headroom=0.2, max_workers=8)
    assert_fewest_meeting(answer)
