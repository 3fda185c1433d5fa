"""The fabric with every tier spread over a machine's cores: what a GPU box serves when the
tiers scale out (issue 32's GPU goal: goodput within the SLO at least 0.5 of the raw model's
best batch, with several gateway processes, two routers and the load from several processes).

    python -m bench.spread [--stand-in] [--gateway-processes G] [--routers R] [--workers W]
        [--generators L] [--rates 500 1000 ...] [--window-s 5] [--warmup-s 2] [--output F]

One stack (`services.local_stack`, as `make run` starts it) serves minilm: on the device the
worker picks, or with `--stand-in` as the GPU-speed stand-in (the H100 curve asleep, so the
tiers bind as on a GPU box). `L` generator processes each send an open-loop Poisson share of
every rate, one text per Predict call, over connections of their own (the gateway's processes
share its port by SO_REUSEPORT, so connections spread over them). For each rate it reports the
goodput (answers within the model's SLO per second), latency, statuses, how late the
generators sent (a rate they could not send on time measures them, not the fabric) and each
tier's CPU per request, its processes and their children together. The goodput's fraction of
the raw model's best (the curve's for the stand-in, measured in this process otherwise) is the
issue's figure. Method: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.fabric.loadgen import arrival_schedule, run_open_loop
from bench.fabric.observe import scrape, total
from bench.fabric.stack import BenchStack, start_stack, write_minilm_repository
from bench.fabric.stand_in import STAND_IN_CURVE, best_rate, tier_of_processes, worker_args
from bench.fabric.targets import make_texts
from services.common import metric_names as names
from services.common.procfs import descendants, read_stat, read_thread_stat

#: Tokens per text of the workload (bench.fabric's short texts: 8-16 tokens, one bucket).
BUCKET = 16
#: The raw model's best batch is measured at this batch size.
RAW_BATCH = 64
#: A rate whose generators sent more than this share late is marked as generator-bound.
MAX_LATE_SHARE = 0.01
#: Each call allows this many times the SLO (issue 33's callers allow 4x).
TIMEOUT_SLOS = 4.0
#: How long a generator process may take to start (spawn, imports, channels ready), seconds.
STARTUP_TIMEOUT_S = 60.0


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    cpus = len(os.sched_getaffinity(0))
    gateways = args.gateway_processes or max(1, cpus // 4)
    generators = args.generators or max(1, cpus // 4)
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="bench-spread-"))
    repository = state_dir / "repository"
    write_minilm_repository(repository)
    raw = _raw_best(args.stand_in, repository, args.raw_seconds)
    print(f"raw best: {raw['sequences_per_s']:.0f} sequences/s ({raw['source']})", flush=True)
    stack = start_stack(
        repository,
        state_dir,
        extra_worker_args=worker_args() if args.stand_in else (),
        extra_gateway_args=(f"--processes={gateways}",),
        launcher_args=("--num-routers", str(args.routers), "--num-workers", str(args.workers)),
    )
    try:
        slo_s = _slo_s(repository)
        results = _sweep(stack, args, generators, slo_s, raw["sequences_per_s"])
        routed = {
            name: total(scrape(port), names.ROUTER_ROUTED_TOTAL)
            for name, port in stack.metrics_ports().items()
            if name.startswith("router")
        }
    finally:
        stack.stop()
    # The best of the rates sent on time; if none was (a machine too small for its load), the
    # best of all, marked as such.
    on_time = [r for r in results if not r["generator_bound"]]
    best = max(on_time or results, key=_goodput)
    report = {
        "cpus": cpus,
        "stand_in": args.stand_in,
        "gateway_processes": gateways,
        "routers": args.routers,
        "workers": args.workers,
        "generators": generators,
        "routed_by_router": routed,
        "slo_ms": slo_s * 1000,
        "raw": raw,
        "rates": results,
        "best_goodput_per_s": best["goodput_per_s"],
        "fraction_of_raw": best["fraction_of_raw"],
        "best_is_generator_bound": not on_time,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rates"}, indent=2))


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.spread",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--stand-in", action="store_true", help="the GPU-speed stand-in")
    parser.add_argument("--gateway-processes", type=int, default=0, help="0: a quarter of CPUs")
    parser.add_argument("--routers", type=int, default=2)
    parser.add_argument(
        "--workers", type=int, default=1, help="worker processes (sharing the one device)"
    )
    parser.add_argument("--generators", type=int, default=0, help="0: a quarter of the CPUs")
    parser.add_argument(
        "--connections", type=int, default=4, help="connections per generator process"
    )
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[500, 1000, 2000], help="requests/s offered"
    )
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--raw-seconds", type=float, default=2.0, help="the raw model's timing")
    parser.add_argument("--state-dir", default=None, help="stack logs (default: a tmp dir)")
    parser.add_argument("--output", type=Path, default=Path("bench/results/spread.json"))
    args = parser.parse_args(argv)
    if min(args.routers, args.workers, args.connections) < 1 or min(args.rates) <= 0:
        parser.error("--routers, --workers, --connections and every rate must be positive")
    return args


def _raw_best(is_stand_in: bool, repository: Path, seconds: float) -> dict[str, Any]:
    """The raw model's sequences/s at its best batch: the stand-in's curve, or minilm measured
    here on the device the worker would use (before the stack starts)."""
    if is_stand_in:
        rate = best_rate(STAND_IN_CURVE, BUCKET)
        return {"sequences_per_s": rate, "source": f"curve {STAND_IN_CURVE.name}"}
    from bench.raw_model import measure
    from services.common.model_repository import load_repository
    from services.gpu_worker.backends import load_backend
    from services.gpu_worker.backends.base import select_device

    version = next(v for v in load_repository(repository) if v.config.name == "minilm")
    backend = load_backend(version, select_device())
    rate = measure(backend, BUCKET, RAW_BATCH, seconds)
    source = f"minilm at batch {RAW_BATCH}, {BUCKET} tokens, on {backend.device}"
    del backend
    return {"sequences_per_s": rate, "source": source}


def _slo_s(repository: Path) -> float:
    from services.common.model_repository import load_repository

    version = next(v for v in load_repository(repository) if v.config.name == "minilm")
    return version.config.slo_p99_ms / 1000


def _sweep(
    stack: BenchStack, args: argparse.Namespace, generators: int, slo_s: float, raw_per_s: float
) -> list[dict[str, Any]]:
    tiers = _tier_pids(stack.pids())
    texts = make_texts(512, seed=0)
    results = []
    for rate in args.rates:
        result = _measure_rate(stack, args, generators, rate, slo_s, texts, tiers)
        result["fraction_of_raw"] = round(result["goodput_per_s"] / raw_per_s, 4)
        results.append(result)
        print(
            f"{rate:>8.0f}/s offered: goodput {result['goodput_per_s']:.0f}/s "
            f"({result['fraction_of_raw']:.3f} of raw), p99 {result['p99_ms']} ms, "
            f"late {result['late_share']:.3f}, CPU ms per request {result['cpu_ms_per_request']}, "
            f"busiest event loop (cores) {result['busiest_loop_cores']}",
            flush=True,
        )
    return results


def _goodput(result: Mapping[str, Any]) -> float:
    return float(result["goodput_per_s"])


def _tier_pids(pids: Mapping[str, int]) -> dict[str, list[int]]:
    """The stack's processes (BenchStack.pids) by tier (their children are added at each
    read)."""
    tiers: dict[str, list[int]] = {}
    for name, tier in tier_of_processes(pids).items():
        tiers.setdefault(tier, []).append(pids[name])
    return tiers


def _processes(tiers: Mapping[str, list[int]]) -> dict[str, set[int]]:
    """Each tier's processes and all their descendants."""
    return {
        tier: {pid for root in pids for pid in (root, *descendants(root))}
        for tier, pids in tiers.items()
    }


