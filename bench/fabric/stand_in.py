"""bench.fabric's GPU-speed stand-in configuration: the fabric as it runs on a GPU box.

The worker serves minilm as a stand-in (`--stand-in-curve`, services/gpu_worker/backends/
stand_in.py): real tokenization, batches that take the H100's measured time asleep. The model
then costs no CPU, so the tiers are the bottleneck here as on the H100 (../shared/gpu/). The
phase measures, in this order:
- CPU per request per tier at `CALLERS` closed-loop callers of one row each, for minilm's
  stand-in and for the identity model in the same stack (as unary calls, then as requests of
  one open ModelStreamInfer stream), in units of one bare grpc.aio echo call's CPU measured in
  the same run, just before the stack starts, at as many callers ("echo-calls",
  docs/benchmarks.md);
- a flood at `STAND_IN_OVERLOAD` multiples of the identity model's closed-loop throughput at
  `CALLERS` (its capacity here: the tiers bind it as they bind the stand-in), followed by
  normal traffic at half of it (issue 33);
- goodput within the SLO on the uniform texts, and its efficiency against the curve's best
  batch (the raw model on the H100);
- a flood at `STAND_IN_OVERLOAD` multiples of that goodput, and normal traffic after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.fabric.loadgen import Send
from bench.fabric.measure import (
    Progress,
    Settings,
    Target,
    bursty_phases,
    closed_loop,
    overload_phases,
    sweep,
)
from bench.fabric.observe import Observer
from bench.fabric.report import bursty_line, bursty_name, flood_name
from bench.fabric.stack import REPO_ROOT
from bench.fabric.stream_target import StreamSender
from bench.fabric.targets import identity_sender, predict_sender
from services.sim.curve import LatencyCurve

#: The H100 curve (its provenance is in the file).
STAND_IN_CURVE = REPO_ROOT / "services" / "sim" / "curves" / "minilm_h100.json"
#: Closed-loop callers of the per-tier CPU figures (the data-path issue's goals are at 64).
CALLERS = 64
#: Multiples of the stand-in's goodput it is flooded at (issue 33's 2x).
STAND_IN_OVERLOAD = (2.0,)
#: Processes of a stack that are not tiers of the fabric.
_NOT_TIERS = frozenset({"redis", "launcher"})


def worker_args(curve: Path = STAND_IN_CURVE) -> tuple[str, ...]:
    return (f"--stand-in-curve={curve}",)


def best_rate(curve: Path, bucket: int) -> float:
    """The curve's best sequences/s at `bucket` tokens (its best batch size), or at its
    nearest measured bucket."""
    points = LatencyCurve.load(curve).points
    nearest = min({b for (b, _), _ in points}, key=lambda b: (abs(b - bucket), b))
    return max(size / seconds for (b, size), seconds in points if b == nearest)


def echo_calls(
    run: dict[str, Any], echo: dict[str, Any], tiers: Mapping[str, str]
) -> dict[str, float]:
    """Each tier's CPU per request served (OK) of a closed-loop `run`, in echo-calls (CPU of
    one bare echo call measured in the same benchmark run). `tiers` maps the stack's process
    names to their tier (workers summed as "worker"); every other process (the load generator,
    Redis, the launcher) is left out. Per call sent, refusals (answered at once, at little
    CPU) made a run with refusals look cheaper per request (bench review)."""
    echo_cpu, echo_sent = echo.get("cpu_s", {}).get("echo"), echo.get("sent_in_windows", 0)
    sent = run.get("ok_in_windows", 0)
    if not echo_cpu or not echo_sent or not sent:
        return {}
    per_echo_call = echo_cpu / echo_sent
    seconds_by_tier: dict[str, float] = {}
    for name, seconds in run.get("cpu_s", {}).items():
        if name in tiers:
            tier = tiers[name]
            seconds_by_tier[tier] = seconds_by_tier.get(tier, 0.0) + seconds
    return {t: round(s / sent / per_echo_call, 2) for t, s in seconds_by_tier.items()}


def threads_per_request(
    run: dict[str, Any], processes: Iterable[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """The threads of each of `processes` in a closed-loop `run` (observe.threads_delta), per
    request: microseconds of CPU, and voluntary and involuntary context switches."""
    sent = run.get("sent_in_windows", 0)
    if not sent:
        return {}
    wanted = set(processes)
    return {
        process: {
            group: {
                "cpu_us": round(1e6 * figures["cpu_s"] / sent, 1),
                "voluntary_switches": round(figures["voluntary_switches"] / sent, 2),
                "involuntary_switches": round(figures["involuntary_switches"] / sent, 2),
            }
            for group, figures in groups.items()
        }
        for process, groups in run.get("threads", {}).items()
        if process in wanted
    }


def threads_line(threads: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """`threads_per_request` as one line: each process's thread groups of a microsecond or
    more a request, their switches (voluntary/involuntary) in brackets."""
    parts = []
    for process, groups in threads.items():
        shown = [
            f"{group} {f['cpu_us']:.0f} ({f['voluntary_switches']:g}/{f['involuntary_switches']:g})"
            for group, f in sorted(groups.items(), key=lambda item: -item[1]["cpu_us"])
            if f["cpu_us"] >= 1
        ]
        parts.append(f"{process}: {', '.join(shown)}")
    return "; ".join(parts)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def tier_of_processes(pids: Mapping[str, int]) -> dict[str, str]:
    """The stack's gateway, router and workers by process name (BenchStack.pids)."""
    return {name: name.split("-")[0] for name in pids if name not in _NOT_TIERS}


