"""`--set table.key=V1,V2` overrides of a scenario file's mapping, and the sweep over them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.sim.__main__ import main
from services.sim.scenario import load_scenario
from services.sim.scenario_overrides import parse_setting, with_overrides
from services.sim.simulation import Scenario
from services.sim.sweep import SweepRow, best, format_sweep, sweep

pytestmark = pytest.mark.unit

SCENARIO = """\
name = "linger"
duration_s = 3
warmup_s = 1
[curve]
fixed_ms = 5.0
per_token_us = 20.0
[model]
name = "m"
slo_ms = 100
max_batch_size = 32
length_buckets = [16]
[batching]
max_wait_cap_s = 0.01
min_expected_arrivals = 0.0
[[traffic.streams]]
rate_per_s = 1500
"""


@pytest.fixture
def scenario_path(tmp_path: Path) -> Path:
    path = tmp_path / "linger.toml"
    path.write_text(SCENARIO)
    return path


def make_row(value: float, *, goodput: float, p99_ms: float) -> SweepRow:
    return SweepRow((("batching.max_wait_cap_s", value),), goodput, 1.0, 10.0, p99_ms, 8.0)


def test_a_setting_is_a_dotted_path_and_toml_values() -> None:
    assert parse_setting("batching.max_wait_cap_s=0.002,0.005") == (
        "batching.max_wait_cap_s",
        [0.002, 0.005],
    )
    assert parse_setting("fleet.workers=3") == ("fleet.workers", [3])
    assert parse_setting("hpa.metric=backlog,queue_wait") == (
        "hpa.metric",
        ["backlog", "queue_wait"],
    )
    assert parse_setting('name="x"') == ("name", ["x"])
    with pytest.raises(ValueError, match=r"table\.key=VALUE"):
        parse_setting("batching.max_wait_cap_s")


def test_overrides_copy_the_mapping_and_create_missing_tables() -> None:
    raw = {"batching": {"max_wait_cap_s": 0.01}, "fleet": {"workers": 2}}
    out = with_overrides(raw, {"batching.max_wait_cap_s": 0.002, "fleet.routing.max_retries": 1})
    assert out["batching"] == {"max_wait_cap_s": 0.002}
    assert out["fleet"] == {"workers": 2, "routing": {"max_retries": 1}}
    assert raw == {"batching": {"max_wait_cap_s": 0.01}, "fleet": {"workers": 2}}
    with pytest.raises(ValueError, match="no table 'x'"):
        with_overrides(raw, {"fleet.workers.x.y": 1})
    with pytest.raises(ValueError, match="'workers' is not a table"):
        with_overrides(raw, {"fleet.workers.x": 1})


def test_a_number_in_the_path_picks_an_element_of_an_array_of_tables() -> None:
    raw = {"traffic": {"streams": [{"rate_per_s": 100}, {"rate_per_s": 200}]}}
    out = with_overrides(raw, {"traffic.streams.1.rate_per_s": 50})
    assert out["traffic"]["streams"] == [{"rate_per_s": 100}, {"rate_per_s": 50}]
    with pytest.raises(ValueError, match="no table '2'"):
        with_overrides(raw, {"traffic.streams.2.rate_per_s": 50})


def test_load_scenario_applies_overrides_and_names_a_bad_one(scenario_path: Path) -> None:
    scenario = load_scenario(scenario_path, {"batching.max_wait_cap_s": 0.002})
    assert isinstance(scenario, Scenario)
    assert scenario.driver.max_wait_cap_s == 0.002
    with pytest.raises(ValueError, match=r"linger.toml: \[batching\]: unknown keys \['typo'\]"):
        load_scenario(scenario_path, {"batching.typo": 1})


def test_the_best_row_has_the_highest_goodput_then_the_lowest_p99() -> None:
    rows = [
        make_row(0.002, goodput=1000.0, p99_ms=40.0),
        make_row(0.005, goodput=998.0, p99_ms=30.0),
        make_row(0.010, goodput=900.0, p99_ms=10.0),
    ]
    # 998 is within 0.5% of 1000: a tie, and its lower p99 wins.
    assert best(rows) is rows[1]
    assert best([rows[0], make_row(0.02, goodput=990.0, p99_ms=5.0)]) is rows[0]
    assert best([make_row(0.1, goodput=0.0, p99_ms=math.nan), rows[2]]) is rows[2]
    assert best([]) is None
    table = format_sweep(rows)
    assert table.splitlines()[2].startswith("* batching.max_wait_cap_s=0.005")
    assert table.splitlines()[1].startswith("  batching.max_wait_cap_s=0.002")


def test_a_sweep_runs_once_per_value_in_order(scenario_path: Path) -> None:
    values = [0.002, 0.02]
    rows = sweep(scenario_path, {"batching.max_wait_cap_s": values}, duration_s=2.0)
    assert [row.settings for row in rows] == [(("batching.max_wait_cap_s", v),) for v in values]
    # A fixed linger always waits it out: 20 ms of it gathers bigger batches and costs latency.
    short, long = rows
    assert long.mean_batch_size > short.mean_batch_size
    assert long.p50_ms > short.p50_ms + 5


def test_the_command_line_sweeps_and_refuses_lists_elsewhere(
    scenario_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setting = "batching.max_wait_cap_s=0.002,0.005"
    assert main(["sweep", str(scenario_path), "--set", setting, "--duration-s", "2"]) == 0
    out = capsys.readouterr().out
    assert "batching.max_wait_cap_s=0.002" in out and "batching.max_wait_cap_s=0.005" in out
    assert "* best: batching.max_wait_cap_s=" in out
    assert main(["run", str(scenario_path), "--set", setting]) == 2
    assert main(["sweep", str(scenario_path)]) == 2
    assert main(["sweep", str(scenario_path), "--set", "batching.typo=1"]) == 2
    status = main(["run", str(scenario_path), "--set", "fleet.workers=2", "--duration-s", "2"])
    assert status == 0
