"""bench.fabric's command line (the stand-in's fixed flood rate, the throttled floods, bursty
arrivals), its metrics breakdown, its summary of floods and bursty arrivals, its bursty phases,
and the load generator's priority below capacity and in floods."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.fabric import measure, phases, stand_in
from bench.fabric.__main__ import FULL, parse_args
from bench.fabric.loadgen import arrival_schedule
from bench.fabric.measure import Progress, Target, bursty_phases
from bench.fabric.observe import Observer, Snapshot, breakdown
from bench.fabric.report import (
    bursty_line,
    bursty_name,
    flood_name,
    goals,
    max_outside_share,
    summarize,
)
from bench.fabric.sweep import RateResult, WindowStats
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
                "p99_s": {"median": 0.1}, "valid": True}  # fmt: skip

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


def test_a_flood_that_measured_the_generator_meets_no_goal() -> None:
    """A flood most of whose windows had too many late sends is void (BENCHMARKS.md): its
    figures, from every window, met the overload goal all the same (bench review)."""
    point = {"factor": 2.0, "throttled": False, "goodput_per_s": {"median": 95.0},
             "p99_s": {"median": 0.1}}  # fmt: skip
    report = {
        "configs": {"batching_on": {"goodput_per_s": 100.0}},
        "model": {"slo_p99_ms": 250},
        "overload": [{**point, "valid": False}],
    }
    assert goals(summarize(report))["overload_2x_goodput_fraction"]["met"] is False
    report["overload"] = [{**point, "valid": True}]
    assert goals(summarize(report))["overload_2x_goodput_fraction"]["met"] is True


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
        (["--burstiness", "1"], "--burstiness 1 is the Poisson arrivals"),
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


def test_the_most_cpu_others_took_counts_every_phase_of_every_configuration() -> None:
    report = {
        "configs": {"stand_in": {"rates": [{"outside_cpu_share": 0.01}],
                                 "bursty": [{"outside_cpu_share": 0.2}],
                                 "overload": [{"outside_cpu_share": 0.05}]}},
        "bursty": [{"outside_cpu_share": 0.1}],
    }  # fmt: skip
    assert max_outside_share(report) == 0.2
    report["configs"]["stand_in"]["bursty"] = []
    assert max_outside_share(report) == 0.1


class RatesMeasured:
    """Stands in for `measure.measure_rate` in tests of the policies around it: records each
    call's (target name, rate, burstiness, priority) and answers three windows, void (late
    sends) at the priorities in `void_at`, with no clock and no sends."""

    def __init__(self, void_at: frozenset[str | None] = frozenset()) -> None:
        self.calls: list[tuple[str, float, float, str | None]] = []
        self.void_at = void_at

    async def __call__(
        self, target: Target, rate: float, settings: object, slo_s: float, log: object,
        burstiness: float = 1.0, priority: str | None = None,
    ) -> RateResult:  # fmt: skip
        self.calls.append((target.name, rate, burstiness, priority))
        late = 10 if priority in self.void_at else 0
        window = WindowStats(1.0, 100, 100, 100, late, {"OK": 100}, 0.01, 0.02, 0.03)
        extra = {"outside_cpu_share": 0.0, "loadgen_priority": priority}
        return RateResult(rate, [window] * 3, extra=extra)

    @property
    def priorities(self) -> list[str | None]:
        return [priority for *_, priority in self.calls]


def quick_target() -> Target:
    async def at_once() -> None:
        pass

    return Target("quick", at_once, Observer({}), None)


async def test_bursty_phases_offer_poisson_then_bursty_arrivals_at_each_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each share of the goodput offered twice at the same mean rate, Poisson first, then at
    the settings' burstiness, each under a name of its own, at the below-capacity priority."""
    measured = RatesMeasured()
    monkeypatch.setattr(measure, "measure_rate", measured)
    settings = dataclasses.replace(FULL, bursty_shares=(0.5, 1.0), burstiness=0.1)
    target = quick_target()
    points = await bursty_phases(target, 400.0, settings, 0.25, Progress())
    assert [(rate, burstiness) for _, rate, burstiness, _ in measured.calls] == [
        (200.0, 1.0), (200.0, 0.1), (400.0, 1.0), (400.0, 0.1)
    ]  # fmt: skip
    assert [name for name, *_ in measured.calls] == [
        "quick_0.5x_poisson", "quick_0.5x_bursty_0.1", "quick_1x_poisson", "quick_1x_bursty_0.1"
    ]  # fmt: skip
    assert set(measured.priorities) == {"none"}
    assert [(p["share"], p["burstiness"]) for p in points] == [
        (0.5, 1.0), (0.5, 0.1), (1.0, 1.0), (1.0, 0.1)
    ]  # fmt: skip
    assert [p["offered_rate_per_s"] for p in points] == [200.0, 200.0, 400.0, 400.0]
    assert target.name == "quick"
    assert await bursty_phases(target, 0.0, settings, 0.25, Progress()) == []


