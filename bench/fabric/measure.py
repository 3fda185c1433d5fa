"""The fabric benchmark's measurements: one offered rate, a goodput sweep, closed-loop
throughput. `bench.fabric` strings them together; the raw in-process model is bench/fabric/raw.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference_fabric_client.throttle import AdaptiveThrottle

from bench.fabric.loadgen import (
    Send,
    arrival_schedule,
    run_closed_loop,
    run_open_loop,
    split_windows,
    throttled,
)
from bench.fabric.observe import Observer, Snapshot, breakdown, cpu_delta, threads_delta
from bench.fabric.report import bursty_name
from bench.fabric.scheduling import generator_priority
from bench.fabric.sweep import GoodputSearch, RateResult, percentile, summarize_rate

#: The first guess for the sweep, as a share of closed-loop throughput: an open-loop server
#: holds its SLO a little below the rate at which it is saturated.
START_SHARE_OF_PROBE = 0.85
#: Snapshots are taken this long before the measured windows begin: scraping costs the tiers
#: and the generator a little CPU, and that disturbance should fall in the warm-up.
SNAPSHOT_LEAD_S = 0.3
#: Share of the machine's CPU used outside the benchmark above which figures are suspect (the
#: cores are shared: another process's torch threads can halve the model's throughput).
OUTSIDE_WARN_SHARE = 0.05
#: ... and above which a rate is measured again (the shared machine's neighbours come and go).
OUTSIDE_RETRY_SHARE = 0.10


@dataclass(frozen=True)
class Settings:
    """How long and how much to measure; `bench.fabric` has a full and a smoke set."""

    warmup_s: float
    window_s: float
    windows: int
    probe_s: float
    probe_concurrency: int
    max_probes: int
    growth: float
    rel_tol: float
    raw_seconds: float
    overhead_s: float
    overhead_concurrency: int
    overload_factors: tuple[float, ...]
    #: None: the model's own length buckets; smoke runs trim them to cut worker warm-up.
    length_buckets: tuple[int, ...] | None
    seed: int
    #: How the generator runs ahead of the stack in floods, and in a rate measured again for
    #: its late sends: "rr", "nice" or "none" (see bench.fabric.scheduling.generator_priority).
    loadgen_priority: str = "rr"
    #: How it runs below capacity (sweeps, bursty arrivals, the traffic after floods; and from
    #: ready, measured once, so never raised): as an ordinary process, competing with the stack
    #: as the scheduler shares the cores. Run ahead of the stack there, its every send preempts
    #: the stack's threads, and the door refused 13-15% of a rate served whole without it
    #: (docs/benchmarks.md).
    loadgen_priority_below_capacity: str = "none"
    #: Before each phase (and before re-measuring), wait up to this long for other processes
    #: to leave the CPU.
    wait_quiet_s: float = 0.0
    #: Times a rate is measured again when other processes took over OUTSIDE_RETRY_SHARE.
    contention_retries: int = 1
    #: Each flood is also offered from callers that throttle themselves as the slim client
    #: does (loadgen.throttled), after the floods of callers that send every call and the
    #: traffic after them.
    throttled_floods: bool = True
    #: Shares of a configuration's goodput offered with Poisson arrivals and then with bursty
    #: ones of this `burstiness` (loadgen.arrival_schedule), side by side (`bursty_phases`).
    bursty_shares: tuple[float, ...] = (0.5, 0.8)
    burstiness: float = 0.1


class Progress:
    """Timestamped progress lines on stdout, so a long run shows it is alive."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)


@dataclass
class Target:
    """One thing under load: its send closure, what to observe, and its model's label."""

    name: str
    send: Send
    observer: Observer
    #: The `model` label for the metrics breakdown; None for targets without our metrics.
    model: str | None
    #: Client-side bound per call (the peer has no gRPC deadline); None: the call's own.
    timeout_s: float | None = None


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"