async def measure_stand_in(
    stack: Any,
    channel: grpc.aio.Channel,
    *,
    model: str,
    texts: Sequence[str],
    settings: Settings,
    slo_s: float,
    timeout_s: float,
    bucket: int,
    echo: dict[str, Any],
    log: Progress,
    identity: Callable[[grpc.aio.Channel, float], Any] = identity_sender,
    flood_rate_per_s: float | None = None,
) -> dict[str, Any]:
    """CPU per tier at CALLERS callers first (nearest the `echo` measured before the stack
    started), then the identity model's floods, then the stand-in's goodput sweep and floods:
    each flood soon after the capacity it is a multiple of. The floods are at
    `flood_rate_per_s` where given (the same load whatever the run's own capacity), else
    STAND_IN_OVERLOAD times each one's capacity."""
    observer = Observer(stack.pids(), stack.metrics_ports())
    send = predict_sender(channel, model, texts, timeout_s)
    raw_best = best_rate(STAND_IN_CURVE, bucket)
    streams: list[StreamSender] = []

    def on_one_stream() -> Send:
        """Opened when its phase begins, not idle through the phases before it."""
        streams.append(StreamSender(channel, timeout_s))
        return streams[-1].send

    # The identity model's rows as unary calls, then the same rows as requests of one open
    # ModelStreamInfer stream, one after the other.
    loads: dict[str, Callable[[], Send]] = {
        "minilm_stand_in": lambda: send,
        "identity": lambda: identity(channel, timeout_s),
        "identity_stream": on_one_stream,
    }
    models = {"minilm_stand_in": model, "identity": "identity", "identity_stream": "identity"}
    per_request: dict[str, Any] = {}
    senders: dict[str, Send] = {}
    try:
        for name, opened in loads.items():
            sender = senders[name] = opened()
            log(f"[stand_in] {name}: {CALLERS} closed-loop callers of one row")
            run = await closed_loop(
                sender, CALLERS, settings.overhead_s, observer=observer, model=models[name]
            )
            tiers = tier_of_processes(stack.pids())
            per_request[name] = {
                **run,
                "echo_calls_per_request": echo_calls(run, echo, tiers),
                "threads_per_request": threads_per_request(run, tiers),
                "callers_per_bundle": _rounded(
                    (run.get("breakdown") or {}).get("gateway", {}).get("callers_per_bundle")
                ),
            }
            log(f"[stand_in] {name}: {run['ok_per_s']:.0f}/s, echo-calls per request "
                f"{per_request[name]['echo_calls_per_request']}, callers a bundle "
                f"{per_request[name]['callers_per_bundle']}")  # fmt: skip
    finally:
        for stream in streams:
            await stream.aclose()
    # The identity model's floods right after its capacity was measured, not minutes later.
    identity_capacity = per_request["identity"]["ok_per_s"]
    identity_floods, identity_after = await overload_phases(
        Target("identity", senders["identity"], observer, "identity"),
        identity_capacity,
        dataclasses.replace(settings, overload_factors=STAND_IN_OVERLOAD),
        slo_s,
        log,
        flood_rate_per_s,
    )
    stand_in = Target("stand_in", send, observer, model)
    swept = await sweep(stand_in, settings, slo_s, log, fallback_rate=0.01 * raw_best)
    goodput = swept.get("goodput_per_s") or 0.0
    bursty = await bursty_phases(stand_in, goodput, settings, slo_s, log)
    # 2x only: 10x the stand-in's goodput is past what the load generator can send on time
    # from this machine (its windows would be void, not a measure of the fabric).
    floods, after = await overload_phases(
        stand_in,
        goodput,
        dataclasses.replace(settings, overload_factors=STAND_IN_OVERLOAD),
        slo_s,
        log,
        flood_rate_per_s,
    )
    return {
        "curve": str(STAND_IN_CURVE.relative_to(REPO_ROOT)),
        "raw_best_sequences_per_s": round(raw_best, 1),
        "efficiency": round(goodput / raw_best, 4) if raw_best else None,
        **swept,
        "bursty": bursty,
        "overload": floods,
        "after_overload": after,
        "callers": CALLERS,
        "echo": {**echo, "threads_per_call": threads_per_request(echo, ["echo"])},
        "per_request": per_request,
        "identity_overload": {
            "capacity_per_s": identity_capacity,
            "floods": identity_floods,
            "after": identity_after,
        },
    }


