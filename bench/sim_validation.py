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

The run takes about `len(rates) * (duration + a few) s` plus a minute of calibration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.fabric.loadgen import Outcome, poisson_schedule, run_open_loop
from bench.fabric.measure import wait_quiet
from bench.fabric.observe import Observer, Samples, cpu_delta, delta, scrape, total
from bench.fabric.stack import BenchStack, start_stack, write_minilm_repository
from services.common import metric_names as names
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.sim.curve import LatencyCurve
from services.sim.fleet_config import FleetConfig
from services.sim.host import HostConfig
from services.sim.simulation import Scenario, run
from services.sim.traffic import LengthMix, Stream, Traffic
from services.sim.worker import ModelSpec

MODEL = "minilm"
#: Token counts of the two request kinds (special tokens included) and their shares.
SHORT_TOKENS, LONG_TOKENS = 12, 100
LENGTH_MIX = ((SHORT_TOKENS, 0.85), (LONG_TOKENS, 0.15))
LENGTHS = (SHORT_TOKENS, LONG_TOKENS)
#: Batch sizes the curve is measured at; the simulator's latency model interpolates between.
CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: The length buckets of the minilm repository the stack serves.
BUCKETS = (16, 32, 64, 128, 256)
#: The issue's bound on |simulated / real - 1|.
TOLERANCE = 0.15
#: One-row calls of each length sent before calibrating, unmeasured.
WARM_UP_CALLS = 20
#: Passes over every curve shape (each `--repeats` calls per shape). In one calibration the
#: first shape, one 12-token row, measured 8.4 ms in one pass where other calibrations gave
#: 5.9-6.4.
CURVE_PASSES = 2
#: One-row calls, one at a time, that the hops and the tiers' CPU are measured over. The tiers'
#: background work (heartbeats, refreshes) lands on whichever calls it overlaps: over 40 calls
#: the tiers' CPU per request measured 5.25-6.75 ms on one stack, over 200 5.65 ms twice.
HOP_CALLS = 200
#: How long calibration waits for other processes to leave the CPU, seconds.
QUIET_WAIT_S = 20.0
#: torch's intra-op threads in the worker: the local stack leaves torch its default, one per core.
MODEL_THREADS = torch.get_num_threads()
#: The worker runs the model where `select_device` puts it: on a GPU the model's compute shares no
#: cores with the tiers, so the simulator's shared host does not apply there.
MODEL_ON_GPU = torch.cuda.is_available()


def text_of(num_tokens: int) -> str:
    """A text that minilm's tokenizer turns into `num_tokens` tokens ([CLS] and [SEP] included):
    "hello" is one word piece."""
    return " ".join(["hello"] * (num_tokens - 2))


@dataclass(frozen=True)
class Calibration:
    curve: LatencyCurve
    #: Lognormal sigma of batch compute around its point, over every measured call (robust).
    noise_sigma: float
    #: Client latency minus the worker's row latency, one-row requests at low load.
    hops_s: float
    #: CPU seconds per request the processes sharing the model's cores (load generator,
    #: gateway, router, Redis) spend, at low load.
    tier_cpu_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "curve_ms": {
                f"{bucket}x{size}": round(seconds * 1e3, 3)
                for (bucket, size), seconds in self.curve.points
            },
            "noise_sigma": round(self.noise_sigma, 3),
            "hops_ms": round(self.hops_s * 1e3, 3),
            "tier_cpu_ms": round(self.tier_cpu_s * 1e3, 3),
        }


def _bucket_of(num_tokens: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= num_tokens)


async def calibrate(
    stub: api_grpc.InferenceServiceStub, stack: BenchStack, repeats: int
) -> Calibration:
    """Measures the curve and the hops through the running stack (see the module's doc)."""
    worker_port = worker_metrics_port(stack)
    # A stack fresh from start-up answers its first calls slower (allocations, caches): they
    # would inflate the one-row points, which light loads run most.
    for _ in range(WARM_UP_CALLS):
        for num_tokens in LENGTHS:
            request = api.PredictRequest(
                model_name=MODEL, inputs=[api.PredictInput(text=text_of(num_tokens))]
            )
            await stub.Predict(request, timeout=30.0)
    # Every shape in the same order in each pass; a shape's point is the median over all
    # passes, so a disturbance that lasts through one pass's calls at a shape moves no point.
    calls: dict[tuple[int, int], list[float]] = {}
    for _ in range(CURVE_PASSES):
        for num_tokens in LENGTHS:
            bucket = _bucket_of(num_tokens, BUCKETS)
            for size in CURVE_SIZES:
                seconds = await _curve_calls(stub, worker_port, num_tokens, size, repeats)
                if len(seconds) < repeats:
                    break  # past the SLO-derived batch cap: the worker splits this size
                calls.setdefault((bucket, size), []).extend(seconds)
    points: list[dict[str, Any]] = []
    log_ratios: list[float] = []
    for (bucket, size), seconds in calls.items():
        if len(seconds) < CURVE_PASSES * repeats:
            continue  # at the cap, split in some pass
        # The median: one call slowed by the machine's other work would move a mean.
        typical = statistics.median(seconds)
        points.append({"bucket": bucket, "batch_size": size, "seconds": typical})
        log_ratios += [math.log(s / typical) for s in seconds]
    hops_s, tier_cpu_s = await measure_hops(stub, stack, HOP_CALLS)
    return Calibration(
        curve=LatencyCurve.from_mapping({"points": points}),
        noise_sigma=robust_sigma(log_ratios),
        hops_s=hops_s,
        tier_cpu_s=tier_cpu_s,
    )