def outside_share(before: Snapshot, after: Snapshot) -> float:
    """Share of all cores that processes outside the benchmark used between two snapshots."""
    interval = (after.at_s - before.at_s) * (os.cpu_count() or 1)
    return cpu_delta(before, after)["outside_bench"] / interval if interval > 0 else 0.0


async def wait_quiet(log: Progress, max_wait_s: float, sample_s: float = 1.0) -> float:
    """Samples the CPU used outside the benchmark; waits (up to `max_wait_s`) while it is
    above OUTSIDE_WARN_SHARE. Returns the last sample, and says so when it stays high."""
    observer = Observer({})
    waited = 0.0
    while True:
        before = observer.snapshot()
        await asyncio.sleep(sample_s)
        share = outside_share(before, observer.snapshot())
        if share <= OUTSIDE_WARN_SHARE or waited >= max_wait_s:
            break
        if waited == 0.0:
            log(f"other processes use {share:.0%} of the CPU: waiting up to {max_wait_s:.0f} s")
        waited += sample_s
    if share > OUTSIDE_WARN_SHARE:
        log(f"WARNING: other processes use {share:.0%} of the CPU; figures will be skewed")
    return share


async def measure_rate(
    target: Target,
    rate: float,
    settings: Settings,
    slo_s: float,
    log: Progress,
    burstiness: float = 1.0,
    priority: str | None = None,
) -> RateResult:
    """Warm-up plus `settings.windows` windows of Poisson arrivals at `rate` (gamma gaps at
    another `burstiness`: loadgen.arrival_schedule), in one schedule (no gap between windows),
    the generator run at `priority` (None: `settings.loadgen_priority`); metrics and CPU are
    snapshotted around the measured windows."""
    measured_s = settings.windows * settings.window_s
    seconds = settings.warmup_s + measured_s
    schedule = arrival_schedule(rate, seconds, settings.seed, burstiness=burstiness)
    snapshots: dict[str, Snapshot] = {}

    def snap(key: str) -> Callable[[], Any]:
        async def take() -> None:
            snapshots[key] = await asyncio.to_thread(target.observer.snapshot)

        return take

    begin_s = max(0.0, settings.warmup_s - SNAPSHOT_LEAD_S)
    with generator_priority(priority or settings.loadgen_priority) as applied:
        outcomes = await run_open_loop(
            target.send,
            schedule,
            timeout_s=target.timeout_s,
            drain_timeout_s=max(5.0, 4 * slo_s),
            at_offsets=[(begin_s, snap("begin")), (settings.warmup_s + measured_s, snap("end"))],
        )
    windows = split_windows(outcomes, settings.warmup_s, settings.window_s, settings.windows)
    result = summarize_rate(rate, windows, slo_s, settings.window_s)
    begin, end = snapshots["begin"], snapshots["end"]
    sent_between = sum(1 for o in outcomes if o.scheduled_s >= begin_s)
    result.extra = {
        "sent_in_windows": sent_between,
        "cpu_s": cpu_delta(begin, end),
        "cpu_interval_s": round(end.at_s - begin.at_s, 3),
        "outside_cpu_share": round(outside_share(begin, end), 3),
        "loadgen_priority": applied,
    }
    if target.model is not None and target.observer.metrics_ports:
        result.extra["breakdown"] = breakdown(begin, end, target.model)
    good = [f"{w.good_fraction:.1%}" for w in result.windows]
    late = max(w.late_fraction for w in result.windows)
    p99 = result.figure("p99_s")["median"]
    verdict = "pass" if result.passed else "fail" if result.is_valid else "INVALID (late sends)"
    outside = result.extra["outside_cpu_share"]
    not_ok = {k: v for k, v in result.statuses().items() if k != "OK"}
    notes = [f"not OK {not_ok}"] if not_ok else []
    if outside > OUTSIDE_WARN_SHARE:
        notes.append(f"other processes used {outside:.0%} of the CPU")
    log(
        f"[{target.name}] {rate:7.1f}/s: good {' '.join(good)}, p99 {_fmt_ms(p99)}, "
        f"late max {late:.1%} -> {verdict}" + "".join(f"; {note}" for note in notes)
    )
    parts = result.extra.get("breakdown", {})
    workers = [part for tier, part in parts.items() if tier.startswith("worker")]
    if not_ok and workers and not any(w["rows"] for w in workers):
        rejected = parts.get("router", {}).get("rejected")
        log(f"[{target.name}] WARNING: no request reached a worker; router rejected {rejected}")
    return result