def _cpu_s(processes: Mapping[str, set[int]]) -> dict[str, float]:
    """CPU seconds so far of each tier's processes."""
    seconds: dict[str, float] = {}
    for tier, pids in processes.items():
        stats = (read_stat(pid) for pid in pids)
        seconds[tier] = sum(stat.cpu_s for stat in stats if stat is not None)
    return seconds


def _loops_s(processes: Mapping[str, set[int]]) -> dict[str, dict[int, float]]:
    """CPU seconds so far of the first thread (its event loop) of each tier's processes, by
    pid."""
    seconds: dict[str, dict[int, float]] = {}
    for tier, pids in processes.items():
        stats = {pid: read_thread_stat(pid, pid) for pid in pids}
        seconds[tier] = {pid: stat.cpu_s for pid, stat in stats.items() if stat is not None}
    return seconds


def busiest_loops(
    before: Mapping[str, Mapping[int, float]],
    after: Mapping[str, Mapping[int, float]],
    window_s: float,
) -> dict[str, float]:
    """Per tier, the share of a core its busiest process's event-loop thread used over
    `window_s`: near 1, that loop is saturated, whatever the tier's other cores do."""
    return {
        tier: round(max((s - before[tier].get(pid, 0.0) for pid, s in loops.items()),
                        default=0.0) / window_s, 3)
        for tier, loops in after.items() if tier in before
    }  # fmt: skip


