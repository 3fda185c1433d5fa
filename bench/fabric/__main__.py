"""The serving benchmark: open-loop goodput of the whole fabric at the model's SLO.

    python -m bench.fabric [--smoke] [--peer | --no-peer] [--window-s 5] [--windows 3] ...

In one run, on one machine: (1) the raw in-process model throughput at batch sizes 1..limit;
(2) a bare grpc.aio echo server and (3) the identity model through gateway, router and
worker, closed loop, same client, same payload size (the serving overhead); (4) the stack with
batching off (max_batch_size 1) and (5) on (the model's own config), each swept for goodput
with Poisson arrivals, then (batching on) offered at shares of its goodput with Poisson and
with bursty arrivals side by side (`--bursty-shares`, `--burstiness`); (6) overload at
multiples of the batching-on goodput, then normal traffic right after it, then the same floods
from callers that throttle themselves as the slim client does; (7) a fresh batching-on stack
under open-loop traffic from the moment it reports ready (mixed texts, half their goodput, no
warm-up); (8) optionally the same model served by Ray Serve (bench/fabric/peer_client.py);
(9) the GPU-speed stand-in: minilm timed by the H100's curve, so the tiers are the bottleneck
as on a GPU box (bench/fabric/stand_in.py; its goodput, bursty arrivals beside Poisson ones,
floods; `--stand-in-only` runs the echo baseline and this phase alone; `--flood-rate R` floods
it at R calls/s rather than at 2x each run's own capacity). Every stack serves minilm with
its default SLO (slo_p99_ms from models/minilm/config.toml, 250 ms) on short texts (8-16
tokens).

Prints progress and a final table; writes bench/results/fabric.json and fabric.png (with
--smoke: smoke.json and smoke.png, seconds-long windows, no speed assertions).
Method: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from bench.fabric.measure import (
    Progress,
    Settings,
)
from bench.fabric.phases import prepare
from bench.fabric.report import format_table, goals, max_outside_share, summarize, write_plot
from bench.fabric.stack import (
    REPO_ROOT,
)
from bench.fabric.stand_in import stand_in_lines
from bench.fabric.targets import (
    identity_request,
)
from services.common.procfs import load_average

RAY_STAMP = REPO_ROOT / ".venv-ray" / ".installed"
RESULTS = REPO_ROOT / "bench" / "results"

FULL = Settings(
    warmup_s=3.0, window_s=5.0, windows=3, probe_s=6.0, probe_concurrency=16, max_probes=7,
    growth=1.25, rel_tol=0.05, raw_seconds=2.0, overhead_s=6.0, overhead_concurrency=32,
    overload_factors=(2.0, 10.0), length_buckets=None, seed=0,
)  # fmt: skip
# Seconds-long windows. Same code path as the full run, the model's own length buckets (the
# mixed-length workload needs the long ones).
SMOKE = dataclasses.replace(
    FULL, warmup_s=0.5, window_s=1.0, probe_s=1.5, max_probes=3, growth=1.5, rel_tol=0.25,
    raw_seconds=0.3, overhead_s=1.5, throttled_floods=False,
)  # fmt: skip


class PeerUnavailable(RuntimeError):
    """--peer was asked for and the Ray Serve peer cannot run here."""


def load_peer() -> type:
    """The Ray Serve peer class, or a clear reason it cannot run (checked before measuring)."""
    try:
        from bench.fabric.peer_client import RayServePeer
    except ImportError as error:
        raise PeerUnavailable(
            f"--peer needs bench/fabric/peer_client.py with RayServePeer ({error});"
            " pass --no-peer to skip it"
        ) from None
    if not RAY_STAMP.exists():
        raise PeerUnavailable(
            f"--peer needs the Ray venv ({RAY_STAMP.relative_to(REPO_ROOT)} is missing): run "
            "`make .venv-ray/.installed`, or pass --no-peer to skip it"
        )
    return RayServePeer


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fabric",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="seconds-long tiny settings")
    parser.add_argument(
        "--stand-in-only",
        action="store_true",
        help="only the echo baseline and the GPU-speed stand-in phase (writes stand_in.json)",
    )
    parser.add_argument(
        "--peer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the Ray Serve peer (needs bench/fabric/peer_client.py and .venv-ray)",
    )
    parser.add_argument("--warmup-s", type=float, help="warm-up per rate (s)")
    parser.add_argument("--window-s", type=float, help="length of one measured window (s)")
    parser.add_argument("--windows", type=int, help="measured windows per rate (>= 3)")
    parser.add_argument("--max-probes", type=int, help="rates tried per configuration")
    parser.add_argument("--raw-seconds", type=float, help="per raw-model batch size")
    parser.add_argument("--overload", type=float, nargs="*", help="multiples of goodput")
    parser.add_argument(
        "--throttled-floods",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="offer each flood again from callers that throttle themselves as the slim client "
        "does (default: on, off with --smoke, whose warm-ups are shorter than the throttle's "
        "window)",
    )
    parser.add_argument(
        "--flood-rate",
        type=float,
        help="with --stand-in-only: flood the stand-in and the identity model at this many "
        "calls/s, not at 2x each run's own capacity, so that two trees meet the same flood",
    )
    parser.add_argument(
        "--bursty-shares",
        type=float,
        nargs="*",
        help="shares of the goodput offered with Poisson and then bursty arrivals (default "
        "0.5 0.8; none to skip)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        help="the bursty arrivals' gamma shape (default 0.1: gaps with a coefficient of "
        "variation of 3.2; 1 is Poisson)",
    )
    parser.add_argument("--seed", type=int, help="arrival schedule and text seed")
    parser.add_argument(
        "--loadgen-priority",
        choices=("rr", "nice", "none"),
        help="run the generator ahead of the stack in floods (and in a rate measured again for "
        "its late sends): SCHED_RR on a quarter of the CPUs, at least one (default), nice -5, "
        "or not at all (both need root; without it: not at all)",
    )
    parser.add_argument(
        "--loadgen-priority-below-capacity",
        choices=("rr", "nice", "none"),
        help="how the generator runs below capacity (sweeps, bursty arrivals, the traffic after "
        "floods, from ready; default none: an ordinary process), raised to --loadgen-priority "
        "for a rate it sent late (from ready is measured once: not raised)",
    )
    parser.add_argument("--output", type=Path, help="JSON path (default bench/results/...)")
    parser.add_argument("--plot", type=Path, help="PNG path (default beside the JSON)")
    parser.add_argument("--state-dir", type=Path, help="stack logs (default: a new tmp dir)")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra worker argument for both stacks, repeatable: --worker-arg=--torch-threads=1",
    )
    parser.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="extra gateway argument for every stack, repeatable: "
        "--gateway-arg=--max-concurrent-rpcs=128",
    )
    parser.add_argument(
        "--wait-quiet-s",
        type=float,
        help="before each phase (and before re-measuring a rate that other processes disturbed)"
        " wait up to this long for them to leave the CPU (default 0: warn only)",
    )
    args = parser.parse_args(argv)
    settings = SMOKE if args.smoke else FULL
    overrides = {
        "warmup_s": args.warmup_s, "window_s": args.window_s, "windows": args.windows,
        "max_probes": args.max_probes, "raw_seconds": args.raw_seconds, "seed": args.seed,
        "loadgen_priority": args.loadgen_priority, "wait_quiet_s": args.wait_quiet_s,
        "overload_factors": None if args.overload is None else tuple(args.overload),
        "throttled_floods": args.throttled_floods, "burstiness": args.burstiness,
        "loadgen_priority_below_capacity": args.loadgen_priority_below_capacity,
        "bursty_shares": None if args.bursty_shares is None else tuple(args.bursty_shares),
    }  # fmt: skip
    given = {key: value for key, value in overrides.items() if value is not None}
    settings = dataclasses.replace(settings, **given)
    if settings.windows < 1:
        parser.error("--windows must be at least 1 (the method asks for 3)")
    if not 0 < settings.burstiness < math.inf:
        parser.error("--burstiness must be a positive number (1 is Poisson)")
    if settings.burstiness == 1.0:
        parser.error("--burstiness 1 is the Poisson arrivals the bursty ones are set beside")
    if not all(0 < share < math.inf for share in settings.bursty_shares):
        parser.error("--bursty-shares must be positive shares of the goodput")
    if args.flood_rate is not None and not 0 < args.flood_rate < math.inf:
        parser.error("--flood-rate must be a positive number of calls/s")
    name = "stand_in" if args.stand_in_only else "smoke" if args.smoke else "fabric"
    args.output = args.output or RESULTS / f"{name}.json"
    args.plot = args.plot or args.output.with_suffix(".png")
    return args, settings


async def run(args: argparse.Namespace, settings: Settings, log: Progress) -> dict[str, Any]:
    peer_class = load_peer() if args.peer else None  # fail before minutes of measuring
    bench, bucket = prepare(args, settings, log)
    payload = identity_request().SerializeToString()
    if args.stand_in_only:
        bench.report["overhead"] = {"echo": await bench.stand_in(payload, bucket)}
        return bench.report
    await bench.raw_model(bucket)
    echo_result = await bench.echo(payload)
    configs = bench.report["configs"]
    configs["batching_off"] = await bench.stack_phase(
        "batching_off", bench.off_repo, bench.batching_off
    )

    async def batching_on(stack: Any, channel: grpc.aio.Channel) -> dict[str, Any]:
        return await bench.batching_on(stack, channel, echo_result, payload)

    configs["batching_on"] = await bench.stack_phase("batching_on", bench.on_repo, batching_on)
    await bench.from_ready()
    await bench.stand_in(payload, bucket)
    await bench.peer(peer_class)
    return bench.report


def _smoke_view(report: dict[str, Any]) -> dict[str, Any]:
    """smoke.json: the four ratios first, the numbers behind them, then everything."""
    summary = report["summary"]
    keys = ("efficiency", "mixed_efficiency", "batching_gain", "peer_ratio", "overhead_ratio")
    view = {key: summary[key] for key in keys}
    if summary["peer_ratio"] is None:
        view["peer_ratio_reason"] = summary.get("peer_ratio_reason")
    view["numbers"] = {k: v for k, v in summary.items() if k not in view}
    view["goals"] = report["goals"]
    view["details"] = report
    return view


def main(argv: list[str] | None = None) -> int:
    args, settings = parse_args(argv)
    log = Progress()
    started = time.time()
    try:
        report = asyncio.run(run(args, settings, log))
    except PeerUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    report["wall_s"] = round(time.time() - started, 1)
    report["machine"]["loadavg_at_end"] = load_average()
    stand_in = stand_in_lines(report["configs"].get("stand_in", {}))
    if args.stand_in_only:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print("\n" + "\n".join(stand_in))
        print(f"\nwrote {args.output}; took {report['wall_s']:.0f} s")
        return 0
    report["max_outside_cpu_share"] = max_outside_share(report)
    report["summary"] = summarize(report)
    report["goals"] = goals(report["summary"])
    skipped = write_plot(report, args.plot)
    report["plot"] = str(args.plot) if skipped is None else f"skipped: {skipped}"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = _smoke_view(report) if args.smoke else report
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print("\n" + format_table(report))
    print("\n".join(stand_in))
    print(f"\nwrote {args.output}; plot: {report['plot']}; took {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