def stand_in_lines(config: dict[str, Any]) -> list[str]:
    """The stand-in's figures for the final table."""
    if not config:
        return []
    lines = [
        f"GPU-speed stand-in ({config['curve']}): goodput {config.get('goodput_per_s') or 0:.0f}/s"
        f" = {config.get('efficiency') or 0:.3f} of the curve's best"
        f" {config['raw_best_sequences_per_s']:.0f}/s",
    ]
    for point in config.get("bursty", []):
        lines.append(f"  {bursty_name(point)} of the goodput: {bursty_line(point)}")
    for flood in config.get("overload", []):
        p99 = flood["p99_s"]["median"]
        lines.append(
            f"  {flood_name(flood)}: goodput {flood['goodput_fraction']} of it, "
            f"accepted p99 {'-' if p99 is None else f'{p99 * 1000:.0f} ms'}"
        )
    if (after := config.get("after_overload")) is not None:
        good = after["good_fraction"]
        lines.append(f"  after the floods of callers sending every call: {good:.1%} good")
    identity = config.get("identity_overload") or {}
    for flood in identity.get("floods", []):
        p99 = flood["p99_s"]["median"]
        lines.append(
            f"  identity model, {flood_name(flood)} of its "
            f"{identity['capacity_per_s']:.0f}/s at {config['callers']} callers: goodput "
            f"{flood['goodput_fraction']} of it, accepted p99 "
            f"{'-' if p99 is None else f'{p99 * 1000:.0f} ms'}"
        )
    if (after := identity.get("after")) is not None:
        lines.append(f"  identity model after its floods: {after['good_fraction']:.1%} good")
    for name, run in config.get("per_request", {}).items():
        lines.append(
            f"  {name} at {config['callers']} callers: {run['ok_per_s']:.0f}/s, echo-calls per "
            f"request {run['echo_calls_per_request']}, callers a bundle "
            f"{run.get('callers_per_bundle')}"
        )
        if threads := run.get("threads_per_request"):
            lines.append(f"    us of CPU a request by thread (switches): {threads_line(threads)}")
    if echo_threads := config.get("echo", {}).get("threads_per_call"):
        lines.append(f"  the bare echo, by thread, a call: {threads_line(echo_threads)}")
    return lines
