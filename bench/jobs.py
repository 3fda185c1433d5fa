"""Durable batch job throughput against online goodput of the same model, in one run.

    python -m bench.jobs [--items 100000] [--online-s 10] [--output bench/results/jobs.json]

One local stack (redis with AOF, router, one minilm worker, gateway, one job runner):
1. online goodput: closed-loop single-text Predict calls (interactive) for `--online-s`;
2. a job of `--items` short texts submitted at once; its throughput is items over the time
   from its first item starting to its last finishing (submission excluded, reported apart).
3. online p99 at half that goodput (open loop, Poisson) in `--online-s` windows alternating
   alone and beside a saturating job (one per window, cancelled after it), three of each,
   pooled per side: batch items must not cost online traffic its latency (issue 13: p99
   within 10%).
The ratio job / online is issue 13's goal (>= 0.9). Prints two lines; writes JSON.

    python -m bench.jobs --beside-overload 1.5 [--online-s 10] [--items 1000]

measures instead, after the closed-loop goodput, a job of `--items` short texts beside online
calls offered open loop at that multiple of it for six `--online-s` windows (past capacity,
the worker is never idle for a backfill): the job's items done and failed, and the online
calls OK and within the SLO per second. Before `batch` rows came due (close_rule.
due_limit_s), such a job did not progress: its calls timed out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.fabric.loadgen import Outcome, arrival_schedule, run_open_loop
from bench.fabric.measure import closed_loop
from bench.fabric.stack import REPO_ROOT, start_stack
from bench.fabric.sweep import percentile
from bench.fabric.targets import predict_sender
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import jobs_pb2 as jobs
from services.pb.inference.v1 import jobs_pb2_grpc as jobs_grpc

ONLINE_CONCURRENCY = 32
#: Online windows alone, and as many beside a job, alternating.
BESIDE_PAIRS = 3
#: A 100,000-item job is about 4 MB: above the gateway's 4 MiB default message cap.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024


def short_texts(count: int) -> list[str]:
    return [f"short text number {i} about topic {i % 97}" for i in range(count)]


async def run_job(address: str, texts: list[str]) -> dict[str, Any]:
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = jobs_grpc.JobServiceStub(channel)
        items = [api.PredictInput(text=t) for t in texts]
        started = time.time()
        job_id = (await stub.SubmitJob(jobs.SubmitJobRequest(model_name="minilm", items=items),
                                       timeout=300.0)).job_id  # fmt: skip
        submit_s = time.time() - started
        while True:
            job = await stub.GetJob(jobs.GetJobRequest(job_id=job_id), timeout=30.0)
            if _finished(job):
                break
            await asyncio.sleep(0.5)
        finished = time.time()
        run_s = finished - (job.started_unix_s or started)
        return {
            "items": len(texts),
            "submit_s": round(submit_s, 2),
            "run_s": round(run_s, 2),
            "items_per_s": round(len(texts) / run_s, 1),
            "num_ok": job.num_ok,
            "num_failed": job.num_failed,
            "state": jobs.JobState.Name(job.state),
        }


@dataclass(frozen=True)
class BesideJob:
    """Online traffic at a fixed rate in windows alternating alone and beside a job that keeps
    the worker saturated; each side pooled over its windows (one short window's p99 is a
    handful of samples and drifts with the machine)."""

    rate_per_s: float
    alone: list[Outcome]
    beside: list[Outcome]
    #: Job items finished per second during the beside windows.
    job_items_per_s: float

    @staticmethod
    def p_s(outcomes: list[Outcome], q: float) -> float:
        return percentile([o.latency_s for o in outcomes if o.ok], q) or 0.0

    @property
    def p99_ratio(self) -> float:
        return self.p_s(self.beside, 99) / max(self.p_s(self.alone, 99), 1e-9)

    def summary(self) -> dict[str, Any]:
        def side(outcomes: list[Outcome]) -> dict[str, Any]:
            return {"sent": len(outcomes), "ok": sum(o.ok for o in outcomes),
                    "p50_s": self.p_s(outcomes, 50), "p99_s": self.p_s(outcomes, 99)}  # fmt: skip

        return {"rate_per_s": round(self.rate_per_s, 1), "alone": side(self.alone),
                "beside_job": side(self.beside), "job_items_per_s": round(self.job_items_per_s, 1),
                "p99_ratio": round(self.p99_ratio, 3)}  # fmt: skip


#: The fewest items a job beside a window gets. Its size follows the online rate, which is
#: half the closed-loop throughput measured first; a machine busy with other work while that
#: was measured (the parallel test suite: 15/s measured, a job of 1,153 items) left a job the
#: worker drained within the window, however fast it really was.
MIN_JOB_ITEMS = 4000


async def online_beside_job(
    channel: grpc.aio.Channel, rate_per_s: float, *, window_s: float, pairs: int
) -> BesideJob:
    """`pairs` windows of online Predict calls (one text each, open loop, Poisson at
    `rate_per_s`) alone, each followed by the same schedule beside a job submitted for it
    (started before the window, cancelled after it; larger than the window can drain)."""
    send = predict_sender(channel, "minilm", short_texts(1000), timeout_s=30.0)
    stub = jobs_grpc.JobServiceStub(channel)
    alone: list[Outcome] = []
    beside: list[Outcome] = []
    job_items = 0
    for pair in range(pairs):
        schedule = arrival_schedule(rate_per_s, window_s, seed=pair)
        alone += await run_open_loop(send, schedule)
        texts = short_texts(max(int(rate_per_s * window_s * 4) + 1000, MIN_JOB_ITEMS))
        request = jobs.SubmitJobRequest(
            model_name="minilm", items=[api.PredictInput(text=t) for t in texts]
        )
        job_id = (await stub.SubmitJob(request, timeout=300.0)).job_id
        while (await stub.GetJob(jobs.GetJobRequest(job_id=job_id))).num_ok < 256:
            await asyncio.sleep(0.1)
        before = (await stub.GetJob(jobs.GetJobRequest(job_id=job_id))).num_ok
        beside += await run_open_loop(send, schedule)
        job = await stub.CancelJob(jobs.CancelJobRequest(job_id=job_id))
        if job.num_ok >= len(texts):
            raise RuntimeError("the job ran dry during the window: it did not saturate")
        job_items += job.num_ok - before
        while not _finished(await stub.GetJob(jobs.GetJobRequest(job_id=job_id))):
            await asyncio.sleep(0.2)
    return BesideJob(rate_per_s, alone, beside, job_items / (pairs * window_s))


#: Windows of online overload a job runs beside (`--beside-overload`): a job's call allows
#: 20 s, so its rows come due about then.
OVERLOAD_WINDOWS = 6
#: minilm's SLO (models/minilm), what an online call within it counts as good.
ONLINE_SLO_S = 0.25


async def job_beside_overload(
    channel: grpc.aio.Channel, rate_per_s: float, *, window_s: float, items: int
) -> dict[str, Any]:
    """Online calls open loop at `rate_per_s` (Poisson, each allowing 1 s) for
    OVERLOAD_WINDOWS windows of `window_s`, and a job of `items` texts submitted a second
    into them (the worker already past capacity, no idle time to start it as a backfill):
    the job's progress by the end (then cancelled) and the online calls' outcomes, per second
    of the whole run (calls end up to 1 s after the last is sent). A job's runner has 4 calls
    of 64 items in flight, each allowing 20 s: past capacity, at most 768 items a minute."""
    send = predict_sender(channel, "minilm", short_texts(1000), timeout_s=1.0)
    stub = jobs_grpc.JobServiceStub(channel)
    request = jobs.SubmitJobRequest(
        model_name="minilm", items=[api.PredictInput(text=t) for t in short_texts(items)]
    )
    started_s = time.monotonic()
    schedule = arrival_schedule(rate_per_s, OVERLOAD_WINDOWS * window_s, seed=7)
    load = asyncio.ensure_future(run_open_loop(send, schedule))
    await asyncio.sleep(1.0)
    job_id = (await stub.SubmitJob(request, timeout=300.0)).job_id
    online = await load
    duration_s = time.monotonic() - started_s
    job = await stub.GetJob(jobs.GetJobRequest(job_id=job_id))
    await stub.CancelJob(jobs.CancelJobRequest(job_id=job_id))
    good = [o for o in online if o.ok and o.latency_s <= ONLINE_SLO_S]
    return {
        "rate_per_s": round(rate_per_s, 1),
        "seconds": round(duration_s, 1),
        "job": {"items": items, "num_ok": job.num_ok, "num_failed": job.num_failed},
        "online": {
            "sent": len(online),
            "ok_per_s": round(sum(o.ok for o in online) / duration_s, 1),
            "good_per_s": round(len(good) / duration_s, 1),
        },
    }


def _finished(job: jobs.Job) -> bool:
    return job.num_ok + job.num_failed + job.num_cancelled == job.num_items


async def measure(
    address: str, items: int, online_s: float, beside_overload: float | None = None
) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        send = predict_sender(channel, "minilm", short_texts(1000), timeout_s=30.0)
        online = await closed_loop(send, ONLINE_CONCURRENCY, online_s)
        if beside_overload is not None:
            rate_per_s = online["ok_per_s"] * beside_overload
            beside = await job_beside_overload(channel, rate_per_s, window_s=online_s, items=items)
            return {"online": online, "job_beside_overload": beside}
    job = await run_job(address, short_texts(items))
    async with grpc.aio.insecure_channel(address) as channel:
        rate_per_s = online["ok_per_s"] / 2
        beside = await online_beside_job(channel, rate_per_s, window_s=online_s, pairs=BESIDE_PAIRS)
    return {
        "online": online,
        "job": job,
        "ratio": round(job["items_per_s"] / max(online["ok_per_s"], 1e-9), 3),
        "online_half_capacity": beside.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.jobs", description=__doc__)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--online-s", type=float, default=10.0)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/jobs.json")
    parser.add_argument(
        "--beside-overload",
        type=float,
        help="only a job beside online calls at this multiple of the online goodput",
    )
    args = parser.parse_args()
    state_dir = Path(tempfile.mkdtemp(prefix="bench-jobs-"))
    stack = start_stack(
        REPO_ROOT / "models", state_dir,
        extra_gateway_args=(f"--max-message-bytes={MAX_MESSAGE_BYTES}",),
    )  # fmt: skip
    try:
        figures = asyncio.run(
            measure(stack.gateway_address, args.items, args.online_s, args.beside_overload)
        )
    finally:
        stack.stop()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=2))
    if args.beside_overload is not None:
        beside = figures["job_beside_overload"]
        print(f"online closed loop {figures['online']['ok_per_s']:.0f}/s; beside online at "
              f"{beside['rate_per_s']:.0f}/s for {beside['seconds']:.0f} s: {beside}")  # fmt: skip
        return
    online, job = figures["online"]["ok_per_s"], figures["job"]["items_per_s"]
    print(
        f"online {online:.0f} items/s, job {job:.0f} items/s over {args.items} items, ratio"
        f" {figures['ratio']:.2f} -> {args.output}"
    )
    half = figures["online_half_capacity"]
    print(f"online p99 at half capacity: alone {half['alone']['p99_s']:.3f} s, beside a job "
          f"{half['beside_job']['p99_s']:.3f} s (ratio {half['p99_ratio']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