async def _curve_calls(
    stub: api_grpc.InferenceServiceStub, worker_port: int, num_tokens: int, size: int, repeats: int
) -> list[float]:
    """The worker's compute seconds of `repeats` calls of `size` rows of `num_tokens` tokens,
    sent one at a time after an unmeasured first call; fewer if the worker split one (the
    SLO caps its batches)."""
    bucket = _bucket_of(num_tokens, BUCKETS)
    inputs = [api.PredictInput(text=text_of(num_tokens))]
    request = api.PredictRequest(model_name=MODEL, inputs=inputs * size)
    await stub.Predict(request, timeout=30.0)
    labels = {"model": MODEL, "bucket": str(bucket)}
    seconds: list[float] = []
    for _ in range(repeats):
        before = scrape(worker_port)
        await stub.Predict(request, timeout=30.0)
        after = delta(before, scrape(worker_port))
        if total(after, f"{names.WORKER_COMPUTE_SECONDS}_count", **labels) != 1:
            print(f"bucket {bucket}: batches capped below {size} rows by the SLO", flush=True)
            break
        seconds.append(total(after, f"{names.WORKER_COMPUTE_SECONDS}_sum", **labels))
    return seconds


def robust_sigma(log_ratios: Sequence[float]) -> float:
    """The spread of the calls' log ratios to their point's median, from their median absolute
    deviation (1.4826 x MAD is a normal's sigma). Why not their standard deviation: most calls
    land within 2-3% of their point (a robust sigma of 0.022-0.027 over three calibrations),
    and the few that do not, 20-110% slow, are the other tiers' periodic work landing on that
    call. Under traffic that interference is the shared host's part of the model (host.py),
    which stretches batches by the tiers' measured load; counted as noise as well, one such
    call set the sigma anywhere from 0.07 to 0.20, and the simulated p99 followed it (1.25x and
    1.38x the real one at loads 0.2 and 0.3 with 0.20; 1.11x and 1.12x re-simulated with the
    robust 0.025)."""
    if not log_ratios:
        return 0.0
    centre = statistics.median(log_ratios)
    return 1.4826 * statistics.median(abs(x - centre) for x in log_ratios)


async def measure_hops(
    stub: api_grpc.InferenceServiceStub, stack: BenchStack, count: int
) -> tuple[float, float]:
    """One-row requests one at a time (no batching, no backlog): the hops' latency (client
    latency minus the worker's row latency) and the CPU the load generator (this process), the
    gateway, the router and Redis spend per request."""
    request = api.PredictRequest(model_name=MODEL, inputs=[api.PredictInput(text=text_of(12))])
    worker_name = next(name for name in stack.metrics_ports() if name.startswith("worker"))
    observer = Observer(stack.pids(), {worker_name: stack.metrics_ports()[worker_name]})
    before = observer.snapshot()
    client_s = 0.0
    for _ in range(count):
        started = time.monotonic()
        await stub.Predict(request, timeout=30.0)
        client_s += time.monotonic() - started
        await asyncio.sleep(0.02)
    after_snapshot = observer.snapshot()
    after = delta(before.metrics[worker_name], after_snapshot.metrics[worker_name])
    rows = total(after, f"{names.WORKER_ROW_LATENCY_SECONDS}_count", model=MODEL)
    worker_s = total(after, f"{names.WORKER_ROW_LATENCY_SECONDS}_sum", model=MODEL) / rows
    # The worker's process is left out: its CPU between requests is mostly torch's threads
    # spinning after each batch (yielding under contention), which per request would count as
    # several milliseconds the tiers never take from the model.
    cpu = cpu_delta(before, after_snapshot)
    tiers_cpu_s = sum(
        seconds
        for name, seconds in cpu.items()
        if name != "outside_bench" and not name.startswith("worker")
    )
    return max(0.0, client_s / count - worker_s), tiers_cpu_s / count


