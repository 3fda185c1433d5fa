"""CPU per row of the worker's own bundle path, timed in one process without gRPC.

`python -m bench.worker_feed` feeds the GPU-speed stand-in's worker bundles over an
InferStream and reads its CPU per row, grpc's and the stream's framing included; its spread
from one run to the next (10-30% on this machine) hides a change of a few percent. This
times the Python a bundle passes through in the worker, as the worker runs it: the stand-in
(minilm's tokenizer, checks and buckets, batches timed by the H100 curve, asleep) behind a
running batching driver, `BundleRunner.infer` called by `--callers` concurrent callers, each
sending bundles of `--rows` one-text slices of 16 token ids (bench.worker_feed's bundle),
parsed from its bytes and answered to bytes as the stream would. The figure is the process's
CPU per row (the stand-in's batches sleep, without the GIL: they cost nothing), per round,
with the median and the least of the rounds: the least is the one fewest other processes
disturbed, and the figure to set beside another commit's in the same hour.

    python -m bench.worker_path [--rows 16] [--callers 16] [--bundles 1000] [--rounds 7]

`--admission` times admission alone, the driver's loop not started: passes of `--rows`
one-row slices (16 token ids, times left spread over 10 s) through `admit_slices` into a lane
already holding `--queued` rows, each pass's slices withdrawn after it, us a slice of
admission (the withdrawal not counted). A queue past half its size (the stand-in's holds
2,048) takes the row-by-row path, where `slice_admission.CoveredRows` cannot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from bench.fabric.stack import write_minilm_repository
from bench.fabric.stand_in import STAND_IN_CURVE
from bench.worker_feed import bundle_bytes
from services.common import event_loop
from services.common.model_repository import load_repository
from services.gpu_worker.backends import LoadOptions, load_backend
from services.gpu_worker.backends.base import Backend
from services.gpu_worker.batching.driver import BatchingDriver, DriverConfig
from services.gpu_worker.batching.slice_admission import SliceAsk
from services.gpu_worker.bundle_rows import bundle_rows
from services.gpu_worker.bundles import BundleRunner
from services.gpu_worker.metrics import WorkerMetrics
from services.pb.inference.v1 import worker_pb2 as pb

#: Each bundle's time left (seconds): the stand-in answers in milliseconds.
TIME_LEFT_S = 10.0


async def _bundles(
    runner: BundleRunner, backend: Backend, body: bytes, bundles: int, callers: int
) -> int:
    """Sends `bundles` (split over `callers`); returns how many slices were not OK (a figure
    with many is not the served path's: refusals cost less)."""
    failed = 0

    async def caller(count: int) -> None:
        nonlocal failed
        for _ in range(count):
            request = pb.InferRequest.FromString(body)
            try:
                response = await runner.infer(backend, request, TIME_LEFT_S, None)
            except Exception:  # refused whole (bundle_door): a queue too long for the SLO
                failed += len(request.slices)
                continue
            failed += sum(1 for status in response.slices if status.code)
            response.SerializeToString()

    await asyncio.gather(*(caller(bundles // callers) for _ in range(callers)))
    return failed


@contextlib.contextmanager
def stand_in_driver() -> Iterator[tuple[Backend, BatchingDriver, WorkerMetrics]]:
    """The GPU-speed stand-in's backend behind a warmed-up batching driver (not started)."""
    with tempfile.TemporaryDirectory(prefix="worker-path-") as state:
        write_minilm_repository(Path(state))
        (version,) = load_repository(Path(state))
        options = LoadOptions(stand_in_curve=STAND_IN_CURVE)
        backend = load_backend(version, torch.device("cpu"), options)
        metrics = WorkerMetrics(CollectorRegistry())
        driver = BatchingDriver([backend], DriverConfig(), metrics)
        driver.warm_up()
        yield backend, driver, metrics


async def measure(
    rows: int, callers: int, bundles: int, rounds: int, profile: bool
) -> dict[str, Any]:
    with stand_in_driver() as (backend, driver, metrics):
        driver.start()
        runner = BundleRunner(driver, metrics)
        body = bundle_bytes(backend.fingerprint, rows, seed=0)
        try:
            # Warm: the first batches teach the latency model; caches fill.
            failed = await _bundles(runner, backend, body, min(bundles, 20 * callers), callers)
            if profile:
                profiler = cProfile.Profile()
                profiler.enable()
                failed += await _bundles(runner, backend, body, bundles, callers)
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            us_per_row = []
            sent = bundles // callers * callers * rows
            for _ in range(rounds):
                started = time.process_time()
                failed += await _bundles(runner, backend, body, bundles, callers)
                us_per_row.append(1e6 * (time.process_time() - started) / sent)
        finally:
            await driver.drain()
    return {
        "rows_per_bundle": rows,
        "callers": callers,
        "slices_failed": failed,
        "us_per_row": [round(us, 1) for us in us_per_row],
        "median_us_per_row": round(statistics.median(us_per_row), 1),
        "least_us_per_row": round(min(us_per_row), 1),
    }


async def measure_admission(rows: int, queued: int, rounds: int) -> dict[str, Any]:
    with stand_in_driver() as (backend, driver, _):
        request = pb.InferRequest.FromString(bundle_bytes(backend.fingerprint, rows, seed=0))
        prepared = bundle_rows(request, rows).prepare(backend) or []
        held = [SliceAsk([prepared[i % rows]], 600.0, "held") for i in range(queued)]
        driver.admit_slices(backend, held)  # stays queued: nothing is dispatched
        us_per_slice = []
        for _ in range(rounds):
            spent_s = 0.0
            for _ in range(2_000):
                asks = [SliceAsk([row], 10.0 - 1e-3 * i, "bench") for i, row in enumerate(prepared)]
                started = time.process_time()
                admitted = driver.admit_slices(backend, asks)
                spent_s += time.process_time() - started
                for admission in admitted:
                    if isinstance(admission, Exception):
                        raise admission
                    driver.withdraw(admission)
            us_per_slice.append(1e6 * spent_s / (2_000 * rows))
    return {
        "rows_per_pass": rows,
        "queued": queued,
        "us_per_slice": [round(us, 2) for us in us_per_slice],
        "median_us_per_slice": round(statistics.median(us_per_slice), 2),
        "least_us_per_slice": round(min(us_per_slice), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="one-text slices a bundle")
    parser.add_argument("--callers", type=int, default=16, help="bundles in flight")
    parser.add_argument("--bundles", type=int, default=1_000, help="bundles a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top 30 first")
    parser.add_argument("--admission", action="store_true", help="time admission alone")
    parser.add_argument("--queued", type=int, default=8, help="rows held queued (--admission)")
    args = parser.parse_args()
    if not 1 <= args.callers <= args.bundles:
        parser.error("--callers must be at least 1 and at most --bundles")
    if args.rows < 1 or args.rounds < 1:
        parser.error("--rows and --rounds must be at least 1")
    if args.admission:
        run = measure_admission(args.rows, args.queued, args.rounds)
    else:
        run = measure(args.rows, args.callers, args.bundles, args.rounds, args.profile)
    result = event_loop.run(run, "uvloop")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
