"""The default stack (`make run`'s: the `models/` repository, minilm bound by callers'
deadlines, `shed_past_slo = false`) taken from cold through a burst, normal traffic, a burst
again and a flood, as traffic arrives at a service just started.

    python -m bench.cold_flood [--flood-per-s 160] [--flood-s 8] [--output PATH]

One fresh stack, one open-loop schedule of one-text Predict calls on the mixed-length texts,
each call allowing `--timeout-s` (1 s; its gRPC deadline): a burst of 64 at once on a cold
worker, 40 calls/s for 4 s, a burst of 64 again, 2 s of 40/s, then the flood (default 160/s
for 8 s, past what one 2-core stack serves) and 3 s of 40/s after it. Per phase it prints the
calls, the answers within minilm's SLO (250 ms), the accepted calls' p50 and p99, the
statuses and the three commonest refusals (who refused: the gateway, or the worker's
prediction). With deadlines alone, a flood's queue grows until the deadlines drop what it holds;
the worker's SLO shedding (services/gpu_worker/batching/slo_shedding.py) is what holds its
answers to the SLO once the queue stands. Results go to `--output` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from bench.fabric.loadgen import OK, Outcome, arrival_schedule, run_open_loop
from bench.fabric.stack import REPO_ROOT, start_stack
from bench.fabric.sweep import percentile
from bench.fabric.targets import make_mixed_texts, predict_sender
from services.common.model_repository import load_repository

BURST, NORMAL_PER_S = 64, 40.0
#: The phases as (name, calls/s or None for a burst of BURST at once, seconds), the flood's
#: between them.
Phase = tuple[str, float | None, float]
BEFORE_FLOOD: tuple[Phase, ...] = (
    ("cold_burst", None, 0.0),
    ("normal", NORMAL_PER_S, 4.0),
    ("warm_burst", None, 0.0),
    ("before_flood", NORMAL_PER_S, 2.0),
)
AFTER_FLOOD: Phase = ("after_flood", NORMAL_PER_S, 3.0)


def schedule(flood_per_s: float, flood_s: float, seed: int) -> list[tuple[str, list[float]]]:
    """The phases as (name, send offsets from the start), Poisson arrivals within each rate's
    phase (`arrival_schedule`, seeded per phase)."""
    phases: list[tuple[str, list[float]]] = []
    start_s = 0.0
    plan = (*BEFORE_FLOOD, ("flood", flood_per_s, flood_s), AFTER_FLOOD)
    for index, (name, rate_per_s, seconds) in enumerate(plan):
        if rate_per_s is None:
            phases.append((name, [start_s] * BURST))
        else:
            offsets = arrival_schedule(rate_per_s, seconds, seed + index)
            phases.append((name, [start_s + offset for offset in offsets]))
        start_s += seconds
    return phases


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 1)


def summary(outcomes: list[Outcome], errors: list[str], slo_s: float) -> dict[str, Any]:
    """Calls, answers within `slo_s`, the accepted calls' p50/p99, the statuses, and the three
    commonest refusals (`errors`: each failed call's, its figures blanked): who refused them."""
    accepted = [o.response_s for o in outcomes if o.status == OK]
    refusals = Counter(re.sub(r"[0-9][0-9.]*", "N", e) for e in errors)
    return {
        "calls": len(outcomes),
        "good": sum(latency <= slo_s for latency in accepted),
        # Sends the generator held back (their wait counts in the latencies above).
        "late": sum(o.late for o in outcomes),
        **{f"p{q}_ms": _ms(percentile(accepted, q)) for q in (50, 99)},
        "statuses": dict(Counter(o.status for o in outcomes)),
        "refused_by": dict(refusals.most_common(3)),
    }


async def measure(address: str, slo_s: float, args: argparse.Namespace) -> dict[str, Any]:
    phases = schedule(args.flood_per_s, args.flood_s, args.seed)
    offsets = [offset for _, phase in phases for offset in phase]
    errors: dict[int, str] = {}  # each failed call's status and details, by send order
    order = itertools.count()  # sends start in schedule order (run_open_loop)
    async with grpc.aio.insecure_channel(address) as channel:
        send = predict_sender(channel, "minilm", make_mixed_texts(512, args.seed), args.timeout_s)

        async def noted() -> None:
            index = next(order)
            try:
                await send()
            except grpc.aio.AioRpcError as error:
                errors[index] = f"{error.code().name}: {error.details()}"
                raise

        outcomes = await run_open_loop(noted, offsets, timeout_s=args.timeout_s + 1.0)
    results, first = {}, 0
    for name, phase in phases:
        end = first + len(phase)
        failed = [errors[i] for i in range(first, end) if i in errors]
        results[name] = summary(outcomes[first:end], failed, slo_s)
        first = end
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood-per-s", type=float, default=160.0)
    parser.add_argument("--flood-s", type=float, default=8.0)
    parser.add_argument("--timeout-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", type=Path, default=Path("bench/results/cold_flood.json"))
    args = parser.parse_args()
    repository = REPO_ROOT / "models"
    version = next(v for v in load_repository(repository) if v.config.name == "minilm")
    slo_s = version.config.slo_p99_ms / 1000
    with tempfile.TemporaryDirectory(prefix="cold-flood-") as state_dir:
        stack = start_stack(repository, Path(state_dir))
        try:
            results = asyncio.run(measure(stack.gateway_address, slo_s, args))
        finally:
            stack.stop()
    for name, figures in results.items():
        print(f"{name:>13}: {json.dumps(figures)}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"args": vars(args) | {"output": str(args.output)},
                                       "phases": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