def worker_metrics_port(stack: BenchStack) -> int:
    return next(p for name, p in stack.metrics_ports().items() if name.startswith("worker"))


def batches_of(worker_delta: Samples) -> dict[str, float]:
    """Mean rows and compute milliseconds per batch the worker ran, and the mean milliseconds
    from a row's arrival at the worker to its answer, from a metrics delta."""
    count = total(worker_delta, f"{names.WORKER_BATCH_SIZE}_count", model=MODEL)
    num_rows = total(worker_delta, f"{names.WORKER_ROW_LATENCY_SECONDS}_count", model=MODEL)
    if not count or not num_rows:
        return {"mean_size": math.nan, "mean_compute_ms": math.nan, "mean_row_ms": math.nan}
    rows = total(worker_delta, f"{names.WORKER_BATCH_SIZE}_sum", model=MODEL)
    compute_s = total(worker_delta, f"{names.WORKER_COMPUTE_SECONDS}_sum", model=MODEL)
    row_s = total(worker_delta, f"{names.WORKER_ROW_LATENCY_SECONDS}_sum", model=MODEL)
    return {
        "mean_size": rows / count,
        "mean_compute_ms": compute_s / count * 1e3,
        "mean_row_ms": row_s / num_rows * 1e3,
    }


def mean_hops_ms(outcomes: Sequence[Outcome], worker_row_ms: float) -> float:
    """The hops' mean under traffic: the answered calls' mean latency (the whole run, as the
    worker's metrics delta covers) minus the worker's mean row latency."""
    answered = [o.latency_s for o in outcomes if o.ok]
    return statistics.fmean(answered) * 1e3 - worker_row_ms if answered else math.nan


def capacity_per_s(curve: LatencyCurve) -> float:
    """Rows per second one worker serves with the largest batches measured for each bucket
    (the worker's SLO-derived cap, or 64), over the length mix."""
    seconds = dict(curve.points)
    per_row = 0.0
    for tokens, share in LENGTH_MIX:
        bucket = _bucket_of(tokens, BUCKETS)
        largest = max(size for b, size in seconds if b == bucket)
        per_row += share * seconds[(bucket, largest)] / largest
    return 1.0 / per_row


@dataclass(frozen=True)
class Side:
    goodput_per_s: float
    p50_ms: float
    p99_ms: float
    ok_share: float
    #: Share refused for load (RESOURCE_EXHAUSTED): past capacity, or a queue standing because
    #: the machine slowed (the worker's standing-queue rule, services/gpu_worker/batching/
    #: slo_shedding.py, on both sides).
    refused_share: float


def _percentile(values: Sequence[float], rank: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(rank / 100 * len(ordered)) - 1))]


def real_side(
    outcomes: Sequence[Outcome], *, warmup_s: float, window_s: float, slo_s: float
) -> Side:
    measured = [o for o in outcomes if o.scheduled_s >= warmup_s]
    answered = [o.latency_s for o in measured if o.ok]
    good = sum(1 for o in measured if o.ok and o.latency_s <= slo_s)
    return Side(
        goodput_per_s=good / window_s,
        p50_ms=_percentile(answered, 50) * 1e3,
        p99_ms=_percentile(answered, 99) * 1e3,
        ok_share=len(answered) / len(measured) if measured else math.nan,
        refused_share=(
            sum(1 for o in measured if o.status == "RESOURCE_EXHAUSTED") / len(measured)
            if measured
            else math.nan
        ),
    )


async def real_run(
    stub: api_grpc.InferenceServiceStub, rate: float, duration_s: float, seed: int
) -> list[Outcome]:
    """A seeded Poisson stream of one-row requests with the length mix, open loop."""
    schedule = poisson_schedule(rate, duration_s, seed)
    rng = random.Random(seed)
    tokens, weights = zip(*LENGTH_MIX, strict=True)
    kinds = rng.choices(tokens, weights, k=len(schedule))
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
    """The simulator's side of one run: the stack's minilm (`curve`) on `fleet`, offered the
    real run's Poisson stream of one-row requests with the length mix."""
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


def _median_side(sides: Sequence[Side]) -> Side:
    return Side(
        *(statistics.median(getattr(side, name) for side in sides) for name in Side.__annotations__)
    )


@dataclass(frozen=True)
class Run:
    """One seeded run of a load on both sides."""

    real: Side
    sim: Side
    #: Mean rows and compute milliseconds per batch the simulator ran.
    sim_batch_size: float
    sim_compute_ms: float
    #: What the real worker ran (`batches_of`): mean rows and compute milliseconds per batch.
    real_batches: dict[str, float]
    #: Mean milliseconds of the hops (client to worker and back) per answer, each side.
    real_hops_ms: float
    sim_hops_ms: float
    #: Each tier's CPU milliseconds per request sent over the real run (with an observer).
    real_cpu_ms: dict[str, float] | None = None