async def measure_rate_clean(
    target: Target,
    rate: float,
    settings: Settings,
    slo_s: float,
    log: Progress,
    *,
    is_flood: bool = False,
    burstiness: float = 1.0,
) -> RateResult:
    """measure_rate, measured again (after waiting for quiet) when other processes took a
    large share of the CPU or the windows were void (late sends): a neighbour's burst should
    not decide a rate's verdict. A rate still void after the retries counts as not served.
    The generator runs at `settings.loadgen_priority_below_capacity` unless `is_flood`, and at
    `settings.loadgen_priority` once its sends were late."""
    below = settings.loadgen_priority_below_capacity
    priority = settings.loadgen_priority if is_flood else below
    for attempt in range(settings.contention_retries + 1):
        result = await measure_rate(target, rate, settings, slo_s, log, burstiness, priority)
        outside = result.extra["outside_cpu_share"]
        is_clean = outside <= OUTSIDE_RETRY_SHARE and result.is_valid
        if is_clean or attempt == settings.contention_retries:
            break
        why = "late sends" if not result.is_valid else f"others used {outside:.0%} of the CPU"
        if not result.is_valid:
            priority = settings.loadgen_priority  # the generator ahead, to keep its schedule
        log(f"[{target.name}] measuring {rate:.1f}/s again: {why}")
        await wait_quiet(log, settings.wait_quiet_s)
    result.extra["attempts"] = attempt + 1
    return result