def _measure_rate(
    stack: BenchStack,
    args: argparse.Namespace,
    generators: int,
    rate: float,
    slo_s: float,
    texts: list[str],
    tiers: Mapping[str, list[int]],
) -> dict[str, Any]:
    """One rate: generators started together, CPU read around the measured window."""
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    pipes, processes = [], []
    for index in range(generators):
        receiver, sender = context.Pipe(duplex=False)
        plan = {
            "address": stack.gateway_address,
            "texts": texts,
            "rate_per_s": rate / generators,
            "duration_s": args.warmup_s + args.window_s,
            "window": (args.warmup_s, args.warmup_s + args.window_s),
            "seed": 1000 * index + int(rate),
            "connections": args.connections,
            "timeout_s": TIMEOUT_SLOS * slo_s,
            "slo_s": slo_s,
        }
        process = context.Process(target=_generate, args=(plan, start, sender), daemon=True)
        process.start()
        sender.close()  # the child's copy is its own: a child that dies closes the pipe
        pipes.append(receiver)
        processes.append(process)
        # Imports done and channels connected.
        _expect(receiver, process, STARTUP_TIMEOUT_S, index, lambda m: m == "ready")
    start.set()
    time.sleep(args.warmup_s)
    served_by = _processes(tiers)
    cpu_before, loops_before, at_before = _cpu_s(served_by), _loops_s(served_by), time.monotonic()
    time.sleep(args.window_s)
    served_by = _processes(tiers)
    cpu_after, loops_after, at_after = _cpu_s(served_by), _loops_s(served_by), time.monotonic()
    # The schedule ends with the window; the calls still pending then get their timeout.
    summaries = [
        _expect(pipe, process, 2 * plan["timeout_s"] + 30, index, lambda m: isinstance(m, dict))
        for index, (pipe, process) in enumerate(zip(pipes, processes, strict=True))
    ]
    for process in processes:
        process.join(timeout=30)
    figures = _combine(rate, summaries, cpu_before, cpu_after, at_after - at_before, args.window_s)
    figures["busiest_loop_cores"] = busiest_loops(loops_before, loops_after, at_after - at_before)
    return figures


def _expect(
    pipe: Connection,
    process: Any,
    timeout_s: float,
    index: int,
    is_expected: Callable[[Any], bool],
) -> Any:
    """The generator's next message, if it is what is expected within `timeout_s`; raises
    naming the generator otherwise (an error it sent, its exit, or silence)."""
    if pipe.poll(timeout_s):
        try:
            message = pipe.recv()
        except EOFError:
            message = f"exited with code {process.exitcode}"
        if is_expected(message):
            return message
    else:
        message = f"nothing within {timeout_s:.0f} s (exit code {process.exitcode})"
    for other in multiprocessing.active_children():
        other.terminate()
    raise RuntimeError(f"generator {index} failed: {message}")


def _combine(
    rate: float,
    summaries: Sequence[Mapping[str, Any]],
    cpu_before: Mapping[str, float],
    cpu_after: Mapping[str, float],
    cpu_window_s: float,
    window_s: float,
) -> dict[str, Any]:
    """One rate's figures from every generator's window."""
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    sent = late = good = 0
    for summary in summaries:
        statuses.update(summary["statuses"])
        latencies += summary["ok_latencies_s"]
        sent += summary["sent"]
        late += summary["late"]
        good += summary["good"]
    cpu_s = {tier: cpu_after[tier] - cpu_before[tier] for tier in cpu_after}
    per_request = {
        tier: round(1000 * seconds / sent, 3) if sent else None for tier, seconds in cpu_s.items()
    }
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else None
    late_share = late / sent if sent else 0.0
    return {
        "offered_per_s": rate,
        "sent_in_window": sent,
        "goodput_per_s": round(good / window_s, 1),
        "ok_per_s": round(len(latencies) / window_s, 1),
        "p50_ms": None if quantiles is None else round(1000 * quantiles[49], 1),
        "p99_ms": None if quantiles is None else round(1000 * quantiles[98], 1),
        "statuses": dict(statuses),
        "late_share": round(late_share, 4),
        "generator_bound": late_share > MAX_LATE_SHARE,
        "cpu_cores": {t: round(s / cpu_window_s, 2) for t, s in cpu_s.items()},
        "cpu_ms_per_request": per_request,
    }


def _generate(plan: dict[str, Any], start: Any, results: Connection) -> None:
    """One generator process: its share of the rate, open loop, until the schedule ends."""
    try:
        summary = asyncio.run(_generate_async(plan, start, results))
    except BaseException as error:  # the parent hears of it rather than waiting for ever
        results.send(f"{type(error).__name__}: {error}")
        raise
    results.send(summary)


async def _generate_async(plan: dict[str, Any], start: Any, results: Connection) -> dict[str, Any]:
    import grpc

    from bench.fabric.targets import predict_sender

    own_connection = (("grpc.use_local_subchannel_pool", 1),)
    channels = [
        grpc.aio.insecure_channel(plan["address"], options=own_connection)
        for _ in range(plan["connections"])
    ]
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
    senders = [predict_sender(c, "minilm", plan["texts"], plan["timeout_s"]) for c in channels]
    turn = 0

    async def send() -> None:
        nonlocal turn
        turn += 1
        await senders[turn % len(senders)]()

    schedule = arrival_schedule(plan["rate_per_s"], plan["duration_s"], plan["seed"])
    results.send("ready")
    await asyncio.get_running_loop().run_in_executor(None, start.wait)
    outcomes = await run_open_loop(send, schedule, timeout_s=plan["timeout_s"])
    await asyncio.gather(*(channel.close() for channel in channels))
    first_s, stop_s = plan["window"]
    window = [o for o in outcomes if first_s <= o.scheduled_s < stop_s]
    ok = [o.latency_s for o in window if o.ok]
    return {
        "sent": len(window),
        "late": sum(o.late for o in window),
        "good": sum(latency <= plan["slo_s"] for latency in ok),
        "ok_latencies_s": ok,
        "statuses": dict(Counter(o.status for o in window)),
    }


if __name__ == "__main__":
    sys.exit(main())
