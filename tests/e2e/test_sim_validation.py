"""The simulator validation's command (issue 17; `make bench-sim`, bench/sim_validation.py) runs
end to end in a tiny setting: the local stack with one minilm worker, a short calibration, two
low loads through the stack and through the simulator, the table and the JSON report.

How far the simulator's goodput, p50 and p99 land from the real stack's is a performance
figure: `make bench-sim` measures and prints it (bench/results/sim_validation.json), on longer
windows than a test suite can afford, against the issue's 15%. Here only what holds on any
machine is checked: every load has its row with both sides measured, and the real stack
answered every request it was sent, or refused it for load (with a 30 s deadline, nothing else
may fail)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import bench.sim_calibration as calibration
import bench.sim_validation as validation

pytestmark = pytest.mark.e2e

LOADS = (0.1, 0.2)


@pytest.mark.timeout(600)
def test_the_validation_command_measures_both_sides_at_every_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A calibration of seconds instead of a minute: no wait for a quiet machine (this test
    # shares the cores with the rest of the suite anyway), fewer batch sizes, and fewer
    # one-row calls for the hops. What the figures are worth is the benchmark's job.
    # A curve point is the median of its calls, and a point inflated by the suite's other
    # work makes every simulated batch of that shape miss the SLO, so the simulator refuses
    # everything (p50 NaN). One pass of two calls: one stalled call (339 ms against 12) did
    # it; one pass of three: two stalled calls in a row (170 and 200 ms against 9 and 21, with
    # other processes on 54% of the CPU). Three passes of three calls, the passes apart as
    # the benchmark spreads its own: a point moves only if five of its nine calls stall.
    monkeypatch.setattr(validation, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(calibration, "CURVE_PASSES", 3)
    monkeypatch.setattr(calibration, "CURVE_SIZES", (1, 2, 4))
    monkeypatch.setattr(calibration, "HOP_CALLS", 20)
    out = tmp_path / "sim_validation.json"
    argv = ["--loads", ",".join(map(str, LOADS)), "--duration-s", "3", "--warmup-s", "1",
            "--repeats", "3", "--runs", "1", "--seed", "11", "--out", str(out)]  # fmt: skip

    assert validation.main(argv) == 0

    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [row["load"] for row in rows] == pytest.approx(LOADS), rows
    assert report["capacity_per_s"] > 0
    # Both length buckets the traffic uses have a measured curve.
    assert {key.split("x")[0] for key in report["calibration"]["curve_ms"]} == {"16", "128"}
    for row in rows:
        assert row["runs"] == 1 and row["rate_per_s"] > 0, row
        # Every call answered, or refused for load: on a machine slowed by its neighbours the
        # worker's queue may stand and refuse what would miss the SLO (issue 33); nothing else
        # fails. How many are refused is the machine's: a clean run once saw 72% refused at
        # load 0.2, its batches taking 532 ms against the 43 ms calibrated seconds before.
        real = row["real"]
        assert real["ok_share"] > 0, row
        assert real["ok_share"] + real["refused_share"] == pytest.approx(1.0), row
        # Goodput counts answers within the 250 ms SLO, which a busy machine may miss: its
        # value is the benchmark's. Latencies exist on both sides, so their ratios do too.
        for side in (row["real"], row["sim"]):
            assert side["goodput_per_s"] >= 0, row
            assert math.isfinite(side["p50_ms"]) and side["p50_ms"] > 0, row
        for ratio in ("p50_ratio", "p99_ratio"):
            assert math.isfinite(row[ratio]) and row[ratio] > 0, row
    assert isinstance(report["within_tolerance"], bool)
    # The printed table: a header, a rule and one line per load.
    printed = capsys.readouterr().out
    table = printed[printed.index("rate/s") :].splitlines()
    assert len([line for line in table if "|" in line]) == 1 + len(LOADS), printed