async def test_a_rate_is_sent_on_its_burstinesss_schedule_at_the_priority_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """measure_rate through the real open-loop generator: the schedule drawn at the burstiness
    given, the generator at the priority given (recorded in place of
    `scheduling.generator_priority`, which would change this test process's scheduling)."""
    drawn: list[float] = []
    used: list[str] = []

    def schedule(*args: Any, **kwargs: Any) -> list[float]:
        drawn.append(kwargs["burstiness"])
        return arrival_schedule(*args, **kwargs)

    @contextlib.contextmanager
    def recorded(mode: str) -> Iterator[str]:
        used.append(mode)
        yield mode

    monkeypatch.setattr(measure, "arrival_schedule", schedule)
    monkeypatch.setattr(measure, "generator_priority", recorded)
    settings = dataclasses.replace(FULL, warmup_s=0.05, window_s=0.1, windows=3)
    result = await measure.measure_rate(
        quick_target(), 200.0, settings, 0.25, Progress(), burstiness=0.1, priority="nice"
    )
    assert (drawn, used) == ([0.1], ["nice"])
    assert result.extra["loadgen_priority"] == "nice" and set(result.statuses()) <= {"OK"}
    await measure.measure_rate(quick_target(), 200.0, settings, 0.25, Progress())
    assert (drawn, used) == ([0.1, 1.0], ["nice", "rr"])  # the settings' priority by default


async def test_rates_below_capacity_start_with_the_generator_as_an_ordinary_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sweeps and the like run the generator at normal priority, raised ahead of the stack
    only for a rate whose windows it sent late; floods run it ahead from the start, and the
    traffic after them does not."""
    settings = dataclasses.replace(FULL, overload_factors=(2.0,), throttled_floods=False)

    async def clean(measured: RatesMeasured, is_flood: bool = False) -> RateResult:
        monkeypatch.setattr(measure, "measure_rate", measured)
        return await measure.measure_rate_clean(
            quick_target(), 100.0, settings, 0.25, Progress(), is_flood=is_flood
        )

    served = RatesMeasured()
    assert (await clean(served)).is_valid and served.priorities == ["none"]
    flood = RatesMeasured()
    assert (await clean(flood, is_flood=True)).is_valid and flood.priorities == ["rr"]
    late = RatesMeasured(void_at=frozenset({"none"}))
    assert (await clean(late)).is_valid and late.priorities == ["none", "rr"]
    hopeless = RatesMeasured(void_at=frozenset({"none", "rr"}))
    assert not (await clean(hopeless)).is_valid and hopeless.priorities == ["none", "rr"]
    phases = RatesMeasured()
    monkeypatch.setattr(measure, "measure_rate", phases)
    floods, after = await measure.overload_phases(quick_target(), 100.0, settings, 0.25, Progress())
    assert [(rate, priority) for _, rate, _, priority in phases.calls] == [
        (200.0, "rr"), (50.0, "none")
    ]  # fmt: skip
    assert len(floods) == 1 and after is not None


class _EchoServer:
    """What `start_echo` returns, for a Run whose echo is measured by a recording closed loop."""

    ready = {"grpc_port": 1, "pid": 1}

    def stop(self) -> None:
        pass


async def test_the_stand_ins_echo_is_measured_at_as_many_callers_as_its_tiers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The stand-in's echo-calls divide each tier's CPU at CALLERS (64) callers by an echo
    call's: the echo ran at the overhead phase's 32 (review finding). The overhead phase's own
    echo keeps its concurrency."""
    loops: list[int] = []

    async def closed_loop(send: Any, concurrency: int, *args: Any, **kwargs: Any) -> dict:
        loops.append(concurrency)
        return {"ok_per_s": 1.0}

    async def quiet(*args: Any) -> float:
        return 0.0

    async def no_stack(*args: Any, **kwargs: Any) -> dict:
        return {}

    monkeypatch.setattr(phases, "closed_loop", closed_loop)
    monkeypatch.setattr(phases, "wait_quiet", quiet)
    monkeypatch.setattr(phases, "start_echo", lambda state_dir: _EchoServer())
    monkeypatch.setattr(phases.Run, "stack_phase", no_stack)
    run = phases.Run(
        args=argparse.Namespace(flood_rate=None), settings=FULL, log=Progress(),
        state_dir=tmp_path, on_repo=tmp_path, off_repo=tmp_path, slo_s=0.25, max_batch_size=64,
        texts=[], mixed_texts=[], timeout_s=1.0, report={"configs": {}},
    )  # fmt: skip
    await run.echo(b"x")
    await run.stand_in(b"x", 16)
    assert (
        loops == [FULL.overhead_concurrency, stand_in.CALLERS] and FULL.overhead_concurrency != 64
    )
