"""Durable batch jobs through the whole local stack (redis with AOF, router, a minilm worker,
gateway, job runner) as separate processes: results in input order equal to Predict's, poison
items dead-lettered, idempotent resubmission, a job that survives SIGKILL of its runner and of
Redis (restarted from its AOF), and cancel mid-job.

The ordered-results job has JOBS_E2E_ITEMS items (default 4,000: hundreds of claims and batches,
so order and dead-lettering are checked across many of each, in about 15 s at the ~300 items/s
one minilm worker runs on two quiet cores; 20,000 took 70 s alone and 240 s beside the rest of
the suite); the fault and cancel tests use 2,000, enough to act on a job mid-way. The
100,000-item run is `make bench-jobs` (bench/jobs.py), which also reports the figure beside
online traffic (online p99 beside a saturating job against alone); here, online traffic beside
a job is asserted on statuses and counts.

One stack serves the module; the test that SIGKILLs the job runner and Redis has its own.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.fabric.loadgen import run_closed_loop
from bench.fabric.targets import predict_sender
from bench.jobs import BesideJob, online_beside_job
from services.common.metric_names import WORKER_ROWS_TOTAL
from services.common.processes import ChildProcess, launch, start_and_wait, wait_ready
from services.common.redis_acl import JOBS, password_file_name
from services.common.redis_server import ping, redis_command
from services.common.tensors import tensor_from_pb, tensor_to_pb
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import jobs_pb2 as jobs
from services.pb.inference.v1 import jobs_pb2_grpc as jobs_grpc
from tests.support.metrics import scrape, total
from tests.support.models import write_minilm_repository
from tests.support.processes import REPO_ROOT
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually, eventually_sync

pytestmark = pytest.mark.e2e

NUM_ITEMS = int(os.environ.get("JOBS_E2E_ITEMS", "4000"))
#: Items of the jobs that are killed under, or cancelled, mid-way.
FAULT_ITEMS = 2000
#: Distinct texts of the big job (item i is text i % DISTINCT_TEXTS): each is also sent through
#: Predict once, and every item's output is compared with its text's.
DISTINCT_TEXTS = 2000
#: A tensor row sent to a text model: INVALID_ARGUMENT at the gateway, whatever the batch.
POISON = api.PredictInput(tensor=tensor_to_pb(np.zeros(4, dtype="<f4")))


def start_jobs_stack(tmp_path: Path) -> Stack:
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=30_000)
    return start_stack(tmp_path, model_repository=repository, tolerate_exits=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The module's stack. Each test waits for its jobs to finish, so the next one starts on
    an idle worker."""
    stack = start_jobs_stack(tmp_path_factory.mktemp("jobs"))
    yield stack
    assert stack.stop() == 0, stack.stop_report()


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack for one test alone (one that kills its tiers)."""
    stack = start_jobs_stack(tmp_path)
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def texts_of(n: int) -> list[str]:
    return [f"short text number {i} about topic {i % 97}" for i in range(n)]


async def wait_finished(
    stub: jobs_grpc.JobServiceStub, job_id: str, num_items: int = FAULT_ITEMS
) -> jobs.Job:
    async def finished() -> jobs.Job | None:
        try:
            job = await stub.GetJob(jobs.GetJobRequest(job_id=job_id))
        except grpc.aio.AioRpcError as error:
            # UNAVAILABLE (the job store reconnecting after a Redis restart) is safe to retry.
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return None
        done = job.num_ok + job.num_failed + job.num_cancelled
        return job if done == job.num_items else None

    return await eventually(finished, timeout_s=max(120.0, num_items / 50), interval_s=0.5)


async def read_results(stub: jobs_grpc.JobServiceStub, job_id: str) -> list[jobs.JobItemResult]:
    request = jobs.GetJobResultsRequest(job_id=job_id)
    return [r async for r in stub.GetJobResults(request, timeout=120.0)]


async def listed_job_ids(stub: jobs_grpc.JobServiceStub) -> list[str]:
    """The tenant's jobs, newest first (one page: this module submits far fewer)."""
    listed = await stub.ListJobs(jobs.ListJobsRequest(page_size=500))
    assert not listed.next_page_token
    return [j.job_id for j in listed.jobs]


def worker_rows(stack: Stack) -> float:
    """Rows the stack's worker has executed."""
    return total(scrape(stack.workers[0].metrics_port), WORKER_ROWS_TOTAL)


