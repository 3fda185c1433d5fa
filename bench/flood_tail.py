"""Where an overload's late answers come from: minilm flooded at fixed rates on a fresh stack,
with each tier's latency histograms over each flood's measured windows.

    python -m bench.flood_tail [RATE ...] [--worker-arg=--torch-threads=1] ...

The stack is `bench.fabric`'s batching-on stack (its minilm repository, `shed_past_slo`), on
the short uniform texts. First 16 closed-loop callers for 6 s (their answers/s: the capacity
of the moment, which drifts on a shared machine); then each rate (default 344/s, the fabric
benchmark's 2x flood) open loop with Poisson arrivals, callers allowing 4x the SLO (at least
1 s), measured as `bench.fabric` measures a rate (`measure_rate_clean`: 3 windows of 5 s by
default, measured again once, after a wait for quiet, when other processes took much of the
CPU). Per rate it prints the answers within the SLO a second, the accepted calls' p50 and
p99, the statuses and each process's CPU seconds, then, for every latency histogram of the
tiers (the gateway's request and door queue delay, the router's request and predicted wait,
the worker's queue wait, compute and row latency, every tier's event-loop lag), the count
over the measured windows (the last attempt's, as for the goodput) and the bucket bounds its
p50, p90 and p99 fall in: a tail in the worker's compute is the model's, one in its queue
wait its admission's, one only in the gateway's door queue delay the gateway's pickup. Then
where the refused calls were refused, counted over the same windows: the gateway's door and
adaptive throttle, the router, the worker's admission and its drops (a refusal costs every tier
it reached). Results go to `--output` as JSON after each rate.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import grpc

from bench.fabric.__main__ import FULL
from bench.fabric.measure import Progress, Target, closed_loop, measure_rate_clean
from bench.fabric.observe import Observer, Snapshot, delta
from bench.fabric.stack import start_stack, write_minilm_repository
from bench.fabric.targets import make_texts, predict_sender
from services.common import metric_names as names
from services.common.model_repository import load_repository
from services.gpu_worker.batching.slo_shedding import PAST_SLO

#: Histogram families read, by a part of their names.
FAMILIES = (
    "request_seconds",
    "door_queue_delay",
    "predicted_wait",
    "queue_wait",
    "row_compute",
    "row_latency",
    "loop_lag_seconds",
)
QUANTILES = (0.5, 0.9, 0.99)
#: Counters of refusals, tier by tier, each in its tier's unit: the gateway's in calls (its
#: door's, and its tenants' by reason: the adaptive throttle, quotas), the router's in requests
#: (a gateway's bundle is one), the worker's in rows (its admission's, and rows it dropped
#: unrun past their SLO bound: its other drops, cancelled or expired, are not refusals).
REFUSALS = (
    names.DOOR_REFUSED_TOTAL,
    names.GATEWAY_TENANT_REFUSED_TOTAL,
    names.ROUTER_REJECTED_TOTAL,
    names.WORKER_REJECTED_TOTAL,
    names.WORKER_DROPPED_TOTAL,
)

#: (tier, family, labels) -> {upper bound: observations at or under it}
Buckets = dict[tuple[str, str, str], dict[float, float]]


def histograms(before: Snapshot, after: Snapshot) -> Buckets:
    """The wanted histograms' bucket counts between two of the observer's snapshots (which
    scrape every tier's metrics), per tier, summed over the labels that name a version."""
    out: Buckets = {}
    for tier, samples in after.metrics.items():
        for (name, pairs), value in delta(before.metrics.get(tier, {}), samples).items():
            if not name.endswith("_bucket") or not any(f in name for f in FAMILIES):
                continue
            labels = {k: v for k, v in pairs if k not in ("le", "version")}
            family = name.removesuffix("_bucket")
            counts = out.setdefault((tier, family, json.dumps(labels, sort_keys=True)), {})
            bound = float(dict(pairs)["le"])
            counts[bound] = counts.get(bound, 0.0) + value
    return out


def refusals(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """The REFUSALS counters' increases between two snapshots, by tier, name and labels
    (those that name a version left out), the ones that grew."""
    out: dict[str, float] = {}
    for tier, samples in after.metrics.items():
        for (name, pairs), value in delta(before.metrics.get(tier, {}), samples).items():
            if name not in REFUSALS or value <= 0:
                continue
            labels = {k: v for k, v in pairs if k != "version"}
            if name == names.WORKER_DROPPED_TOTAL and labels.get("reason") != PAST_SLO:
                continue
            key = f"{tier} {name} {json.dumps(labels, sort_keys=True)}"
            out[key] = out.get(key, 0.0) + value
    return out


class SnapshotsKept(Observer):
    """The fabric benchmark's observer, keeping its snapshots: `measure_rate` takes one before
    and one after its measured windows, so the last two bound what the rate's figures cover."""

    taken: list[Snapshot]

    def snapshot(self) -> Snapshot:
        snapshot = super().snapshot()
        self.taken.append(snapshot)
        return snapshot


def quantile_bounds(buckets: dict[float, float]) -> dict[str, Any]:
    """The observations of one histogram's `buckets` (from `histograms`), and the upper bound
    of the bucket each of QUANTILES falls in."""
    bounds = sorted(buckets)
    counts = [buckets[b] for b in bounds]
    total = counts[-1] if counts else 0.0
    found: dict[str, Any] = {"count": total}
    for q in QUANTILES:
        bound = next(
            (b for b, c in zip(bounds, counts, strict=True) if total and c >= q * total), None
        )
        # JSON has no infinity: a quantile past the last finite bound is written as text.
        found[f"p{round(q * 100)}_le"] = "+Inf" if bound == float("inf") else bound
    return found


async def flood(args: argparse.Namespace) -> list[dict[str, Any]]:
    state = Path(tempfile.mkdtemp(prefix="flood-tail-"))
    repository = state / "repository"
    write_minilm_repository(repository, shed_past_slo=True)
    version = next(v for v in load_repository(repository) if v.config.name == "minilm")
    texts = make_texts(256, 0, version.weights_dir / "tokenizer.json")
    slo_s = version.config.slo_p99_ms / 1000
    settings = dataclasses.replace(
        FULL, windows=args.windows, window_s=args.window_s, warmup_s=args.warmup_s
    )
    stack = start_stack(
        repository,
        state / "stack",
        extra_gateway_args=tuple(args.gateway_arg),
        extra_worker_args=tuple(args.worker_arg),
    )
    results: list[dict[str, Any]] = []
    try:
        observer = SnapshotsKept(stack.pids(), stack.metrics_ports())
        observer.taken = []
        async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
            send = predict_sender(channel, "minilm", texts, max(1.0, 4 * slo_s))
            capacity = await closed_loop(send, 16, 6, observer=observer, model="minilm")
            print(f"16 closed-loop callers: {capacity['ok_per_s']:.1f} answers/s", flush=True)
            for rate in args.rates:
                target = Target(f"minilm {rate:g}/s", send, observer, "minilm")
                run = await measure_rate_clean(
                    target, rate, settings, slo_s, Progress(), is_flood=True
                )
                before, after = observer.taken[-2:]  # around the last attempt's windows
                found = run.to_dict()
                tails = {
                    " ".join(key): quantile_bounds(counts)
                    for key, counts in sorted(histograms(before, after).items())
                }
                results.append({
                    "rate_per_s": rate,
                    "capacity_per_s": capacity["ok_per_s"],
                    "goodput_per_s": found["goodput_per_s"],
                    "p50_s": found["p50_s"],
                    "p99_s": found["p99_s"],
                    "statuses": found["statuses"],
                    "cpu_s": found.get("cpu_s"),
                    "valid": found.get("valid"),
                    "attempts": found.get("attempts"),
                    "outside_cpu_share": found.get("outside_cpu_share"),
                    "histograms": {k: v for k, v in tails.items() if v["count"]},
                    "refusals": refusals(before, after),
                })  # fmt: skip
                print_rate(results[-1])
                write(args.output, results)
    finally:
        stack.stop()
    return results


def write(path: Path, results: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def print_rate(result: dict[str, Any]) -> None:
    goodput = result["goodput_per_s"]["median"] or 0.0
    capacity = result["capacity_per_s"]
    share = f"{goodput / capacity:.2f}" if capacity else "-"
    print(
        f"{result['rate_per_s']:g} calls/s: {goodput:.1f} answers/s within the SLO ({share} of "
        f"capacity), accepted p50 {_ms(result['p50_s']['median'])}, p99 "
        f"{_ms(result['p99_s']['median'])}; {result['statuses']}; CPU s {result['cpu_s']}; "
        f"attempts {result['attempts']}, valid {result['valid']}",
        flush=True,
    )
    for name, found in result["histograms"].items():
        bounds = " / ".join(str(found[f"p{round(q * 100)}_le"]) for q in QUANTILES)
        print(f"  {name}: {found['count']:.0f}, p50 / p90 / p99 <= {bounds} s", flush=True)
    for name, count in sorted(result["refusals"].items()):
        print(f"  refused: {name}: {count:.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rates", nargs="*", type=float, default=[344.0], help="calls/s")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--worker-arg", action="append", default=[], help="repeatable")
    parser.add_argument("--gateway-arg", action="append", default=[], help="repeatable")
    parser.add_argument("--output", type=Path, default=Path("bench/results/flood_tail.json"))
    args = parser.parse_args()
    asyncio.run(flood(args))


if __name__ == "__main__":
    main()
