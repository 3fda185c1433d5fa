"""bench.fabric's command line (the stand-in's fixed flood rate, the throttled floods, bursty
arrivals), its metrics breakdown, its summary of floods and bursty arrivals, and its bursty
phases through the open-loop generator."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator

import numpy as np
import pytest

from bench.fabric import measure
from bench.fabric.__main__ import FULL, parse_args
from bench.fabric.measure import Progress, Target, bursty_phases
from bench.fabric.observe import Observer, Snapshot, breakdown
from bench.fabric.report import bursty_line, bursty_name, flood_name, goals, summarize
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


def test_threads_are_counted_per_process_and_group_between_snapshots() -> None:
    """threads_delta: the first thread counts as `main`, the others under their names (two
    `event_engine` threads summed); a thread started between the snapshots counts whole, and
    so does one whose id a thread that ended between them had (another start time)."""
    from bench.fabric.observe import thread_group, threads_delta
    from services.common.procfs import ThreadStat

    pid = 100

    def snapshot(*threads: ThreadStat) -> Snapshot:
        groups: dict[str, dict[int, ThreadStat]] = {}
        for thread in threads:
            groups.setdefault(thread_group(pid, thread), {})[thread.tid] = thread
        return Snapshot(at_s=0.0, metrics={}, cpu_s={}, machine_busy_s=0.0,
                        threads={"gateway": groups})  # fmt: skip

    before = snapshot(
        ThreadStat(100, "python", 1.0, 10, 5),
        ThreadStat(101, "python", 0.5, 100, 0),
        ThreadStat(102, "event_engine", 0.1, 7, 1),
        ThreadStat(104, "lifeguard", 5.0, 90, 9, start_ticks=1),  # ends in between
    )
    after = snapshot(
        ThreadStat(100, "python", 3.0, 11, 25),
        ThreadStat(101, "python", 0.75, 500, 2),
        ThreadStat(102, "event_engine", 0.2, 9, 1),
        ThreadStat(103, "event_engine", 0.05, 3, 0),  # started in between
        ThreadStat(104, "lifeguard", 0.01, 2, 0, start_ticks=9),  # 104 reused
    )
    assert threads_delta(before, after) == {
        "gateway": {
            "main": {"threads": 1, "cpu_s": 2.0, "voluntary_switches": 1,
                     "involuntary_switches": 20},
            "python": {"threads": 1, "cpu_s": 0.25, "voluntary_switches": 400,
                       "involuntary_switches": 2},
            "event_engine": {"threads": 2, "cpu_s": 0.15, "voluntary_switches": 5,
                             "involuntary_switches": 0},
            "lifeguard": {"threads": 1, "cpu_s": 0.01, "voluntary_switches": 2,
                          "involuntary_switches": 0},
        }
    }  # fmt: skip


def test_a_tiers_busiest_event_loop_is_its_busiest_processs_first_thread() -> None:
    from bench.spread import busiest_loops

    before = {"gateway": {1: 1.0, 2: 1.0}, "router": {3: 0.0}}
    after = {"gateway": {1: 1.5, 2: 2.8}, "router": {3: 0.2}, "worker": {4: 9.0}}
    # The second gateway process's loop used 1.8 s of 2: 0.9 of a core; a tier missing
    # before (not measured then) is left out.
    assert busiest_loops(before, after, 2.0) == {"gateway": 0.9, "router": 0.1}


def test_bursty_arrivals_are_offered_at_half_and_most_of_the_goodput_by_default() -> None:
    _, settings = parse_args(["--no-peer"])
    assert (settings.bursty_shares, settings.burstiness) == ((0.5, 0.8), 0.1)
    _, settings = parse_args(["--no-peer", "--bursty-shares", "--burstiness", "0.25"])
    assert (settings.bursty_shares, settings.burstiness) == ((), 0.25)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--burstiness", "0"], "--burstiness must be a positive number"),
        (["--burstiness", "nan"], "--burstiness must be a positive number"),
        (["--burstiness", "inf"], "--burstiness must be a positive number"),
        (["--bursty-shares", "0.5", "-1"], "--bursty-shares must be positive"),
    ],
)
def test_a_burstiness_or_share_that_is_not_positive_is_refused(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--no-peer", *argv])
    assert words in capsys.readouterr().err


def test_bursty_points_are_summarized_and_shown_by_share_and_arrivals() -> None:
    def point(burstiness: float, good: float, valid: bool = True) -> dict[str, object]:
        return {"share": 0.8, "burstiness": burstiness, "good_fraction": good, "valid": valid,
                "p99_s": {"median": 0.12}}  # fmt: skip

    report = {
        "configs": {"batching_on": {"goodput_per_s": 100.0}},
        "model": {"slo_p99_ms": 250},
        "bursty": [point(1.0, 0.995), point(0.1, 0.97, valid=False)],
    }
    summary = summarize(report)
    assert summary["arrivals_0.8x_poisson_good_fraction"] == 0.995
    assert summary["arrivals_0.8x_bursty_0.1_good_fraction"] == 0.97
    assert [bursty_name(p) for p in report["bursty"]] == ["0.8x poisson", "0.8x bursty 0.1"]
    assert bursty_line(report["bursty"][0]) == "good 99.5%, accepted p99 120 ms"
    assert bursty_line(report["bursty"][1]).endswith("(INVALID: late sends)")


async def test_bursty_phases_offer_poisson_then_bursty_arrivals_at_each_share() -> None:
    """Through the real open-loop generator, against a send that answers at once: each share
    of the goodput is offered twice, Poisson first, at the same mean rate, and the bursty
    arrivals come in clumps (their sends' gaps spread far more than Poisson ones')."""
    loop = asyncio.get_running_loop()
    sent: dict[str, list[float]] = {}
    target = Target("quick", lambda: noted(), Observer({}), None)

    async def noted() -> None:
        sent.setdefault(target.name, []).append(loop.time())

    settings = dataclasses.replace(
        FULL, warmup_s=0.05, window_s=0.3, windows=3, bursty_shares=(0.5, 1.0), burstiness=0.1,
        contention_retries=0,  # one schedule a point, whatever else the machine runs
    )  # fmt: skip
    points = await bursty_phases(target, 400.0, settings, 0.25, Progress())
    assert [(p["share"], p["burstiness"]) for p in points] == [
        (0.5, 1.0), (0.5, 0.1), (1.0, 1.0), (1.0, 0.1)
    ]  # fmt: skip
    assert [p["offered_rate_per_s"] for p in points] == [200.0, 200.0, 400.0, 400.0]
    assert all(set(p["statuses"]) == {"OK"} for p in points)
    assert target.name == "quick"

    def spread(name: str) -> float:
        gaps = np.diff(sent[name])
        return float(gaps.std() / gaps.mean())

    for share in ("0.5x", "1x"):
        assert spread(f"quick_{share}_bursty_0.1") > 2 * spread(f"quick_{share}_poisson")
    assert await bursty_phases(target, 0.0, settings, 0.25, Progress()) == []


async def test_rates_below_capacity_start_with_the_generator_as_an_ordinary_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sweeps and the like run the generator at normal priority, raised ahead of the stack
    only for a rate it sent late; floods run it ahead from the start. The priority actually
    applied is recorded in place of `loadgen.generator_priority` (it would change this test
    process's scheduling)."""
    used: list[str] = []

    @contextlib.contextmanager
    def recorded(mode: str) -> Iterator[str]:
        used.append(mode)
        yield mode

    monkeypatch.setattr(measure, "generator_priority", recorded)
    settings = dataclasses.replace(FULL, warmup_s=0.05, window_s=0.2, windows=3)

    async def at_once() -> None:
        pass

    async def blocking_at_normal_priority() -> None:
        if used[-1] == "none":
            time.sleep(0.008)  # holds the loop past the next send: every later one leaves late

    target = Target("quick", at_once, Observer({}), None)
    result = await measure.measure_rate_clean(target, 200.0, settings, 0.25, Progress())
    assert set(used) == {"none"} and result.extra["loadgen_priority"] == "none"
    used.clear()
    await measure.measure_rate_clean(target, 200.0, settings, 0.25, Progress(), is_flood=True)
    assert set(used) == {"rr"}
    used.clear()
    target.send = blocking_at_normal_priority
    result = await measure.measure_rate_clean(target, 200.0, settings, 0.25, Progress())
    assert (used[0], used[-1]) == ("none", "rr") and result.extra["loadgen_priority"] == "rr"
    assert result.is_valid