async def predict_all(channel: grpc.aio.Channel, texts: list[str]) -> list[api.Tensor]:
    """Each text's output through InferenceService.Predict, 64 texts a call, all sent at once.
    Each call allows 180 s: with four test workers and busy loops on two cores, the router
    predicted the last of the test's 32 calls (2,000 texts) done 61 s out, past its 60 s
    deadline, and refused it at once (RESOURCE_EXHAUSTED, as it should). What the test
    compares is the outputs, not the speed."""
    stub = api_grpc.InferenceServiceStub(channel)
    calls = [
        stub.Predict(
            api.PredictRequest(
                model_name="minilm", inputs=[api.PredictInput(text=t) for t in texts[i : i + 64]]
            ),
            timeout=180.0,
        )
        for i in range(0, len(texts), 64)
    ]
    return [output for response in await asyncio.gather(*calls) for output in response.outputs]


@pytest.mark.timeout(900)
async def test_job_results_in_order_equal_predict_poison_dead_lettered(stack: Stack) -> None:
    distinct = texts_of(DISTINCT_TEXTS)
    items = [api.PredictInput(text=distinct[i % DISTINCT_TEXTS]) for i in range(NUM_ITEMS)]
    poison = set(random.Random(7).sample(range(NUM_ITEMS), 5))
    for i in poison:
        items[i] = POISON
    rows_before = worker_rows(stack)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = jobs_grpc.JobServiceStub(channel)
        jobs_before = await listed_job_ids(stub)
        submit = jobs.SubmitJobRequest(model_name="minilm", items=items, idempotency_key="e2e")
        job_id = (await stub.SubmitJob(submit, timeout=60.0)).job_id
        again = await stub.SubmitJob(submit, timeout=60.0)
        assert (again.job_id, again.is_existing) == (job_id, True)
        job = await wait_finished(stub, job_id, NUM_ITEMS)
        assert job.state == jobs.JOB_STATE_PARTIALLY_FAILED
        assert (job.num_ok, job.num_failed) == (NUM_ITEMS - 5, 5)
        # No extra work: the worker ran each good item once (poison ones fail at the gateway),
        # so the resubmission ran nothing, and the tenant has one job more.
        assert worker_rows(stack) - rows_before == NUM_ITEMS - 5
        assert await listed_job_ids(stub) == [job_id, *jobs_before]
        results = await read_results(stub, job_id)
        assert [r.index for r in results] == list(range(NUM_ITEMS))
        failed = {r.index for r in results if r.status == jobs.ITEM_STATUS_FAILED}
        assert failed == poison
        assert all(results[i].code == "INVALID_ARGUMENT" for i in poison)
        online = await predict_all(channel, distinct)
    for result in results:
        if result.index not in poison:
            expected = tensor_from_pb(online[result.index % DISTINCT_TEXTS])
            np.testing.assert_allclose(tensor_from_pb(result.output), expected, atol=1e-5)


def kill_and_wait(pid: int) -> None:
    """SIGKILL a tier and wait until the launcher has reaped it (its port is free then, and the
    launcher has seen this exit on its own, not coalesced with the next one)."""
    os.kill(pid, signal.SIGKILL)
    eventually_sync(lambda: not Path(f"/proc/{pid}").exists(), timeout_s=30.0)


def restart_redis(stack: Stack) -> ChildProcess:
    """SIGKILL the stack's Redis and start it again from its AOF, as the launcher did."""
    kill_and_wait(stack.redis_pid)
    argv = redis_command(
        stack.redis_port,
        appendonly=True,
        dir=stack.state_dir / "redis",
        acl_file=stack.state_dir / "redis-acl" / "users.acl",
    )
    child = launch("redis-again", argv, log_path=stack.state_dir / "redis-again.log")
    admin = ("admin", stack.redis_admin_password)
    wait_ready([child], timeout_s=30.0, is_ready=lambda _: ping(stack.redis_port, auth=admin))
    return child


