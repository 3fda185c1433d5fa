"""`python -m bench.sim_validation`: the same traffic through the real local stack and through the
simulator with one worker, side by side (issue 17's validation).

1. Start the stack (`services.local_stack`, one minilm worker), exactly as `make run` does.
2. Calibrate, at low load, what the simulator is given rather than what it predicts:
   - the in-stack latency curve, after some warm-up calls: for each length bucket and batch
     size, `--repeats` single requests of that many rows, sent one at a time; the median
     seconds per batch from the worker's own compute histogram (the model runs about 2x slower
     beside the other tiers than alone, so `make bench-model`'s bare curve would describe
     another machine), and the spread of every call around its point's median as the
     simulator's noise, estimated robustly (`robust_sigma`). (Rounds over every shape instead
     were tried: a one-row call right after a 64-row one runs slower than under light
     traffic, and the simulated p50 came out 0.98-1.21x at loads 0.2-0.3 over four runs,
     against 0.99-1.08x over three.)
   - the hops: the client's latency of one-row requests minus the worker's row latency;
   - the CPU the other processes spend per request (this load generator, gateway, router,
     Redis). On this CPU-only machine they share the model's
     cores, and under load that slows both the batches and the hops: the simulator's shared
     host (services/sim/host.py) models it, so the curve measured at idle still applies. With
     the model on a GPU nothing is shared (no host model), and `--rates` gives the rates in
     requests/s, since the curve's capacity there is far past what the Python tiers carry.
3. For each offered rate (fractions of the capacity the curve implies), send a seeded Poisson
   stream of one-row requests with the length mix, open loop, through the stack; then simulate
   the same rate, mix and duration with the calibrated curve and hops.
4. Print goodput (answered within the SLO, per second), p50 and p99 of both, and each
   simulator/real ratio; the issue's bound is 15%. Beside them, the mean batch size the worker
   ran and the simulator's and the compute milliseconds per batch (where they part, the real
   stack has fallen behind its curve), and the hops' mean per answer under the traffic (the
   real one is the client's mean latency less the worker's mean row latency).

The run takes about `len(rates) * (duration + a few) s` plus a minute of calibration. Step 2
is bench/sim_calibration.py's, step 4's table and verdict bench/sim_report.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.fabric.loadgen import Outcome, arrival_schedule, run_open_loop
from bench.fabric.measure import wait_quiet
from bench.fabric.observe import Observer, cpu_delta, delta, scrape
from bench.fabric.stack import BenchStack, start_stack, write_minilm_repository
from bench.sim_calibration import (
    BUCKETS,
    LENGTH_MIX,
    MODEL,
    Calibration,
    batches_of,
    calibrate,
    capacity_per_s,
    mean_hops_ms,
    text_of,
    worker_metrics_port,
)
from bench.sim_report import Run, Side, conclude, percentile, table_row
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.sim.curve import LatencyCurve
from services.sim.fleet_config import FleetConfig
from services.sim.host import HostConfig
from services.sim.simulation import Scenario, run
from services.sim.traffic import LengthMix, Stream, Traffic
from services.sim.worker import ModelSpec

#: How long calibration waits for other processes to leave the CPU, seconds.
QUIET_WAIT_S = 20.0
#: torch's intra-op threads in the worker: the local stack leaves torch its default, one per core.
MODEL_THREADS = torch.get_num_threads()
#: The worker runs the model where `select_device` puts it: on a GPU the model's compute shares no
#: cores with the tiers, so the simulator's shared host does not apply there.
MODEL_ON_GPU = torch.cuda.is_available()


def real_side(
    outcomes: Sequence[Outcome], *, warmup_s: float, window_s: float, slo_s: float
) -> Side:
    # From the scheduled time, as the simulator's latency runs from its arrival: counted from
    # the send, a call the generator (on the stack's cores) held back was good however late
    # it left (review finding).
    measured = [o for o in outcomes if o.scheduled_s >= warmup_s]
    answered = [o.response_s for o in measured if o.ok]
    good = sum(1 for o in measured if o.ok and o.response_s <= slo_s)
    return Side(
        goodput_per_s=good / window_s,
        p50_ms=percentile(answered, 50) * 1e3,
        p99_ms=percentile(answered, 99) * 1e3,
        ok_share=len(answered) / len(measured) if measured else math.nan,
        refused_share=(
            sum(1 for o in measured if o.status == "RESOURCE_EXHAUSTED") / len(measured)
            if measured
            else math.nan
        ),
    )


def length_draws(count: int, seed: int) -> list[int]:
    """Each request's tokens, from the length mix. Drawn from a generator of their own: one
    seeded alike with the schedule's drew each length from the very number that drew the gap
    before it, so every long request came after a lull and none in a clump (review finding)."""
    tokens, weights = zip(*LENGTH_MIX, strict=True)
    return random.Random(f"{seed}:lengths").choices(tokens, weights, k=count)


async def real_run(
    stub: api_grpc.InferenceServiceStub, rate: float, duration_s: float, seed: int
) -> list[Outcome]:
    """A seeded Poisson stream of one-row requests with the length mix, open loop."""
    schedule = arrival_schedule(rate, duration_s, seed)
    kinds = length_draws(len(schedule), seed)
    requests = iter(
        [
            api.PredictRequest(model_name=MODEL, inputs=[api.PredictInput(text=text_of(n))])
            for n in kinds
        ]
    )

    async def send() -> None:
        await stub.Predict(next(requests), timeout=30.0)

    return await run_open_loop(send, schedule, timeout_s=30.0, drain_timeout_s=30.0)


def sim_side(
    calibration: Calibration, rate: float, duration_s: float, warmup_s: float, seed: int
) -> tuple[Side, dict[str, Any]]:
    fleet = FleetConfig(
        workers=1,
        startup_s=0.0,
        noise_sigma=calibration.noise_sigma,
        upstream_s=calibration.hops_s * 2 / 3,
        downstream_s=calibration.hops_s / 3,
        host=HostConfig()
        if MODEL_ON_GPU
        else HostConfig(
            cores=float(os.cpu_count() or 1),
            tier_cpu_s=calibration.tier_cpu_s,
            model_threads=MODEL_THREADS,
        ),
    )
    return simulate(calibration.curve, fleet, rate, duration_s, warmup_s, seed)


def simulate(
    curve: LatencyCurve,
    fleet: FleetConfig,
    rate: float,
    duration_s: float,
    warmup_s: float,
    seed: int,
) -> tuple[Side, dict[str, Any]]:
    """The simulator's side of one run: the stack's minilm (`curve`) on `fleet`, offered a
    Poisson stream of one-row requests at the real run's rate and length mix (the simulator's
    own draws: not the real run's arrival times)."""
    model = ModelSpec(
        name=MODEL,
        slo_s=0.25,
        max_batch_size=64,
        max_batch_tokens=8192,
        length_buckets=BUCKETS,
    )
    tokens, weights = zip(*LENGTH_MIX, strict=True)
    scenario = Scenario(
        name=f"validation-{rate:.0f}",
        models=(model,),
        curves=(curve,),
        traffic=Traffic(streams=(Stream(MODEL, rate, lengths=LengthMix(tokens, weights)),)),
        duration_s=duration_s,
        warmup_s=warmup_s,
        seed=seed,
        fleet=fleet,
    )
    summary = run(scenario).summary
    offered = summary["offered_per_s"] * summary["measured_s"]
    side = Side(
        goodput_per_s=summary["goodput_per_s"],
        p50_ms=summary["latency_ms"]["p50"],
        p99_ms=summary["latency_ms"]["p99"],
        ok_share=summary["answered"] / offered,
        refused_share=sum(summary["refusals"].values()) / offered,
    )
    return side, summary


