"""Warming a lane up before it serves: every shape it may form is run, on the executor thread
that will run its batches, and the fastest run of each seeds its latency model."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from services.gpu_worker.backends.base import Backend
from services.gpu_worker.batching.lane import Lane
from services.gpu_worker.batching.slice_admission import lane_key
from services.gpu_worker.batching.watchdog import CallProgress
from services.gpu_worker.metrics import WorkerMetrics

#: Warm-up runs of each (bucket, batch size); the fastest seeds the latency model.
WARMUP_RUNS_PER_SHAPE = 2


def warm_up_each(
    lanes: Sequence[Lane], warm_up: Callable[[Lane], None], forget: Callable[[Lane], None]
) -> list[tuple[Backend, Exception]]:
    """Warms each lane up (`warm_up`), leaving out (`forget`) one whose warm-up fails, as a
    version that failed to load is: its backend is returned with the error."""
    failed: list[tuple[Backend, Exception]] = []
    for lane in lanes:
        try:
            warm_up(lane)
        except Exception as error:
            forget(lane)
            failed.append((lane.backend, error))
    return failed


def warm_up_lane(lane: Lane, metrics: WorkerMetrics, progress: CallProgress | None = None) -> None:
    """Runs every (bucket, power-of-two batch size) the lane may form, seeding its latency model
    with the faster of `WARMUP_RUNS_PER_SHAPE` runs per shape, then exports its gauges. Stops a
    bucket at the first size past the batch compute budget: bigger batches of it are never
    formed. Blocking; each model call ends `progress` (the watchdog's measure of it)."""
    backend = lane.backend
    progress = progress or CallProgress()
    backend.warm_up()
    progress.ended()
    for bucket in backend.buckets:
        key = lane_key(lane, bucket)
        limit = lane.batcher.shape_limit(key)
        for size in sorted({*(1 << i for i in range(limit.bit_length())), limit}):
            rows = backend.warmup_rows(bucket, size)
            runs_s = []
            for _ in range(WARMUP_RUNS_PER_SHAPE):
                start = time.perf_counter()
                backend.run(rows)
                progress.ended()
                runs_s.append(time.perf_counter() - start)
            lane.latency.observe(key, size, min(runs_s))
            lane.slowest_warmup_s = max(lane.slowest_warmup_s, min(runs_s))
            if min(runs_s) > lane.batcher.batch_compute_budget_s:
                break
    for bucket in backend.buckets:
        lane.export_gauges(metrics, lane_key(lane, bucket))
