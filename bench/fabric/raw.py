"""The raw in-process model, with no stack running: the physical limit `bench.fabric` measures
the fabric against, at every batch size and on a workload's own texts."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any

from bench.fabric.measure import (
    OUTSIDE_RETRY_SHARE,
    OUTSIDE_WARN_SHARE,
    Progress,
    Settings,
    outside_share,
    wait_quiet,
)
from bench.fabric.observe import Observer, cpu_delta


async def measure_raw(
    repository: Path, model: str, num_tokens: int, settings: Settings, log: Progress
) -> dict[str, Any]:
    """bench.raw_model's `measure` at every power-of-two batch size up to the model's limit
    (and the limit itself), in this process, with no stack running: the physical limit. A
    point that other processes disturbed is measured again, like an open-loop rate."""
    import torch

    from bench.raw_model import measure
    from services.common.model_repository import load_repository
    from services.gpu_worker.backends import load_backend
    from services.gpu_worker.backends.base import select_device

    version = next(v for v in load_repository(repository) if v.config.name == model)
    limit = version.config.max_batch_size
    if version.config.max_batch_tokens:
        limit = min(limit, version.config.max_batch_tokens // num_tokens)
    sizes = sorted({*(1 << i for i in range(limit.bit_length())), limit})
    backend = await asyncio.to_thread(load_backend, version, select_device())
    points = []
    observer = Observer({})
    for size in sizes:
        for attempt in range(settings.contention_retries + 1):
            before = observer.snapshot()
            rate = await asyncio.to_thread(measure, backend, num_tokens, size, settings.raw_seconds)
            after = observer.snapshot()
            outside = round(outside_share(before, after), 3)
            # CPU per sequence, to set beside the worker's CPU per row under load: the gap is
            # what serving costs on top of the model (threads spinning included).
            cpu_ms = 1000 * cpu_delta(before, after)["bench"] / (rate * (after.at_s - before.at_s))
            note = (
                f" (others used {outside:.0%} of the CPU)" if outside > OUTSIDE_WARN_SHARE else ""
            )
            log(f"[raw] batch {size:>3}: {rate:7.1f} sequences/s{note}")
            if outside <= OUTSIDE_RETRY_SHARE or attempt == settings.contention_retries:
                break
            await wait_quiet(log, settings.wait_quiet_s)
        points.append(
            {
                "batch_size": size,
                "sequences_per_s": rate,
                "cpu_ms_per_sequence": round(cpu_ms, 3),
                "outside_cpu_share": outside,
            }
        )
    device = str(backend.device)
    del backend
    gc.collect()  # the stacks measured next should not share memory bandwidth with a spare copy
    best = max(points, key=lambda p: p["sequences_per_s"])
    return {
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "num_tokens": num_tokens,
        "max_batch_size": limit,
        "points": points,
        "best": best,
    }


def _run_in_buckets(backend, rows, batch_size: int) -> float:
    """Seconds to run `rows` once, each bucket in batches of up to `batch_size` (rows of one
    bucket in their arrival order): what a batcher that never waits could do with them."""
    by_bucket: dict[int, list[Any]] = {}
    for row in rows:
        by_bucket.setdefault(row.bucket, []).append(row)
    started = time.perf_counter()
    for bucket_rows in by_bucket.values():
        for i in range(0, len(bucket_rows), batch_size):
            backend.run(bucket_rows[i : i + batch_size])
    return time.perf_counter() - started


async def measure_raw_texts(
    repository: Path, model: str, texts: list[str], settings: Settings, log: Progress
) -> dict[str, Any]:
    """The raw model on a workload's own texts (the mixed-length one): the texts tokenized by
    the worker's own code, grouped by length bucket, run in batches of each power-of-two size
    up to the model's limit, in this process with no stack running. Sequences/s per batch size
    and the best: the physical limit for that workload."""
    from services.common.model_repository import load_repository
    from services.gpu_worker.backends import load_backend
    from services.gpu_worker.backends.base import select_device

    version = next(v for v in load_repository(repository) if v.config.name == model)
    backend = await asyncio.to_thread(load_backend, version, select_device())
    rows = backend.prepare_many(texts)
    limit = version.config.max_batch_size
    sizes = sorted({*(1 << i for i in range(limit.bit_length())), limit})
    points = []
    for size in sizes:
        await asyncio.to_thread(_run_in_buckets, backend, rows, size)  # warm the shapes
        seconds = 0.0
        passes = 0
        while seconds < settings.raw_seconds or passes == 0:
            seconds += await asyncio.to_thread(_run_in_buckets, backend, rows, size)
            passes += 1
        rate = passes * len(rows) / seconds
        log(f"[raw mixed] batch {size:>3}: {rate:7.1f} sequences/s")
        points.append({"batch_size": size, "sequences_per_s": rate})
    buckets: dict[int, int] = {}
    for row in rows:
        buckets[row.bucket] = buckets.get(row.bucket, 0) + 1
    del backend
    gc.collect()
    return {
        "texts": len(texts),
        "rows_per_bucket": dict(sorted(buckets.items())),
        "points": points,
        "best": max(points, key=lambda p: p["sequences_per_s"]),
    }
