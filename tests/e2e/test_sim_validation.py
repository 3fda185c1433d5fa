"""The simulator against the real stack, small (issue 17's validation; the full run is
`make bench-sim`): one minilm worker in the local stack as `make run` starts it, calibrated at
low load, then the same seeded Poisson traffic (85% short, 15% long texts) through the stack and
through the simulator, three runs with their own seeds, compared by medians. Goodput must agree
within the issue's 15%. p50 and p99 are held to looser bounds here: inside the suite, after the
other e2e tests, p50 has come out 1.13-1.31x and p99 1.05-1.35x (with the earlier hop rule and
noise estimate), and one single run's real p99 reached 192 ms where quiet runs give 56-80 ms
(0.39x); a run on a quiet machine has since shown a real p99 of 3 s in one of three runs. The
calibration itself moves the simulated side between runs (one-row points 6.0-8.4 ms before
two passes, hops 6.6-7.2 ms, the tiers' CPU 4.75-5.35 ms per request), so these bounds catch a
simulator that is wrong, not one calibrated on a noisy machine; the benchmark (`make
bench-sim`, longer windows on a quiet machine) reports all three against 15%."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from bench.sim_validation import TOLERANCE, format_rows, validate

pytestmark = pytest.mark.e2e

#: |sim / real - 1| allowed for p50 and p99 over this test's short window inside the suite.
P50_TOLERANCE = 0.35
P99_TOLERANCE = 0.4


@pytest.mark.timeout(600)
def test_simulator_agrees_with_the_real_stack_at_moderate_load(tmp_path: Path) -> None:
    args = argparse.Namespace(
        loads=(0.3,),
        rates=None,
        runs=3,
        duration_s=30.0,
        warmup_s=5.0,
        repeats=5,
        seed=11,
        out=None,
    )
    report = asyncio.run(validate(args, tmp_path))
    print(format_rows(report["rows"]))
    (row,) = report["rows"]
    assert row["real"]["ok_share"] == pytest.approx(1.0, abs=0.01), row
    assert row["goodput_ratio"] == pytest.approx(1.0, abs=TOLERANCE), row
    assert row["p50_ratio"] == pytest.approx(1.0, abs=P50_TOLERANCE), row
    assert row["p99_ratio"] == pytest.approx(1.0, abs=P99_TOLERANCE), row