async def test_job_survives_sigkill_of_runner_and_redis(own_stack: Stack, tmp_path: Path) -> None:
    """A job finishes whole after SIGKILL of its runner and of Redis (restarted from its AOF).
    Its own stack: the stack's Redis and job runner are replaced by processes this test starts
    and stops, so no other test could use the stack after it."""
    stack = own_stack
    assert stack.jobs is not None
    texts = texts_of(FAULT_ITEMS)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = jobs_grpc.JobServiceStub(channel)
        submit = jobs.SubmitJobRequest(
            model_name="minilm", items=[api.PredictInput(text=t) for t in texts]
        )
        job_id = (await stub.SubmitJob(submit, timeout=60.0)).job_id

        async def under_way() -> bool:
            job = await stub.GetJob(jobs.GetJobRequest(job_id=job_id))
            return FAULT_ITEMS // 10 <= job.num_ok < FAULT_ITEMS // 2

        await eventually(under_way, timeout_s=120.0, interval_s=0.1)
        kill_and_wait(stack.jobs.pid)
        # Killed mid-way, as the test means: the recovery below has a job to finish.
        killed = await stub.GetJob(jobs.GetJobRequest(job_id=job_id))
        assert killed.num_ok < FAULT_ITEMS, killed
        redis = restart_redis(stack)
        try:
            password_file = stack.state_dir / "redis-acl" / password_file_name(JOBS)
            argv = [sys.executable, "-m", "services.jobs", "--metrics-port", "0",
                    "--redis-url", f"redis://127.0.0.1:{stack.redis_port}/0",
                    "--redis-password-file", str(password_file),
                    "--gateway-address", stack.gateway.address,
                    "--claim-timeout-s", "10", "--call-timeout-s", "8"]  # fmt: skip
            runner, _ = start_and_wait("jobs-again", argv, log_path=tmp_path / "jobs-again.log",
                                       ready_file=tmp_path / "jobs-again.json", timeout_s=60.0,
                                       cwd=REPO_ROOT)  # fmt: skip
            try:
                job = await wait_finished(stub, job_id)
                assert job.state == jobs.JOB_STATE_SUCCEEDED and job.num_ok == FAULT_ITEMS
                results = await read_results(stub, job_id)
                assert [r.index for r in results] == list(range(FAULT_ITEMS))
            finally:
                runner.terminate(30.0)
        finally:
            redis.process.kill()
            redis.process.wait()


async def test_cancel_mid_job_starts_no_new_item_and_keeps_results(stack: Stack) -> None:
    texts = texts_of(FAULT_ITEMS)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = jobs_grpc.JobServiceStub(channel)
        submit = jobs.SubmitJobRequest(
            model_name="minilm", items=[api.PredictInput(text=t) for t in texts]
        )
        job_id = (await stub.SubmitJob(submit, timeout=60.0)).job_id

        async def under_way() -> bool:
            job = await stub.GetJob(jobs.GetJobRequest(job_id=job_id))
            return 0 < job.num_ok < FAULT_ITEMS // 2

        await eventually(under_way, timeout_s=120.0, interval_s=0.05)
        cancelled = await stub.CancelJob(jobs.CancelJobRequest(job_id=job_id))
        assert cancelled.state == jobs.JOB_STATE_CANCELLED
        job = await wait_finished(stub, job_id)
        assert job.state == jobs.JOB_STATE_CANCELLED
        # Only chunks already running at the cancel finish (4 in flight, 64 items each).
        assert cancelled.num_ok <= job.num_ok <= cancelled.num_ok + 4 * 64
        assert job.num_ok + job.num_cancelled == FAULT_ITEMS
        results = await read_results(stub, job_id)
        assert [r.index for r in results] == list(range(FAULT_ITEMS))
        ok = [r for r in results if r.status == jobs.ITEM_STATUS_OK]
        assert len(ok) == job.num_ok and all(len(r.output.raw_data) == 384 * 4 for r in ok)


#: Seconds of each online window; windows alternate, alone and beside a job, NUM_PAIRS each.
ONLINE_WINDOW_S = 5.0
NUM_PAIRS = 2


@pytest.fixture(scope="module")
def beside_job(stack: Stack) -> BesideJob:
    """Online traffic at half the stack's closed-loop throughput, alone and beside a job that
    saturates the worker, as `make bench-jobs` sends it (its figures are the benchmark's)."""
    run = asyncio.run(_measure_beside_job(stack))
    print(f"online beside a job: {run.summary()}")
    return run


async def _measure_beside_job(stack: Stack) -> BesideJob:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        send = predict_sender(channel, "minilm", texts_of(1000), timeout_s=30.0)
        capacity = await run_closed_loop(send, concurrency=32, duration_s=4.0, warmup_s=1.0)
        return await online_beside_job(
            channel, capacity.ok_per_s / 2, window_s=ONLINE_WINDOW_S, pairs=NUM_PAIRS
        )


def test_online_traffic_is_served_beside_a_saturating_job(beside_job: BesideJob) -> None:
    """Every online call, alone and beside a job that keeps the worker busy, is answered OK
    (the job's batch-class items take what online traffic leaves, never its calls), and the
    job made progress during the windows beside it."""
    outcomes = beside_job.alone + beside_job.beside
    assert outcomes and all(o.ok for o in outcomes), {o.status for o in outcomes}
    assert beside_job.job_items_per_s > 0, beside_job.summary()
