"""bench.fabric's command line (the stand-in's fixed flood rate, the throttled floods), its
metrics breakdown and its summary of floods."""

from __future__ import annotations

import pytest

from bench.fabric.__main__ import parse_args
from bench.fabric.observe import Snapshot, breakdown
from bench.fabric.report import flood_name, goals, summarize
from services.common import metric_names as names

pytestmark = pytest.mark.unit


def test_the_flood_rate_is_taken_as_given_and_absent_by_default() -> None:
    args, _ = parse_args(["--stand-in-only", "--no-peer", "--flood-rate", "2600"])
    assert args.flood_rate == 2600.0
    args, _ = parse_args(["--stand-in-only", "--no-peer"])
    assert args.flood_rate is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], True),
        (["--smoke"], False),
        (["--stand-in-only"], True),
        (["--smoke", "--throttled-floods"], True),
        (["--no-throttled-floods"], False),
    ],
)
def test_floods_of_throttling_callers_are_on_but_in_smoke_runs(
    argv: list[str], expected: bool
) -> None:
    _, settings = parse_args(["--no-peer", *argv])
    assert settings.throttled_floods is expected


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


def test_a_flood_of_throttling_callers_is_summarized_beside_the_goal_not_as_it() -> None:
    """The overload goals are the floods of callers that send every call; the same flood from
    callers that throttle themselves (measure.overload_phases) gets keys of its own."""

    def flood(is_throttled: bool, goodput: float) -> dict[str, object]:
        return {"factor": 2.0, "throttled": is_throttled, "goodput_per_s": {"median": goodput},
                "p99_s": {"median": 0.1}}  # fmt: skip

    report = {
        "configs": {"batching_on": {"goodput_per_s": 100.0}},
        "model": {"slo_p99_ms": 250},
        "overload": [flood(False, 30.0), flood(True, 95.0)],
    }
    summary = summarize(report)
    assert summary["overload_2x_goodput_fraction"] == 0.3
    assert summary["overload_2x_throttled_goodput_fraction"] == 0.95
    assert summary["overload_2x_throttled_p99_within_slo"] is True
    assert goals(summary)["overload_2x_goodput_fraction"]["met"] is False
    assert [flood_name(point) for point in report["overload"]] == [
        "overload 2x",
        "overload 2x throttled",
    ]