def _ms_per_request(
    cpu_s: Mapping[str, float], tiers: Mapping[str, int], requests: int
) -> dict[str, float]:
    """CPU milliseconds per request of each tier, its processes ("worker-0", ...) summed by
    the first word of their names."""
    ms: dict[str, float] = {}
    for name in tiers:
        tier = name.split("-")[0]
        ms[tier] = ms.get(tier, 0.0) + 1e3 * cpu_s.get(name, 0.0) / requests
    return ms


async def compare(
    stub: api_grpc.InferenceServiceStub,
    stack: BenchStack,
    rates: Sequence[float],
    capacity: float,
    args: argparse.Namespace,
    simulated: Callable[[float, int], tuple[Side, dict[str, Any]]],
    tiers: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Each rate `args.runs` times through the real stack and through `simulated` (rate,
    seed), each run's seed given to both (each side draws its own stream from it): one table
    row per rate. With `tiers` (a name per process id:
    every process of a tier under its name), also each tier's CPU per request of each real
    run."""
    worker_port = worker_metrics_port(stack)
    rows = []
    for index, rate in enumerate(rates):
        load = rate / capacity
        runs: list[Run] = []
        for run_index in range(args.runs):
            print(
                f"load {load:.2f}: {rate:.0f} requests/s for {args.duration_s:.0f} s"
                + (f" (run {run_index + 1} of {args.runs})" if args.runs > 1 else ""),
                flush=True,
            )
            seed = args.seed + index + 1000 * run_index
            worker_before = scrape(worker_port)
            observer = None if tiers is None else Observer(tiers)
            cpu_before = None if observer is None else observer.snapshot()
            outcomes = await real_run(stub, rate, args.duration_s, seed)
            batches = batches_of(delta(worker_before, scrape(worker_port)))
            real_cpu_ms = None
            if observer is not None and cpu_before is not None and outcomes:
                real_cpu_ms = _ms_per_request(
                    cpu_delta(cpu_before, observer.snapshot()), tiers or {}, len(outcomes)
                )
            window_s = args.duration_s - args.warmup_s
            real = real_side(outcomes, warmup_s=args.warmup_s, window_s=window_s, slo_s=0.25)
            sim, summary = simulated(rate, seed)
            runs.append(
                Run(
                    real,
                    sim,
                    summary["mean_batch_size"],
                    summary["mean_compute_ms"],
                    batches,
                    real_hops_ms=mean_hops_ms(outcomes, batches["mean_row_ms"]),
                    sim_hops_ms=summary["mean_hops_ms"],
                    real_cpu_ms=real_cpu_ms,
                )
            )
            await asyncio.sleep(2.0)  # let the backlog of an overloaded run clear
        rows.append(table_row(load, rate, runs))
    return rows


async def validate(args: argparse.Namespace, state_dir: Path) -> dict[str, Any]:
    repository = write_minilm_repository(state_dir / "repo").parent.parent
    stack = start_stack(repository, state_dir / "stack")
    try:
        async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            # What the simulator is given is measured one request at a time: other processes
            # still busy then (a previous test's stack winding down) would inflate the hops
            # and the tiers' CPU, and every simulated point after them.
            await wait_quiet(lambda line: print(line, flush=True), QUIET_WAIT_S)
            print("calibrating the curve and the hops at low load ...", flush=True)
            calibration = await calibrate(stub, stack, args.repeats)
            capacity = capacity_per_s(calibration.curve)
            print(f"calibration {json.dumps(calibration.as_dict())}", flush=True)
            print(f"capacity implied by the curve: {capacity:.0f} rows/s", flush=True)
            rates = args.rates or tuple(load * capacity for load in args.loads)

            def simulated(rate: float, seed: int) -> tuple[Side, dict[str, Any]]:
                return sim_side(calibration, rate, args.duration_s, args.warmup_s, seed)

            rows = await compare(stub, stack, rates, capacity, args, simulated)
    finally:
        stack.stop()
    return {"calibration": calibration.as_dict(), "capacity_per_s": capacity, "rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_validation", description=__doc__)
    parser.add_argument(
        "--loads",
        type=lambda text: tuple(float(x) for x in text.split(",")),
        default=(0.2, 0.35, 0.5, 0.65),
        help="offered rates as fractions of the curve's capacity (comma-separated)",
    )
    parser.add_argument(
        "--rates",
        type=lambda text: tuple(float(x) for x in text.split(",")),
        help="offered rates in requests/s instead of --loads (comma-separated): on a GPU the "
        "curve's capacity is far past what the Python tiers carry",
    )
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=5, help="requests per curve point")
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="runs per rate, each with its own seed on both sides; the table compares medians "
        "and shows the real p99's range over the runs",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sim-validation-") as tmp:
        report = asyncio.run(validate(args, Path(tmp)))
    conclude(report, ("goodput_ratio", "p50_ratio", "p99_ratio"), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