def _row(load: float, rate: float, runs: Sequence[Run]) -> dict[str, Any]:
    """One load's runs: the medians of each side (the same seeds on both; a run the machine's
    other work disturbed moves no median of three), their ratios, and the real stack's own
    spread of p99 over the runs."""
    real = _median_side([run.real for run in runs])
    sim = _median_side([run.sim for run in runs])
    real_p99s = [run.real.p99_ms for run in runs]
    return {
        "load": load,
        "rate_per_s": rate,
        "runs": len(runs),
        "real": real.__dict__,
        "sim": sim.__dict__,
        "real_p99_ms_range": [min(real_p99s), max(real_p99s)],
        "sim_batches": statistics.fmean(run.sim_batch_size for run in runs),
        # What the worker ran over the whole real run (warm-up included): a batch size or
        # compute far from the simulator's says which part of the model is off.
        "real_batches": statistics.fmean(run.real_batches["mean_size"] for run in runs),
        "real_compute_ms": statistics.fmean(run.real_batches["mean_compute_ms"] for run in runs),
        "sim_compute_ms": statistics.fmean(run.sim_compute_ms for run in runs),
        # The hops under traffic: the simulated ones stretch only once the tiers outgrow the
        # cores (host.py), and the real ones say whether that holds.
        "real_hops_ms": statistics.fmean(run.real_hops_ms for run in runs),
        "sim_hops_ms": statistics.fmean(run.sim_hops_ms for run in runs),
        "goodput_ratio": ratio(sim.goodput_per_s, real.goodput_per_s),
        "p50_ratio": ratio(sim.p50_ms, real.p50_ms),
        "p99_ratio": ratio(sim.p99_ms, real.p99_ms),
        "per_run": [{"real": run.real.__dict__, "sim": run.sim.__dict__} for run in runs],
        "real_cpu_ms_per_request": _mean_cpu_ms([r.real_cpu_ms for r in runs]),
    }


def _mean_cpu_ms(runs: Sequence[dict[str, float] | None]) -> dict[str, float] | None:
    measured = [r for r in runs if r is not None]
    if not measured:
        return None
    return {tier: round(statistics.fmean(r[tier] for r in measured), 3) for tier in measured[0]}


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


def ratio(sim: float, real: float) -> float:
    return sim / real if real else math.nan


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'rate/s':>7} {'load':>5} | {'goodput real':>12} {'sim':>7} {'ratio':>6} | "
        f"{'p50 real':>8} {'sim':>7} {'ratio':>6} | {'p99 real':>8} {'sim':>7} {'ratio':>6} "
        f"{'real range':>13} | {'batch real':>10} {'sim':>5} | {'compute real':>12} {'sim':>5} | "
        f"{'hops real':>9} {'sim':>5}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        real, sim = row["real"], row["sim"]
        low, high = row["real_p99_ms_range"]
        lines.append(
            f"{row['rate_per_s']:7.0f} {row['load']:5.2f} | "
            f"{real['goodput_per_s']:12.1f} {sim['goodput_per_s']:7.1f} "
            f"{row['goodput_ratio']:6.3f} | "
            f"{real['p50_ms']:8.1f} {sim['p50_ms']:7.1f} {row['p50_ratio']:6.3f} | "
            f"{real['p99_ms']:8.1f} {sim['p99_ms']:7.1f} {row['p99_ratio']:6.3f} "
            f"{low:6.1f}-{high:<6.1f} | "
            f"{row['real_batches']:10.2f} {row['sim_batches']:5.2f} | "
            f"{row['real_compute_ms']:12.1f} {row['sim_compute_ms']:5.1f} | "
            f"{row['real_hops_ms']:9.1f} {row['sim_hops_ms']:5.1f}"
        )
    return "\n".join(lines)


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
    seed), with the same seeds: one table row per rate. With `tiers` (a name per process id:
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
        rows.append(_row(load, rate, runs))
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


def conclude(report: dict[str, Any], ratios: Sequence[str], out: Path | None) -> None:
    """Prints the table and whether every one of `ratios` is within TOLERANCE at every load;
    writes the report with that verdict to `out` when given."""
    print(format_rows(report["rows"]))
    within = all(abs(row[key] - 1.0) <= TOLERANCE for row in report["rows"] for key in ratios)
    print(f"{', '.join(ratios)} within {TOLERANCE:.0%} at every load: {'yes' if within else 'no'}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**report, "within_tolerance": within}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
