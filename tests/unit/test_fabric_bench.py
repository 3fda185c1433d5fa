"""bench.fabric's command line (the stand-in's fixed flood rate) and its metrics breakdown."""

from __future__ import annotations

import pytest

from bench.fabric.__main__ import parse_args
from bench.fabric.observe import Snapshot, breakdown
from services.common import metric_names as names

pytestmark = pytest.mark.unit


def test_the_flood_rate_is_taken_as_given_and_absent_by_default() -> None:
    args, _ = parse_args(["--stand-in-only", "--no-peer", "--flood-rate", "2600"])
    assert args.flood_rate == 2600.0
    args, _ = parse_args(["--stand-in-only", "--no-peer"])
    assert args.flood_rate is None


@pytest.mark.parametrize("rate", ["0", "-5", "inf", "nan"])
def test_a_flood_rate_that_is_not_a_positive_number_is_refused(
    rate: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--stand-in-only", "--flood-rate", rate])
    assert "--flood-rate must be a positive number" in capsys.readouterr().err


def test_the_breakdown_reports_the_gateways_callers_a_bundle_for_its_model() -> None:
    """From the gateway's own bundle histogram between two snapshots, for the model asked."""
    slices = names.GATEWAY_BUNDLE_SLICES

    def gateway(bundles: float, callers: float) -> Snapshot:
        samples = {
            (f"{slices}_count", (("model", "identity"),)): bundles,
            (f"{slices}_sum", (("model", "identity"),)): callers,
            (f"{slices}_count", (("model", "minilm"),)): 7.0,
            (f"{slices}_sum", (("model", "minilm"),)): 700.0,
        }
        return Snapshot(at_s=0.0, metrics={"gateway": samples}, cpu_s={}, machine_busy_s=0.0)

    after = breakdown(gateway(10.0, 40.0), gateway(70.0, 520.0), "identity")
    assert after["gateway"]["callers_per_bundle"] == 8.0
    idle = breakdown(gateway(10.0, 40.0), gateway(10.0, 40.0), "identity")
    assert idle["gateway"]["callers_per_bundle"] is None