async def overload_phases(
    target: Target,
    goodput: float,
    settings: Settings,
    slo_s: float,
    log: Progress,
    rate_per_s: float | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Floods at `settings.overload_factors` multiples of `goodput` (or one at `rate_per_s`,
    the same for every run: two trees offered the same flood) from callers that send every
    call, then normal traffic (half of `goodput`) right after them, which must be served
    normally (docs/benchmarks.md); then, with `settings.throttled_floods`, the same floods
    from callers that throttle themselves as the slim client does (`loadgen.throttled`, one
    throttle a flood, kept across a re-measured attempt of it: the same clients go on
    flooding), and a pause of one warm-up after them, so that what is measured next does not
    meet their tail. Returns the floods (each with its factor, whether its callers
    throttled, and its goodput over `goodput`) and the traffic after the first floods (None
    without a goodput to flood)."""
    if not goodput:
        return [], None
    name, send = target.name, target.send
    factors = settings.overload_factors if rate_per_s is None else (rate_per_s / goodput,)

    async def flood(factor: float, is_throttled: bool) -> dict[str, Any]:
        target.name = f"{name}_overload_{factor:.3g}x" + ("_throttled" if is_throttled else "")
        draws = random.Random(settings.seed)  # the throttle's draws repeat for a --seed
        target.send = throttled(send, AdaptiveThrottle(), draws) if is_throttled else send
        result = (
            await measure_rate_clean(target, factor * goodput, settings, slo_s, log, is_flood=True)
        ).to_dict()
        median = result["goodput_per_s"]["median"]
        fraction = None if median is None else round(median / goodput, 3)
        return {"factor": factor, "throttled": is_throttled, "goodput_fraction": fraction,
                **result}  # fmt: skip

    try:
        floods = [await flood(factor, False) for factor in factors]
        target.name, target.send = f"{name}_after_overload", send
        after = (await measure_rate_clean(target, 0.5 * goodput, settings, slo_s, log)).to_dict()
        if settings.throttled_floods:
            floods += [await flood(factor, True) for factor in factors]
            await asyncio.sleep(settings.warmup_s)
    finally:
        target.name, target.send = name, send
    return floods, after


async def bursty_phases(
    target: Target, goodput: float, settings: Settings, slo_s: float, log: Progress
) -> list[dict[str, Any]]:
    """At each of `settings.bursty_shares` of `goodput`, Poisson arrivals and then bursty
    ones at the same mean rate (`settings.burstiness`: gamma gaps, clumps and lulls), side by
    side. Below capacity a burst is to be absorbed, not refused as a standing queue would be
    (issue 33), so the bursty good share should stay near the Poisson one. Each point: its
    share, burstiness and the rate's figures (RateResult.to_dict)."""
    if not goodput or not settings.bursty_shares:
        return []
    name, points = target.name, []
    try:
        for share in settings.bursty_shares:
            for burstiness in (1.0, settings.burstiness):
                point = {"share": share, "burstiness": burstiness}
                target.name = f"{name}_{bursty_name(point, '_')}"
                result = await measure_rate_clean(
                    target, share * goodput, settings, slo_s, log, burstiness=burstiness
                )
                points.append({**point, **result.to_dict()})
    finally:
        target.name = name
    return points


async def closed_loop(
    send: Send,
    concurrency: int,
    duration_s: float,
    timeout_s: float | None = None,
    observer: Observer | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """Closed-loop throughput after a warm-up a third as long, as a JSON-able dict; with an
    `observer`, also CPU seconds per process (and the metrics breakdown for `model`)."""
    await run_closed_loop(send, concurrency=concurrency, duration_s=duration_s / 3)
    before = await asyncio.to_thread(observer.snapshot) if observer else None
    result = await run_closed_loop(
        send, concurrency=concurrency, duration_s=duration_s, timeout_s=timeout_s
    )
    figures: dict[str, Any] = {
        "concurrency": concurrency,
        "seconds": round(result.elapsed_s, 3),
        "ok_per_s": result.ok_per_s,
        "statuses": result.statuses,
        "p50_s": percentile(result.latencies_s, 50),
        "p99_s": percentile(result.latencies_s, 99),
    }
    if observer is not None and before is not None:
        after = await asyncio.to_thread(observer.snapshot)
        figures["cpu_s"] = cpu_delta(before, after)
        figures["threads"] = threads_delta(before, after)
        figures["sent_in_windows"] = sum(result.statuses.values())
        figures["ok_in_windows"] = result.statuses.get("OK", 0)
        if model is not None and observer.metrics_ports:
            figures["breakdown"] = breakdown(before, after, model)
    return figures


async def sweep(
    target: Target, settings: Settings, slo_s: float, log: Progress, fallback_rate: float
) -> dict[str, Any]:
    """Goodput of a target: a closed-loop probe for a first guess (`fallback_rate` when the
    probe got nothing through), then the open-loop search."""
    log(f"[{target.name}] closed-loop probe, concurrency {settings.probe_concurrency}")
    probe = await closed_loop(
        target.send, settings.probe_concurrency, settings.probe_s, target.timeout_s
    )
    log(f"[{target.name}] probe: {probe['ok_per_s']:.1f} OK/s, statuses {probe['statuses']}")
    search = GoodputSearch(
        START_SHARE_OF_PROBE * probe["ok_per_s"] or fallback_rate,
        growth=settings.growth,
        rel_tol=settings.rel_tol,
        max_probes=settings.max_probes,
    )
    results: list[RateResult] = []
    while (rate := search.next_rate()) is not None:
        result = await measure_rate_clean(target, rate, settings, slo_s, log)
        search.record(rate, result.passed)
        results.append(result)
    best = search.best
    at_best = next((r for r in results if r.rate_per_s == best), None)
    log(f"[{target.name}] goodput {'none found' if best is None else f'{best:.1f}/s'}")
    return {
        "probe": probe,
        "rates": [r.to_dict() for r in results],
        "goodput_per_s": best,
        "lowest_failing_rate_per_s": search.lowest_failure,
        "at_goodput": at_best.to_dict() if at_best else None,
    }
