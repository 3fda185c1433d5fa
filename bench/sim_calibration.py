"""The simulator validation's calibration (bench/sim_validation.py, whose doc says what it
measures and why): the in-stack latency curve and its noise, the hops between the client and
the worker, and the CPU the other tiers spend per request, measured through a running stack
at low load; and the figures of a run's worker metrics the validation sets beside the
simulator's."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.fabric.loadgen import Outcome
from bench.fabric.observe import Observer, Samples, cpu_delta, delta, scrape, total
from bench.fabric.stack import BenchStack
from services.common import metric_names as names
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.sim.curve import LatencyCurve

MODEL = "minilm"
#: Token counts of the two request kinds (special tokens included) and their shares.
SHORT_TOKENS, LONG_TOKENS = 12, 100
LENGTH_MIX = ((SHORT_TOKENS, 0.85), (LONG_TOKENS, 0.15))
LENGTHS = (SHORT_TOKENS, LONG_TOKENS)
#: Batch sizes the curve is measured at; the simulator's latency model interpolates between.
CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: The length buckets of the minilm repository the stack serves.
BUCKETS = (16, 32, 64, 128, 256)
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


def bucket_of(num_tokens: int, buckets: Sequence[int]) -> int:
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
            bucket = bucket_of(num_tokens, BUCKETS)
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
    bucket = bucket_of(num_tokens, BUCKETS)
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
        bucket = bucket_of(tokens, BUCKETS)
        largest = max(size for b, size in seconds if b == bucket)
        per_row += share * seconds[(bucket, largest)] / largest
    return 1.0 / per_row
