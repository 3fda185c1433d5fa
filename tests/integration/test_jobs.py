"""Durable batch jobs against a real redis-server (AOF on, ACL users), the gateway's JobService
on a real gRPC server, a real gRPC Predict target, and the runner as a real process that the
tests SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis
import redis.exceptions

from services.common import metric_names as names
from services.common.errors import RETRY_AFTER_MS_KEY
from services.common.job_policy import CRASH_ROUNDS, FLEET_PATIENCE_S, ItemStatus
from services.common.job_records import NewJob, QueueEntry
from services.common.job_room import RESULT_OVERHEAD_BYTES, SUBMIT_MEMORY_SHARE, StoreFull
from services.common.job_store import GROUP, JobStore
from services.common.priority import PriorityClass
from services.common.redis_acl import GATEWAY, JOB_COMMANDS, JOBS
from services.common.tensors import tensor_from_pb
from services.gateway.auth import KeyStore, Principal, hash_key
from services.gateway.jobs_api import JobServicer
from services.gateway.tenants import TenantPolicy
from services.jobs.chunk_calls import item_result
from services.jobs.holding import KEEP_SLACK_MS, keep_claimed
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import jobs_pb2 as jobs
from services.pb.inference.v1 import jobs_pb2_grpc as jobs_grpc
from services.pb.inference.v1 import types_pb2
from tests.support.jobs import (
    BATCH,
    GARBLED,
    HUGE,
    POISON,
    UNSERVED,
    WIDE,
    PredictTarget,
    expected_output,
    start_job_service,
    start_runner,
    start_target,
    text_items,
)
from tests.support.metrics import scrape, total
from tests.support.models import replace_config_lines, write_minilm_repository
from tests.support.processes import REPO_ROOT, ServiceProcess
from tests.support.redis import RedisServer, start_redis
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

#: The job service's byte limit in these tests (JobsApiConfig.max_bytes).
MAX_JOB_BYTES = 8 * 1024 * 1024

KEYS = KeyStore(
    {
        hash_key("key-a"): Principal("a", None, TenantPolicy("a")),
        hash_key("key-b"): Principal("b", None, TenantPolicy("b")),
        hash_key("key-ab"): Principal("a:b", None, TenantPolicy("a:b")),
        hash_key("key-c"): Principal(
            "c", None, TenantPolicy("c", priorities=frozenset(PriorityClass))
        ),
    }
)
AS_A = (("authorization", "Bearer key-a"),)
AS_B = (("authorization", "Bearer key-b"),)
AS_AB = (("authorization", "Bearer key-ab"),)
AS_CRITICAL = (("authorization", "Bearer key-c"),)


@dataclass
class Fabric:
    redis: RedisServer
    target: PredictTarget
    target_address: str
    #: The JobService's host:port.
    address: str
    jobs: jobs_grpc.JobServiceStub
    store: JobStore
    tmp_path: Path
    runners: list[ServiceProcess]

    def start_runner(self, name: str, *extra: str) -> ServiceProcess:
        runner = start_runner(self.tmp_path, self.redis, self.target_address, name, *extra)
        self.runners.append(runner)
        return runner

    async def submit(
        self, texts: list[str], *, key: str = "", metadata: tuple[tuple[str, str], ...] = AS_A
    ) -> str:
        request = jobs.SubmitJobRequest(
            model_name="minilm", items=text_items(texts), idempotency_key=key
        )
        return (await self.jobs.SubmitJob(request, metadata=metadata)).job_id

    async def job(self, job_id: str) -> jobs.Job:
        return await self.jobs.GetJob(jobs.GetJobRequest(job_id=job_id), metadata=AS_A)

    async def finished(self, job_id: str, timeout_s: float = 60.0) -> jobs.Job:
        async def is_done() -> jobs.Job | None:
            job = await self.job(job_id)
            return job if job.num_ok + job.num_failed + job.num_cancelled == job.num_items else None

        return await eventually(is_done, timeout_s=timeout_s, interval_s=0.1)

    async def results(self, job_id: str, start_index: int = 0) -> list[jobs.JobItemResult]:
        request = jobs.GetJobResultsRequest(job_id=job_id, start_index=start_index)
        return [r async for r in self.jobs.GetJobResults(request, metadata=AS_A)]

    async def job_ids(self) -> list[str]:
        """Tenant a's job ids, newest first (one page)."""
        listed = await self.jobs.ListJobs(jobs.ListJobsRequest(page_size=500), metadata=AS_A)
        return [j.job_id for j in listed.jobs]

    async def cli(self, *args: str) -> tuple[str, str]:
        """`python -m services.client ARGS` as tenant a; its (stdout, stderr) once it exits 0."""
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.client", "--address", self.address,
            "--api-key", "key-a", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO_ROOT,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60.0)
        assert process.returncode == 0, stderr.decode()
        return stdout.decode(), stderr.decode()


@pytest.fixture
async def fabric(tmp_path: Path) -> AsyncIterator[Fabric]:
    redis = start_redis(tmp_path, appendonly=True)
    target = PredictTarget()
    target_server, target_address = await start_target(target)
    # A byte limit of 8 MiB (the default is 64): the 100,000 short texts (about 2 MB) fit, and
    # the test of the limit streams 9 MB, not 70, beside the other tests on two cores.
    jobs_server, jobs_address, store, _ = await start_job_service(
        redis, REPO_ROOT / "models", KEYS, max_bytes=MAX_JOB_BYTES
    )
    channel = grpc.aio.insecure_channel(jobs_address)
    fabric = Fabric(
        redis,
        target,
        target_address,
        jobs_address,
        jobs_grpc.JobServiceStub(channel),
        store,
        tmp_path,
        [],
    )
    try:
        yield fabric
    finally:
        for runner in fabric.runners:
            if runner.process.poll() is None:
                runner.terminate()
        await channel.close()
        await jobs_server.stop(None)
        await target_server.stop(None)
        await store.client.aclose()
        redis.stop()


def texts_of(n: int) -> list[str]:
    return [f"item number {i}" for i in range(n)]


async def streamed(
    texts: list[str], *, items_per_message: int, model_name: str = "minilm"
) -> AsyncIterator[jobs.SubmitJobRequest]:
    """A SubmitJobStream: the header with the first items, then items only."""
    yield jobs.SubmitJobRequest(model_name=model_name, items=text_items(texts[:items_per_message]))
    for start in range(items_per_message, len(texts), items_per_message):
        yield jobs.SubmitJobRequest(items=text_items(texts[start : start + items_per_message]))


def assert_all_ok_in_order(results: list[jobs.JobItemResult], texts: list[str]) -> None:
    assert [r.index for r in results] == list(range(len(texts)))
    for result, text in zip(results, texts, strict=True):
        assert result.status == jobs.ITEM_STATUS_OK, result
        np.testing.assert_array_equal(tensor_from_pb(result.output), expected_output(text))


async def test_job_runs_at_batch_priority_with_results_in_input_order(fabric: Fabric) -> None:
    runner = fabric.start_runner("runner-1")
    texts = texts_of(200)
    job_id = await fabric.submit(texts)
    job = await fabric.finished(job_id)
    assert job.state == jobs.JOB_STATE_SUCCEEDED and job.num_ok == 200 and job.progress == 1.0
    assert_all_ok_in_order(await fabric.results(job_id), texts)
    # Resumable from an offset: exactly the rest, in order.
    assert [r.index for r in await fabric.results(job_id, start_index=150)] == list(range(150, 200))
    assert fabric.target.priorities == {BATCH}
    # Every call of a job carries one request id, the gateway's sticky key: a job that names
    # no version runs every chunk on one label's version (while the weights stand), not some
    # chunks on stable and some on canary, outputs mixed with no trace of which is which.
    assert fabric.target.request_ids == {f"job-{job_id}"}
    # The runner counts a chunk's items once its record's reply is back, which may be a moment
    # after the job's counts (written by that record) read finished.
    await eventually(
        lambda: total(scrape(runner.metrics_port), names.JOBS_ITEMS_TOTAL, status="ok") == 200,
        message="every item counted ok",
    )
    assert total(scrape(runner.metrics_port), names.JOBS_ITEMS_RUNNING) == 0


async def test_a_job_at_critical_priority_is_refused_at_submission(fabric: Fabric) -> None:
    """Runners send a job's items under their own key, which holds interactive and batch (the
    chart's grant): a critical job was accepted, then every item failed PERMISSION_DENIED
    naming the runners' tenant. Critical is for online calls; jobs are refused it up front,
    even from a tenant granted it."""
    header = jobs.SubmitJobRequest(
        model_name="minilm", items=text_items(["a"]), priority=types_pb2.PRIORITY_CRITICAL
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await fabric.jobs.SubmitJob(header, metadata=AS_CRITICAL)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "critical" in (raised.value.details() or "")
    assert await fabric.store.list_ids("c", after=None, limit=10) == []  # nothing submitted


@contextlib.asynccontextmanager
async def lone_job_service(
    tmp_path: Path, repository: Path = REPO_ROOT / "models", **settings: int
) -> AsyncIterator[tuple[RedisServer, jobs_grpc.JobServiceStub, JobServicer]]:
    """A Redis and a JobService of its own over `repository` (`settings`: start_job_service's),
    with no runner: the Redis, a stub of the service, and its servicer."""
    redis = start_redis(tmp_path)
    server, address, store, servicer = await start_job_service(redis, repository, KEYS, **settings)
    channel = grpc.aio.insecure_channel(address)
    try:
        yield redis, jobs_grpc.JobServiceStub(channel), servicer
    finally:
        await channel.close()
        await server.stop(None)
        await store.client.aclose()
        redis.stop()


async def test_a_job_of_large_items_is_cut_into_calls_within_the_message_limit(
    tmp_path: Path,
) -> None:
    """Chunks were cut by item count alone: 8 items of 40 KiB made one call of 320 KiB, past a
    gateway's limit of 256 KiB (grpc refuses it RESOURCE_EXHAUSTED before any handler), which
    the runner took for an overloaded fleet and retried for 30 minutes before failing every
    item, though each fits alone. Chunks now hold at most half the limit's bytes."""
    target = PredictTarget()
    target_server, target_address = await start_target(target, max_message_bytes=256 * 1024)
    service = lone_job_service(tmp_path, chunk_size=8, max_chunk_bytes=128 * 1024)
    async with service as (redis, stub, _):
        runner = start_runner(tmp_path, redis, target_address, "runner-1")
        try:
            texts = [f"{i} " + "x" * (40 * 1024) for i in range(8)]
            # And one large item among short ones: it shrinks its own chunk, not the others.
            mixed = ["y" * (70 * 1024), *texts_of(63)]

            async def finished(job_id: str) -> jobs.Job:
                async def is_done() -> jobs.Job | None:
                    job = await stub.GetJob(jobs.GetJobRequest(job_id=job_id), metadata=AS_A)
                    return job if job.num_ok + job.num_failed == job.num_items else None

                return await eventually(is_done, timeout_s=60.0, interval_s=0.1)

            for items, calls in ((texts, (2, 4)), (mixed, (8, 9))):
                before = target.num_calls
                request = jobs.SubmitJobRequest(model_name="minilm", items=text_items(items))
                job = await finished((await stub.SubmitJob(request, metadata=AS_A)).job_id)
                assert job.num_ok == len(items), job
                # 3 items of 40 KiB a call (120 KiB), never 8; the 70 KiB item's chunk only short
                assert calls[0] <= target.num_calls - before <= calls[1]
        finally:
            runner.terminate()
            await target_server.stop(None)


async def test_a_refusal_for_load_is_retried_no_sooner_than_its_hint(tmp_path: Path) -> None:
    """A chunk refused RESOURCE_EXHAUSTED with `retry-after-ms` (a tenant over its rate: no
    retry sooner can succeed) is retried after the hint. The runner kept only the status and
    retried with its own backoff (a draw under 0.2 s, 0.4 s...): four more refused calls in
    about 1.5 s, each counted against the tenant (review finding)."""
    target = PredictTarget(num_overloaded=2, overload_hint_ms=800)
    target_server, target_address = await start_target(target)
    async with lone_job_service(tmp_path, chunk_size=8) as (redis, stub, _):
        runner = start_runner(tmp_path, redis, target_address, "runner-1")
        try:
            request = jobs.SubmitJobRequest(model_name="minilm", items=text_items(texts_of(4)))
            job_id = (await stub.SubmitJob(request, metadata=AS_A)).job_id

            async def is_done() -> jobs.Job | None:
                job = await stub.GetJob(jobs.GetJobRequest(job_id=job_id), metadata=AS_A)
                return job if job.num_ok + job.num_failed == job.num_items else None

            job = await eventually(is_done, timeout_s=60.0, interval_s=0.1)
        finally:
            runner.terminate()
            await target_server.stop(None)
    assert job.num_ok == 4, job
    first, second, third = target.call_times
    # The hint is jittered where it is made (at least 0.75 of it): 0.6 s, where the runner's
    # own draws were under 0.2 s and 0.4 s.
    assert second - first >= 0.6 and third - second >= 0.6


async def test_a_jobs_chunks_hold_no_more_rows_than_its_model_takes_in_one_call(
    tmp_path: Path,
) -> None:
    """minilm whose workers queue 16 rows: a job of 40 items (batch class, as jobs are by
    default), chunks of up to 64, is cut into chunks of 8, half the queue, what a worker takes
    of one batch-class call. Chunks of 64 were each refused INVALID_ARGUMENT (past the queue),
    and the runner then split each into 64 one-item calls; chunks of 16 were refused on an
    idle worker too, RESOURCE_EXHAUSTED with a retry hint, for good."""
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=1000)
    replace_config_lines(repository / "minilm" / "config.toml",
                         {"max_queue_size": "max_queue_size = 16"})  # fmt: skip
    async with lone_job_service(tmp_path, repository, chunk_size=64) as (redis, stub, _):
        request = jobs.SubmitJobRequest(model_name="minilm", items=text_items(texts_of(40)))
        await stub.SubmitJob(request, metadata=AS_A)
        store = JobStore(aioredis.Redis.from_url(redis.url))
        try:
            await store.ensure_group()
            entries = await store.read_new("a-runner", 10, 1)
        finally:
            await store.client.aclose()
    assert [(e.start, e.end) for e in entries] == [(i, i + 8) for i in range(0, 40, 8)]


async def test_jobs_being_submitted_together_hold_a_bounded_share_of_the_gateways_memory(
    tmp_path: Path,
) -> None:
    """Each job may hold 1 MiB here while it arrives, all of them together 1.5 MiB, those of
    one tenant 1 MiB. Before, the bound was per job only: a few streamed submissions of 64 MiB
    at once held hundreds of MB, and could get the gateway, with all its online traffic,
    killed for memory. A second 0.94 MiB job streamed while the first still arrives is refused
    RESOURCE_EXHAUSTED with a hint, from its tenant or another; another tenant's small job is
    taken; once the first is stored, the second is taken too."""
    service = lone_job_service(tmp_path, max_bytes=1024 * 1024, max_bytes_held=1536 * 1024)
    texts = [f"{i} " + "x" * (60 * 1024) for i in range(16)]  # 0.94 MiB in all
    first_may_end = asyncio.Event()

    async def first_job() -> AsyncIterator[jobs.SubmitJobRequest]:
        async for message in streamed(texts, items_per_message=4):
            yield message
        await first_may_end.wait()

    async with service as (_, stub, servicer):
        first = asyncio.ensure_future(stub.SubmitJobStream(first_job(), metadata=AS_A))
        await eventually(lambda: servicer._held.total > 900 * 1024, timeout_s=30.0)
        for metadata, whose in ((AS_A, "tenant 'a'"), (AS_B, "this gateway")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SubmitJobStream(streamed(texts, items_per_message=4), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert whose in (refused.value.details() or "")
            assert dict(refused.value.trailing_metadata() or ()).get(RETRY_AFTER_MS_KEY)
        # Tenant a holds one job's worth at most: another tenant's small job still goes in.
        small = jobs.SubmitJobRequest(model_name="minilm", items=text_items(texts[:4]))
        assert (await stub.SubmitJob(small, metadata=AS_B)).job_id
        first_may_end.set()
        assert (await first).job_id
        assert servicer._held.total == 0
        again = await stub.SubmitJobStream(streamed(texts, items_per_message=4), metadata=AS_A)
        job = await stub.GetJob(jobs.GetJobRequest(job_id=again.job_id), metadata=AS_A)
        assert job.num_items == 16 and servicer._held.total == 0


async def test_an_item_whose_call_would_not_fit_the_message_limit_is_refused_at_submission(
    fabric: Fabric,
) -> None:
    """An item within a few bytes of the gateway's limit (4 MiB) passes in its own message,
    but the runner's call of it adds the model and request id: grpc would refuse that call
    RESOURCE_EXHAUSTED every round. Refused INVALID_ARGUMENT at submission instead."""
    request = jobs.SubmitJobRequest(
        model_name="minilm", items=text_items(["z" * (4 * 1024 * 1024 - 32 * 1024)])
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await fabric.jobs.SubmitJob(request, metadata=AS_A)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "an item may take at most" in (refused.value.details() or "")


async def test_a_result_recorded_twice_is_written_and_counted_once(fabric: Fabric) -> None:
    """Two runners may both run a chunk (one reclaimed it from the other, which was slow, not
    dead): the record says which results were its own, so that each item is counted once
    over all runners (their items_total)."""
    job_id = await fabric.submit(texts_of(3))
    job = await fabric.store.get(job_id)
    assert job is not None
    outcomes = [item_result(i, ItemStatus.OK, 1) for i in range(3)]
    assert await fabric.store.record(job, outcomes[:2]) == outcomes[:2]
    assert await fabric.store.record(job, outcomes[1:]) == outcomes[2:]
    assert await fabric.store.record(job, outcomes) == []
    assert (await fabric.job(job_id)).num_ok == 3


async def test_consumers_of_runners_that_exited_are_forgotten_but_never_with_entries(
    fabric: Fabric,
) -> None:
    """Each runner process is a consumer of its own name: the group kept every one that ever
    ran. Those idle past the claim timeout with nothing pending are deleted (by any runner);
    one holding an entry never is (its entry would become unclaimable)."""
    store = fabric.store

    async def consumers() -> set[str]:
        return {c["name"].decode() for c in await store.client.xinfo_consumers(
            store.queue_key, GROUP)}  # fmt: skip

    async def ran_one(name: str, *, done: bool = True) -> None:
        """Consumer `name` claims one chunk (a read makes a consumer only when it gets one)
        and, if `done`, acknowledges it."""
        (entry,) = await store.read_new(name, 1, 1)
        if done:
            await store.client.xack(store.queue_key, GROUP, entry.entry_id)

    await store.ensure_group()
    for _ in range(4):
        await fabric.submit(texts_of(1))
    await ran_one("holding", done=False)  # its entry stays pending
    await ran_one("exited")
    await ran_one("me")
    assert await store.forget_consumers("me", 60_000) == 0  # none idle that long
    await asyncio.sleep(0.05)
    assert await store.forget_consumers("me", 10) == 1
    assert await consumers() == {"holding", "me"}
    # A runner does so itself, each round, past its claim timeout (3 s here).
    await ran_one("exited-too")
    fabric.start_runner("runner-1")
    await eventually(lambda: _without("exited-too", consumers), timeout_s=30.0)


async def test_at_redis_s_memory_cap_a_runner_still_takes_over_abandoned_chunks(
    fabric: Fabric,
) -> None:
    """Each round a runner makes sure the group exists, then reclaims chunks left by runners
    that died. At Redis's memory cap the create is refused OOM before Redis would say the
    group exists, and the runner took that for Redis unreachable: it reclaimed nothing until
    there was room, though reclaiming writes nothing (review finding)."""
    store = fabric.store
    await store.ensure_group()
    await fabric.submit(texts_of(1))
    (abandoned,) = await store.read_new("died", 1, 1)
    admin = aioredis.Redis.from_url(fabric.redis.url)
    try:
        await admin.config_set("maxmemory", "1")  # at the cap: every write refused
        await store.ensure_group()
        await asyncio.sleep(0.02)
        (taken,) = await store.reclaim("me", 10, 10)
    finally:
        await admin.config_set("maxmemory", "0")
        await admin.aclose()
    assert taken.entry_id == abandoned.entry_id


async def test_a_runner_on_an_older_acl_still_runs_the_chunks_it_takes_over(
    fabric: Fabric,
) -> None:
    """Redis still runs the ACL of the release before (deploy/k8s/README.md: until ACL LOAD):
    forgetting exited runners' consumers is refused, and a runner still runs the chunks it
    takes over in that round (they were left claimed for another claim timeout, every time)."""
    admin = aioredis.Redis.from_url(fabric.redis.url)
    try:
        # Redis 6.2 takes a subcommand back only with its whole command.
        await admin.execute_command("ACL", "SETUSER", JOBS, "-xinfo", "+xinfo|groups")
    finally:
        await admin.aclose()
    await fabric.store.ensure_group()
    texts = texts_of(3)
    job_id = await fabric.submit(texts)
    (entry,) = await fabric.store.read_new("exited", 1, 1)  # its runner died holding it
    assert entry.job_id == job_id
    fabric.start_runner("runner-1")
    job = await fabric.finished(job_id, timeout_s=30.0)
    assert job.num_ok == 3
    assert_all_ok_in_order(await fabric.results(job_id), texts)


@pytest.mark.parametrize("acl", ["this release's", "one without TIME"])
async def test_a_chunks_patience_with_the_fleet_is_timed_by_redis_not_by_runners_clocks(
    fabric: Fabric, acl: str
) -> None:
    """The first round a chunk waited for the fleet, and each later one, were timed by the
    counting runner's wall clock: a runner 30 minutes ahead of the first found the chunk's
    patience spent at once, and failed its items (review finding). Redis's clock times them
    now; under an ACL from before TIME, the runners' clocks, as before."""
    if acl != "this release's":
        admin = aioredis.Redis.from_url(fabric.redis.url)
        try:
            await admin.execute_command("ACL", "SETUSER", GATEWAY, "-time")  # the store's user
        finally:
            await admin.aclose()
    job_id = await fabric.submit(texts_of(2))
    now_s = time.time()
    assert (await fabric.store.fleet_round(job_id, 0, now_s))[0] == 1
    rounds, waited_s = await fabric.store.fleet_round(job_id, 0, now_s + FLEET_PATIENCE_S)
    assert rounds == 2
    if acl == "this release's":
        assert waited_s < FLEET_PATIENCE_S / 2  # seconds at most by Redis's clock
    else:
        assert waited_s == pytest.approx(FLEET_PATIENCE_S)


async def _without(name: str, consumers: Callable[[], Awaitable[set[str]]]) -> bool:
    return name not in await consumers()


async def test_runner_killed_mid_job_another_finishes_every_item_exactly_once(
    fabric: Fabric,
) -> None:
    # Caught mid-job: some items done, then its calls held at the target while it dies.
    fabric.target.hold_after_runs = 100
    first = fabric.start_runner("runner-1")
    texts = texts_of(400)
    job_id = await fabric.submit(texts)

    async def some_done_and_some_held() -> bool:
        return fabric.target.num_held > 0 and (await fabric.job(job_id)).num_ok > 0

    await eventually(some_done_and_some_held, timeout_s=30.0, interval_s=0.02)
    first.process.kill()
    first.process.wait()
    fabric.target.release()
    fabric.start_runner("runner-2")  # reclaims the dead runner's entries after 3 s idle
    job = await fabric.finished(job_id)
    assert job.state == jobs.JOB_STATE_SUCCEEDED and job.num_ok == 400
    assert_all_ok_in_order(await fabric.results(job_id), texts)
    assert set(fabric.target.runs) == set(texts)


async def test_same_idempotency_key_returns_the_same_job_and_runs_nothing_twice(
    fabric: Fabric,
) -> None:
    texts = texts_of(20)
    first = await fabric.jobs.SubmitJob(
        jobs.SubmitJobRequest(model_name="minilm", items=text_items(texts), idempotency_key="k"),
        metadata=AS_A,
    )
    again = await fabric.jobs.SubmitJob(
        jobs.SubmitJobRequest(model_name="minilm", items=text_items(texts), idempotency_key="k"),
        metadata=AS_A,
    )
    assert (again.job_id, again.is_existing, first.is_existing) == (first.job_id, True, False)
    # The key is per tenant: another tenant's "k" is its own job.
    other = await fabric.submit(texts, key="k", metadata=AS_B)
    assert other != first.job_id
    fabric.start_runner("runner-1")
    await fabric.finished(first.job_id)
    listed = await fabric.jobs.ListJobs(jobs.ListJobsRequest(), metadata=AS_A)
    assert [j.job_id for j in listed.jobs] == [first.job_id]
    listed_b = await fabric.jobs.ListJobs(jobs.ListJobsRequest(), metadata=AS_B)
    assert [j.job_id for j in listed_b.jobs] == [other]

    async def both_ran() -> bool:
        return all(fabric.target.runs[t] == 2 for t in texts)  # a's job once, b's once

    await eventually(both_ran, timeout_s=30.0)


async def test_a_page_of_jobs_is_read_in_one_round_trip(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ListJobs read each job of its page alone, one round trip after another (a page of 500
    against a Redis answering in 300 ms: 150 s); its records are read in one pipeline (review
    finding). Commands sent alone go through `execute_command`, a pipeline's do not."""
    job_ids = [await fabric.submit(texts_of(2)) for _ in range(5)]
    sent_alone: list[str] = []
    send = fabric.store.client.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        sent_alone.append(str(args[0]))
        return await send(*args, **options)

    monkeypatch.setattr(fabric.store.client, "execute_command", counted)
    assert await fabric.job_ids() == job_ids[::-1]
    assert sent_alone == ["ZRANGE"], "the page's ids, then its records in one pipeline"


async def test_idempotency_keys_of_tenants_whose_names_share_a_prefix_never_meet(
    fabric: Fabric,
) -> None:
    """Tenant "a" with key "b:k" and tenant "a:b" with key "k": two jobs. Before, both were
    the Redis key `...:idem:a:b:k`: the second submission got the first tenant's job id back
    (is_existing) and stored nothing, and its GetJob said NOT_FOUND."""
    first = await fabric.jobs.SubmitJob(
        jobs.SubmitJobRequest(model_name="minilm", items=text_items(["x"]), idempotency_key="b:k"),
        metadata=AS_A,
    )
    second = await fabric.jobs.SubmitJob(
        jobs.SubmitJobRequest(model_name="minilm", items=text_items(["y"]), idempotency_key="k"),
        metadata=AS_AB,
    )
    assert not second.is_existing and second.job_id != first.job_id
    job = await fabric.jobs.GetJob(jobs.GetJobRequest(job_id=second.job_id), metadata=AS_AB)
    assert job.num_items == 1


async def test_poison_items_are_dead_lettered_with_their_status(fabric: Fabric) -> None:
    texts = texts_of(60)
    poison = {7, 8, 30, 44, 59}
    for i in poison:
        texts[i] = f"{POISON} {i}"
    fabric.target.num_unavailable = 2  # transient failures first: retried, not failed
    fabric.start_runner("runner-1")
    job_id = await fabric.submit(texts)
    job = await fabric.finished(job_id)
    assert job.state == jobs.JOB_STATE_PARTIALLY_FAILED
    assert (job.num_ok, job.num_failed) == (55, 5)
    results = await fabric.results(job_id)
    assert [r.index for r in results] == list(range(60))
    failed = {r.index: r for r in results if r.status == jobs.ITEM_STATUS_FAILED}
    assert set(failed) == poison
    assert all(r.code == "INVALID_ARGUMENT" and POISON in r.message for r in failed.values())
    dead = await fabric.store.client.xrange(fabric.store.dead_key)
    assert sorted(int(fields[b"index"]) for _, fields in dead) == sorted(poison)


async def test_a_chunk_its_runner_always_fails_on_is_failed_after_its_rounds_not_rerun_forever(
    fabric: Fabric,
) -> None:
    # Chunks of 8: the first holds an item whose answer comes back one output short, which
    # the runner cannot read (an unexpected error, not a status). It was left pending and
    # rerun by every reclaim forever; now it runs CRASH_ROUNDS times, then its items fail.
    texts = texts_of(16)
    texts[3] = f"{GARBLED} 3"
    fabric.start_runner("runner-1")
    job_id = await fabric.submit(texts)
    job = await fabric.finished(job_id, timeout_s=120.0)
    assert (job.state, job.num_ok, job.num_failed) == (jobs.JOB_STATE_PARTIALLY_FAILED, 8, 8)
    results = await fabric.results(job_id)
    assert [r.index for r in results] == list(range(16))
    for result, text in zip(results[8:], texts[8:], strict=True):
        assert result.status == jobs.ITEM_STATUS_OK, result
        np.testing.assert_array_equal(tensor_from_pb(result.output), expected_output(text))
    for result in results[:8]:
        assert (result.status, result.code) == (jobs.ITEM_STATUS_FAILED, "INTERNAL"), result
        assert f"{CRASH_ROUNDS} times" in result.message and "ValueError" in result.message
    assert fabric.target.runs[texts[3]] == CRASH_ROUNDS
    dead = await fabric.store.client.xrange(fabric.store.dead_key)
    assert sorted(int(fields[b"index"]) for _, fields in dead) == list(range(8))
    backlog = await fabric.store.backlog()
    assert backlog[:2] == (0, 0)  # nothing left queued or claimed


async def test_a_finished_job_expires_after_its_retention_and_its_key_may_name_a_new_one(
    fabric: Fabric,
) -> None:
    fabric.start_runner("runner-1", "--retention-s", "5")
    texts = texts_of(10)
    job_id = await fabric.submit(texts, key="nightly")
    job = await fabric.finished(job_id)
    assert job.state == jobs.JOB_STATE_SUCCEEDED
    assert_all_ok_in_order(await fabric.results(job_id), texts)
    key = fabric.store.job_key(job_id)
    idem_key = fabric.store.idempotency_key("a", "nightly")
    admin = aioredis.Redis.from_url(fabric.redis.url)  # TTLs are no tier's to read
    try:
        for name in (key, f"{key}:items", f"{key}:results", idem_key):
            assert 0 < await admin.pttl(name) <= 5_000, name
        # Gone once the retention passed: NOT_FOUND, its keys gone, the key free.
        await eventually(lambda: _gone(admin, key), timeout_s=30.0, interval_s=0.2)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fabric.job(job_id)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert not await admin.exists(f"{key}:items", f"{key}:results", idem_key)
        again = await fabric.submit(texts, key="nightly")
        assert again != job_id
        assert (await fabric.finished(again)).state == jobs.JOB_STATE_SUCCEEDED
        # The next job's end took the one gone out of the tenant's list (no ListJobs needed).
        tenant_list = "fabric:jobs:tenant:a"
        assert await admin.zscore(tenant_list, job_id) is None
        assert await admin.zscore(tenant_list, again) is not None
        assert await fabric.job_ids() == [again]
    finally:
        await admin.aclose()


async def _gone(client: aioredis.Redis, key: str) -> bool:
    return not await client.exists(key)


async def test_a_job_for_a_version_that_does_not_exist_is_refused_at_submission(
    fabric: Fabric,
) -> None:
    """NOT_FOUND when submitted, as Predict would answer now (it was accepted, and each item
    then failed on its own call); a version no worker serves yet (one loading) is accepted."""
    for version in ("99", "canary"):
        request = jobs.SubmitJobRequest(
            model_name="minilm", model_version=version, items=text_items(["a", "b"])
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fabric.jobs.SubmitJob(request, metadata=AS_A)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND, version
    for odd in ("1.5", "\u00b2"):  # a superscript two is a digit to str.isdigit, not a number
        request = jobs.SubmitJobRequest(
            model_name="minilm", model_version=odd, items=text_items(["a"])
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fabric.jobs.SubmitJob(request, metadata=AS_A)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, odd
    request = jobs.SubmitJobRequest(model_name="minilm", model_version="1", items=text_items(["a"]))
    assert (await fabric.jobs.SubmitJob(request, metadata=AS_A)).job_id
    # A page token of the same kind: a digit to str.isdigit, no number to int().
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await fabric.jobs.ListJobs(jobs.ListJobsRequest(page_token="\u00b2"), metadata=AS_A)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_runner_does_not_run_again_a_chunk_it_is_still_running(fabric: Fabric) -> None:
    """A chunk whose calls are held past the claim timeout (3 s; each call times out after 2 s
    and is retried) is idle that long in the queue, and the runner's own reclaim finds it: it
    is this runner's, running, and is not run a second time (it was: each text ran twice)."""
    fabric.target.hold_after_runs = 0
    fabric.start_runner("runner-1")
    texts = texts_of(4)
    job_id = await fabric.submit(texts)
    await eventually(lambda: fabric.target.num_held >= 1, timeout_s=30.0)
    await asyncio.sleep(5.0)  # past the claim timeout, and two reclaims of the runner's
    fabric.target.release()
    job = await fabric.finished(job_id)
    assert job.num_ok == 4
    assert [fabric.target.runs[t] for t in texts] == [1] * 4


async def test_another_runner_does_not_take_a_chunk_still_running_past_the_claim_timeout(
    fabric: Fabric,
) -> None:
    """The same held chunk with a second runner up: the first keeps its entry claimed while it
    runs (every third of the 3 s claim timeout), so the second's reclaim leaves it alone and
    each text runs once. Before, the entry was idle in the queue from its delivery on, the
    second runner took it over after 3 s and ran it too: each text ran twice."""
    fabric.target.hold_after_runs = 0
    # Six calls of 2 s each before the owner gives up: the release below falls well inside
    # them however late a loaded machine runs it.
    for name in ("runner-1", "runner-2"):
        fabric.start_runner(name, "--max-attempts", "6")
    texts = texts_of(4)
    job_id = await fabric.submit(texts)
    await eventually(lambda: fabric.target.num_held >= 1, timeout_s=30.0)
    held_s = time.monotonic()
    # Past the claim timeout and a reclaim of the other runner's (every second).
    await asyncio.sleep(max(0.0, held_s + 4.5 - time.monotonic()))
    fabric.target.release()
    job = await fabric.finished(job_id)
    assert job.num_ok == 4
    assert [fabric.target.runs[t] for t in texts] == [1] * 4


async def _read_by_runner_1(store: JobStore) -> QueueEntry:
    """The entry of a new job's one chunk, read by "runner-1"."""
    await store.submit(NewJob("a", "minilm", "", "batch", [b"x", b"y"], "", 0.0), chunk_size=2)
    await store.ensure_group()
    [entry] = await store.read_new("runner-1", 1, 100)
    return entry


async def test_a_keep_leaves_a_chunk_another_runner_took_over_with_it(
    redis_server: RedisServer,
) -> None:
    """A runner keeps the entry of a chunk it runs by claiming it again. With no idle time
    asked, a keep that reached Redis just after another runner had taken the entry over took
    it back, and both ran the chunk (review finding). A keep now claims the entry only while
    it is still the runner's: one of an entry taken over meanwhile is refused, and the entry
    stays the other runner's."""
    store = JobStore(aioredis.Redis.from_url(redis_server.role_url(JOBS)))  # its ACL
    try:
        entry = await _read_by_runner_1(store)
        assert await store.keep("runner-1", entry, 1000)
        assert await store.keep("runner-1", entry, 1000)  # at once: the idle time is not read
        taken = await store.reclaim("runner-2", 0, 1)  # a takeover, its reclaim just in
        assert [e.entry_id for e in taken] == [entry.entry_id]
        assert not await store.keep("runner-1", entry, 0)
        pending = await store.client.xpending_range(store.queue_key, GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pending] == [b"runner-2"]
        assert [p["times_delivered"] for p in pending] == [2]  # keeps count no delivery
    finally:
        await store.client.aclose()


async def test_a_keep_under_an_acl_of_before_its_script_claims_an_entry_idle_since_the_last(
    redis_server: RedisServer,
) -> None:
    """Redis still runs the ACL of the release before (until ACL LOAD), which refuses the keep
    script's XPENDING: a keep claims the entry if it has been idle the time asked (since the
    runner's last keep), as that release did, so a chunk is still kept, and one taken over
    since (idle less) is left to the other runner."""
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await admin.execute_command("ACL", "SETUSER", JOBS, "-xpending")
    finally:
        await admin.aclose()
    store = JobStore(aioredis.Redis.from_url(redis_server.role_url(JOBS)))
    admin = aioredis.Redis.from_url(redis_server.url)  # the jobs user may not look

    async def idle_a_minute(entry: QueueEntry) -> None:
        """Made so in Redis, not waited for: the entry as if runner-1's last keep (or its
        delivery) was a minute ago, however slowly the machine runs the test."""
        await admin.xclaim(
            store.queue_key, GROUP, "runner-1", 0, [entry.entry_id], idle=60_000, justid=True
        )

    try:
        entry = await _read_by_runner_1(store)
        await idle_a_minute(entry)
        assert await store.keep("runner-1", entry, 60_000 - KEEP_SLACK_MS)  # since delivered
        await idle_a_minute(entry)
        assert [e.entry_id for e in await store.reclaim("runner-2", 0, 1)] == [entry.entry_id]
        # Idle a minute since runner-1's keep, but taken over just now: left to runner-2.
        assert not await store.keep("runner-1", entry, 60_000 - KEEP_SLACK_MS)
        pending = await admin.xpending_range(store.queue_key, GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pending] == [b"runner-2"]
    finally:
        await store.client.aclose()
        await admin.aclose()


class _LostReply:
    """A store whose first keep reaches Redis but whose reply is lost (a socket timeout while
    Redis is busy): the entry's idle time restarted, the runner told it failed."""

    def __init__(self, store: JobStore) -> None:
        self._store, self.num_keeps = store, 0

    async def keep(self, consumer: str, entry: QueueEntry, min_idle_ms: int) -> bool:
        self.num_keeps += 1
        kept = await self._store.keep(consumer, entry, min_idle_ms)
        if self.num_keeps == 1:
            raise TimeoutError("reply lost")
        return kept


async def test_a_keep_whose_reply_was_lost_goes_on_keeping_the_chunk(
    redis_server: RedisServer,
) -> None:
    """Before, a keep claimed the entry only if it had been idle since the last keep the
    runner saw succeed: after a keep whose reply was lost, the next found it idle too short,
    stopped keeping a chunk still running, and another runner took it over and ran it beside
    this one (review finding)."""
    store = JobStore(aioredis.Redis.from_url(redis_server.role_url(JOBS)))  # its ACL
    try:
        entry = await _read_by_runner_1(store)
        lossy = _LostReply(store)
        keeping = asyncio.create_task(keep_claimed(lossy, "runner-1", entry, 0.3))  # type: ignore[arg-type]
        # Keeps go on past the lost reply (the old keep stopped at the second, and the entry
        # was idle from then) ...
        await eventually(lambda: keeping.done() or lossy.num_keeps >= 4, message="4 keeps")
        assert not keeping.done(), "stopped keeping after a lost reply"
        # ... and each restarts the entry's idle time: made to look a minute idle (a dead
        # runner's; set in Redis, not waited for), it is kept again by the next keep begun
        # after that, so another runner's reclaim of entries idle 30 s takes nothing.
        await store.client.xclaim(
            store.queue_key, GROUP, "runner-1", 0, [entry.entry_id], idle=60_000, justid=True
        )
        kept_from = lossy.num_keeps
        await eventually(lambda: keeping.done() or lossy.num_keeps >= kept_from + 2)
        assert not keeping.done()
        assert await store.reclaim("runner-2", 30_000, 1) == []
        keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeping
    finally:
        await store.client.aclose()


async def test_a_runner_whose_chunks_all_wait_stops_at_sigterm_within_its_grace(
    fabric: Fabric,
) -> None:
    """SIGTERM while every chunk slot waits on a held call: the runner stops claiming, gives
    the chunk its grace (1 s), cancels it (its entry stays pending for another runner) and
    exits 0. Before, it noticed the stop only once a chunk ended: here, when the held call
    timed out, a minute later."""
    fabric.target.hold_after_runs = 0
    runner = start_runner(
        fabric.tmp_path, fabric.redis, fabric.target_address, "runner-1",
        "--max-in-flight-chunks", "1", "--call-timeout-s", "60", "--claim-timeout-s", "90",
        "--drain-grace-s", "1",
    )  # fmt: skip
    fabric.runners.append(runner)
    await fabric.submit(texts_of(4))
    try:
        await eventually(lambda: fabric.target.num_held >= 1, timeout_s=30.0)
        runner.process.send_signal(signal.SIGTERM)
        # Far past the grace, far short of the held call's timeout.
        code = await asyncio.to_thread(runner.process.wait, 20.0)
    finally:
        fabric.target.release()
    assert code == 0


async def test_an_item_that_crashes_the_model_fails_alone(fabric: Fabric) -> None:
    """A poison item whose call fails INTERNAL (retryable: a crash may be the worker's, not
    the item's) fails its chunk's retries; then the chunk is run item by item, and only the
    poison item fails (before, every item of its chunk was failed with it)."""
    texts = texts_of(16)
    texts[5] = f"{POISON} 5"
    fabric.target.poison_crashes = True
    fabric.start_runner("runner-1")
    job = await fabric.finished(await fabric.submit(texts))
    assert (job.num_ok, job.num_failed) == (15, 1)
    failed = [r for r in await fabric.results(job.job_id) if r.status == jobs.ITEM_STATUS_FAILED]
    assert [(r.index, r.code) for r in failed] == [(5, "INTERNAL")]


async def test_a_chunk_whose_answer_is_past_the_message_limit_is_run_item_by_item(
    fabric: Fabric,
) -> None:
    """64 items whose answers together are past a 4 MiB answer limit (grpc fails the call
    RESOURCE_EXHAUSTED, "message larger than max", as it does an answer past the runner's
    receive limit), each alone within it, and one whose answer alone is past it: the chunk is
    run item by item at once, every other item served, the huge one failed with grpc's words.
    Before, a too-large answer was taken for the fleet's pressure: the chunk was retried and
    left for later rounds (30 minutes of the fleet's patience), then every item failed."""
    texts = [f"{WIDE} {i}" for i in range(64)]
    texts[9] = f"{HUGE} 9"
    target = PredictTarget()
    server, address = await start_target(target, max_answer_bytes=4 * 1024 * 1024)
    try:
        fabric.runners.append(start_runner(fabric.tmp_path, fabric.redis, address, "runner-1"))
        job = await fabric.finished(await fabric.submit(texts))
    finally:
        await server.stop(None)
    assert (job.num_ok, job.num_failed) == (63, 1)
    results = await fabric.results(job.job_id)
    failed = [r for r in results if r.status == jobs.ITEM_STATUS_FAILED]
    assert [(r.index, r.code) for r in failed] == [(9, "RESOURCE_EXHAUSTED")]
    assert "larger than max" in failed[0].message
    assert target.runs[texts[0]] == 1  # run alone once, not retried
    ok = [r for r in results if r.index != 9]
    for result in ok:
        np.testing.assert_array_equal(
            tensor_from_pb(result.output), expected_output(texts[result.index])
        )


async def test_cancel_stops_new_items_and_keeps_finished_results(fabric: Fabric) -> None:
    # Caught mid-job: some items done, the chunks in flight held at the target until the
    # cancel is in.
    fabric.target.hold_after_runs = 100
    fabric.start_runner("runner-1")
    texts = texts_of(400)
    job_id = await fabric.submit(texts)

    async def some_done_and_some_held() -> bool:
        return fabric.target.num_held > 0 and (await fabric.job(job_id)).num_ok > 0

    await eventually(some_done_and_some_held, timeout_s=30.0, interval_s=0.02)
    cancelled = await fabric.jobs.CancelJob(jobs.CancelJobRequest(job_id=job_id), metadata=AS_A)
    fabric.target.release()
    assert cancelled.state == jobs.JOB_STATE_CANCELLED
    job = await fabric.finished(job_id)
    assert job.state == jobs.JOB_STATE_CANCELLED
    assert 0 < job.num_ok < 400 and job.num_ok + job.num_cancelled == 400
    # Only the chunks already running at the cancel finish (4 in flight, 8 items each).
    assert job.num_ok <= cancelled.num_ok + 4 * 8
    results = await fabric.results(job_id)
    assert [r.index for r in results] == list(range(400))
    cancelled_items = [r for r in results if r.status == jobs.ITEM_STATUS_CANCELLED]
    assert len(cancelled_items) == job.num_cancelled
    assert all(r.code == "CANCELLED" for r in cancelled_items)


async def test_a_job_cancelled_before_it_ran_has_its_items_cancelled_unread(
    fabric: Fabric,
) -> None:
    """A job cancelled while queued: the runner that then takes its chunks records every item
    cancelled without reading one (no LRANGE of its items reaches Redis), where it read each
    chunk's items (64 MiB for the largest job) only to record them cancelled."""
    texts = texts_of(200)
    job_id = await fabric.submit(texts)
    cancelled = await fabric.jobs.CancelJob(jobs.CancelJobRequest(job_id=job_id), metadata=AS_A)
    assert cancelled.state == jobs.JOB_STATE_CANCELLED
    admin = aioredis.from_url(fabric.redis.url)
    try:
        await admin.config_resetstat()
        fabric.start_runner("runner-1")
        job = await fabric.finished(job_id)
        stats = await admin.info("commandstats")
    finally:
        await admin.aclose()
    assert (job.num_cancelled, job.num_ok) == (200, 0)
    assert "cmdstat_lrange" not in stats, stats.get("cmdstat_lrange")
    assert fabric.target.num_calls == 0


async def test_a_cancel_that_loses_the_race_to_the_last_result_changes_nothing(
    fabric: Fabric,
) -> None:
    """CancelJob reads the job's state, then marks it: the last result may be recorded between
    the two. The mark is the store's (the gateway's second step, taken here after the job
    finished): before, it set `cancelled` whatever the counts, and a job whose every item
    succeeded read CANCELLED for good; on a job gone, it left a hash that never expired."""
    fabric.start_runner("runner-1")
    job_id = await fabric.submit(texts_of(5))
    assert (await fabric.finished(job_id)).state == jobs.JOB_STATE_SUCCEEDED
    assert not await fabric.store.cancel(job_id)
    assert (await fabric.job(job_id)).state == jobs.JOB_STATE_SUCCEEDED
    gone = "0" * 32
    assert not await fabric.store.cancel(gone)
    assert not await fabric.store.client.exists(fabric.store.job_key(gone))
    # A runner's first mark of a job that ended and expired meanwhile brought it back as a
    # hash of `started_s` alone, which never expired (jobs review).
    await fabric.store.mark_started(gone)
    assert not await fabric.store.client.exists(fabric.store.job_key(gone))


async def test_results_past_the_end_a_deadline_passed_and_a_long_idempotency_key_are_refused(
    fabric: Fabric,
) -> None:
    """Before, a `start_index` past the job's items streamed nothing, as if none had finished,
    and a negative `complete_by_unix_s` meant no deadline (review finding). The index just past
    the last item (a reader that has every result) still streams nothing, OK."""
    job_id = await fabric.submit(texts_of(3))
    assert await fabric.results(job_id, start_index=3) == []
    with pytest.raises(grpc.aio.AioRpcError) as past:
        await fabric.results(job_id, start_index=4)
    assert past.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "[0, 3]" in (past.value.details() or "")
    for when in (-1.0, math.inf, math.nan, 1.0, time.time() - 1.0):
        request = jobs.SubmitJobRequest(
            model_name="minilm", items=text_items(["a"]), complete_by_unix_s=when
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fabric.jobs.SubmitJob(request, metadata=AS_A)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, when
    # An idempotency key names a Redis key and field: its length is bounded.
    request = jobs.SubmitJobRequest(
        model_name="minilm", items=text_items(["a"]), idempotency_key="k" * 257
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await fabric.jobs.SubmitJob(request, metadata=AS_A)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 256" in (refused.value.details() or "")
    assert await fabric.job_ids() == [job_id]
    deadline_s = time.time() + 2.0  # room for the first send on a loaded machine
    soon = jobs.SubmitJobRequest(
        model_name="minilm", items=text_items(["a"]), complete_by_unix_s=deadline_s,
        idempotency_key="k" * 256,
    )  # fmt: skip
    first = await fabric.jobs.SubmitJob(soon, metadata=AS_A)
    await asyncio.sleep(max(0.0, deadline_s - time.time()) + 0.05)
    # Its answer lost, the client sends it again once the deadline has passed: it gets its job.
    again = await fabric.jobs.SubmitJob(soon, metadata=AS_A)
    assert (again.job_id, again.is_existing) == (first.job_id, True)


async def test_another_tenants_job_is_not_found(fabric: Fabric) -> None:
    job_id = await fabric.submit(texts_of(3))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await fabric.jobs.GetJob(jobs.GetJobRequest(job_id=job_id), metadata=AS_B)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    # An id naming one of the job's other keys is no job either (it was UNAVAILABLE: Redis's
    # WRONGTYPE, which also told that the job exists).
    for crafted in (f"{job_id}:items", f"{job_id}:results", "x" * 32):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fabric.jobs.GetJob(jobs.GetJobRequest(job_id=crafted), metadata=AS_A)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND, crafted
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await fabric.jobs.SubmitJob(jobs.SubmitJobRequest(model_name="minilm"), metadata=AS_A)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # An item with no payload: refused at submit, where each was run, failed and run alone.
    hollow = jobs.SubmitJobRequest(
        model_name="minilm", items=[*text_items(["a"]), api.PredictInput()]
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await fabric.jobs.SubmitJob(hollow, metadata=AS_A)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "item 1 has no payload" in (refused.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await fabric.submit(texts_of(1), metadata=())
    assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED]
)
async def test_runner_refused_by_the_gateway_fails_no_item(
    fabric: Fabric, code: grpc.StatusCode
) -> None:
    """The runner's key, not the items, is at fault: unknown, or its tenant not granted a
    job's priority or model (the submitter's rights were checked at submit). Before, a
    PERMISSION_DENIED failed every item of every such job (review finding)."""
    fabric.target.num_unauthenticated = 1
    fabric.target.runner_refused_code = code
    runner = fabric.start_runner("runner-1")
    texts = texts_of(8)
    job_id = await fabric.submit(texts)
    job = await fabric.finished(job_id)  # after the claim timeout, the chunk runs again
    assert job.state == jobs.JOB_STATE_SUCCEEDED
    assert_all_ok_in_order(await fabric.results(job_id), texts)
    # Counted (an alert reads it: every job waits while the key is refused), from 0.
    metrics = scrape(runner.metrics_port)
    left = {reason: total(metrics, names.JOBS_CHUNKS_LEFT_TOTAL, reason=reason)
            for reason in ("runner_refused", "fleet_unavailable", "store_unreachable")}  # fmt: skip
    assert left == {"runner_refused": 1, "fleet_unavailable": 0, "store_unreachable": 0}


async def test_a_chunk_refused_whatever_its_items_is_not_split(fabric: Fabric) -> None:
    """NOT_FOUND (the model gone) fails every item alike: before, the chunk was run again as
    one call per item (1 + 8 calls here), and each failed the same way (review finding)."""
    fabric.target.refuse_all = grpc.StatusCode.NOT_FOUND
    fabric.start_runner("runner-1")
    job = await fabric.finished(await fabric.submit(texts_of(8)))
    assert (job.state, job.num_failed) == (jobs.JOB_STATE_FAILED, 8)
    assert fabric.target.num_calls == 1


async def test_no_item_of_a_split_chunk_starts_after_its_job_is_cancelled(
    fabric: Fabric,
) -> None:
    """The job is cancelled while its chunk's call is out; the call then fails for its poison
    item (INVALID_ARGUMENT, not retried: split at once). The split ran each item alone with
    the job as read before the cancel, so the 7 good items started after it, and were
    recorded OK. The job is read again before the split: they are cancelled, none runs."""
    texts = texts_of(8)
    texts[2] = f"{POISON} 2"
    fabric.target.poison_waits_for_release = True
    fabric.start_runner("runner-1")
    job_id = await fabric.submit(texts)
    await eventually(lambda: fabric.target.num_calls >= 1, timeout_s=30.0)
    cancelled = await fabric.jobs.CancelJob(jobs.CancelJobRequest(job_id=job_id), metadata=AS_A)
    assert cancelled.state == jobs.JOB_STATE_CANCELLED
    fabric.target.release()
    job = await fabric.finished(job_id)
    assert (job.num_ok, job.num_cancelled) == (0, 8), job
    assert fabric.target.runs.total() == 0 and fabric.target.num_calls == 1


async def test_a_split_chunk_left_for_the_fleet_keeps_what_its_items_finished(
    fabric: Fabric,
) -> None:
    """A chunk split to find its poison item, one of whose items the fleet cannot serve: the
    chunk is left for a later round, and its items that finished alone are recorded first, so
    that its rerun skips them. Before, they were dropped and run again every round."""
    texts = texts_of(8)
    texts[2], texts[6] = f"{POISON} 2", f"{UNSERVED} 6"
    fabric.target.poison_crashes = True  # retryable, then split
    fabric.target.failing_waits_for_runs = 6  # the unserved item fails once the 6 have run
    fabric.start_runner("runner-1")
    job_id = await fabric.submit(texts)

    async def second_round() -> bool:
        stored = await fabric.store.client.hgetall(fabric.store.job_key(job_id))
        return int(stored.get(b"rounds:0", 0)) >= 2

    await eventually(second_round, timeout_s=60.0, interval_s=0.2)
    job = await fabric.job(job_id)
    # The poison item fails once its retries run out, unless the fleet's gave the chunk up
    # first (its call is then stopped, and runs again in the next round).
    assert (job.num_ok, job.state) == (6, jobs.JOB_STATE_RUNNING)
    ok = [t for i, t in enumerate(texts) if i not in (2, 6)]
    assert [fabric.target.runs[t] for t in ok] == [1] * 6


async def test_a_split_chunk_its_runner_fails_on_keeps_what_its_items_finished(
    fabric: Fabric,
) -> None:
    """As above, but the chunk fails in its runner: one item's answer comes back one output
    short (an answer it cannot read). Before, only a chunk left for the fleet kept what its
    items finished; this one dropped it, reran it every round, and after its 3 rounds failed
    every item without a result INTERNAL, those that had succeeded included (review finding)."""
    texts = texts_of(8)
    texts[2], texts[6] = f"{POISON} 2", f"{GARBLED} 6"
    fabric.target.poison_crashes = True
    fabric.target.failing_waits_for_runs = 6
    fabric.start_runner("runner-1")
    job = await fabric.finished(await fabric.submit(texts), timeout_s=90.0)
    assert (job.num_ok, job.num_failed) == (6, 2)
    ok = [t for i, t in enumerate(texts) if i not in (2, 6)]
    assert [fabric.target.runs[t] for t in ok] == [1] * 6


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED],
)
async def test_a_fleet_down_longer_than_the_retries_fails_no_item(
    fabric: Fabric, code: grpc.StatusCode
) -> None:
    # UNAVAILABLE through more than one chunk's 3 attempts (a worker restarting, say),
    # CANCELLED (a gateway dropping calls unseen), or DEADLINE_EXCEEDED (batch rows waiting
    # behind online traffic past the call's deadline): not the items' fault. The chunk waits a
    # round (the 3 s claim timeout) and runs once the fleet is back; with the old rules its 8
    # items failed with the status (CANCELLED: split into single calls first; DEADLINE_EXCEEDED
    # until this review's finding).
    fabric.target.num_unavailable = 5
    fabric.target.unavailable_code = code
    runner = fabric.start_runner("runner-1")
    texts = texts_of(8)
    job_id = await fabric.submit(texts)
    job = await fabric.finished(job_id)
    assert (job.state, job.num_failed) == (jobs.JOB_STATE_SUCCEEDED, 0)
    # The round the chunk was left for the fleet recorded nothing: no chunk duration of it
    # (it was observed, and an outage made chunks look fast when nothing was recorded). The
    # recorded round's is observed once its record's reply is back, which may be a moment
    # after the job read finished.
    chunk_count = f"{names.JOBS_CHUNK_SECONDS}_count"
    await eventually(
        lambda: total(scrape(runner.metrics_port), chunk_count) >= 1,
        message="the recorded chunk's duration observed",
    )
    metrics = scrape(runner.metrics_port)
    assert total(metrics, chunk_count) == 1
    assert total(metrics, names.JOBS_CHUNKS_LEFT_TOTAL, reason="fleet_unavailable") >= 1
    assert fabric.target.num_unavailable == 0 and fabric.target.num_calls >= 6
    assert_all_ok_in_order(await fabric.results(job_id), texts)
    stored = await fabric.store.client.hgetall(fabric.store.job_key(job_id))
    assert int(stored[b"rounds:0"]) >= 1
    assert 0 < time.time() - float(stored[b"fleet_since:0"]) < 120  # the first round's time


async def test_a_streamed_job_is_bounded_by_max_items_not_by_one_message(fabric: Fabric) -> None:
    texts = texts_of(100_000)
    stream = streamed(texts, items_per_message=4_000)
    job_id = (await fabric.jobs.SubmitJobStream(stream, metadata=AS_A, timeout=60.0)).job_id
    job = await fabric.job(job_id)
    assert (job.num_items, job.state, job.model_name) == (100_000, jobs.JOB_STATE_QUEUED, "minilm")
    cancelled = await fabric.jobs.CancelJob(jobs.CancelJobRequest(job_id=job_id), metadata=AS_A)
    assert cancelled.state == jobs.JOB_STATE_CANCELLED
    # Inline, the same 100,000 short texts (about 2 MB) fit in one message and max_items.
    inline = jobs.SubmitJobRequest(model_name="minilm", items=text_items(texts))
    inline_id = (await fabric.jobs.SubmitJob(inline, metadata=AS_A, timeout=60.0)).job_id
    assert (await fabric.job(inline_id)).num_items == 100_000
    await fabric.jobs.CancelJob(jobs.CancelJobRequest(job_id=inline_id), metadata=AS_A)
    # One more item is refused either way. Streamed, as soon as the count passes the limit:
    # this stream never ends, so an answer means the gateway stopped reading it.
    inline.items.append(text_items(["one too many"])[0])
    with pytest.raises(grpc.aio.AioRpcError) as too_many_inline:
        await fabric.jobs.SubmitJob(inline, metadata=AS_A, timeout=60.0)
    assert too_many_inline.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    async def past_the_limit_then_open() -> AsyncIterator[jobs.SubmitJobRequest]:
        async for message in streamed(texts_of(104_000), items_per_message=4_000):
            yield message
        await asyncio.Event().wait()
        yield jobs.SubmitJobRequest()  # never reached

    with pytest.raises(grpc.aio.AioRpcError) as too_many_streamed:
        await fabric.jobs.SubmitJobStream(past_the_limit_then_open(), metadata=AS_A, timeout=60.0)
    assert too_many_streamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "100000" in (too_many_streamed.value.details() or "")
    assert await fabric.job_ids() == [inline_id, job_id]


async def test_a_streamed_job_is_bounded_by_its_bytes(fabric: Fabric) -> None:
    """Before, only by its count: 100,000 items of up to 4 MiB each could be held by the
    gateway while they arrived, then in Redis for the retention (review finding). Refused as
    soon as the bytes pass the limit (here MAX_JOB_BYTES; 64 MiB by default): this stream
    never ends, so an answer means the gateway stopped reading it; nothing is persisted."""
    megabytes = ["x" * 1_000_000] * 3

    async def past_the_bytes_then_open() -> AsyncIterator[jobs.SubmitJobRequest]:
        yield jobs.SubmitJobRequest(model_name="minilm", items=text_items(megabytes))
        for _ in range(3):  # 12 MB in all
            yield jobs.SubmitJobRequest(items=text_items(megabytes))
        await asyncio.Event().wait()
        yield jobs.SubmitJobRequest()  # never reached

    with pytest.raises(grpc.aio.AioRpcError) as too_big:
        await fabric.jobs.SubmitJobStream(past_the_bytes_then_open(), metadata=AS_A, timeout=60.0)
    assert too_big.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{MAX_JOB_BYTES} bytes" in (too_big.value.details() or "")
    assert await fabric.job_ids() == []


async def test_a_job_the_full_store_refuses_is_resource_exhausted_with_a_hint(
    fabric: Fabric,
) -> None:
    """Past three quarters of Redis's `maxmemory` (as deployed, with nothing evicted) new
    jobs are refused, RESOURCE_EXHAUSTED with a retry hint (before, UNAVAILABLE, which clients
    resend at once), and nothing of them is kept; the jobs accepted before still finish: their
    results have the room they reserved (before, Redis at its cap refused their results too,
    and jobs that never finished never expired; review findings)."""
    admin = aioredis.Redis.from_url(fabric.redis.url)
    kept = await fabric.submit(texts_of(3), key="once")
    try:
        used = int((await admin.info("memory"))["used_memory"])
        await admin.config_set("maxmemory", str(int(used * 1.28)))  # used: 78% of it
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await fabric.submit(["y"] * 10)
        # A resend of the kept job (its answer lost) still gets its id, however full.
        assert await fabric.submit(texts_of(3), key="once") == kept
        fabric.start_runner("runner-1")
        finished = await fabric.finished(kept)
    finally:
        await admin.config_set("maxmemory", "0")
        await admin.aclose()
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "job store is full" in (full.value.details() or "")
    hints = dict(full.value.trailing_metadata() or ())
    assert float(hints[RETRY_AFTER_MS_KEY]) > 0
    assert finished.state == jobs.JOB_STATE_SUCCEEDED
    assert await fabric.job_ids() == [kept]


async def test_a_job_reserves_its_results_room_until_it_ends(fabric: Fabric) -> None:
    """Counted by their items alone (a few bytes each), jobs accepted back to back filled
    Redis with their results (1.5 KB an item for minilm): a result Redis refused at its cap
    was run again and again, and its job never ended (review finding). A job now reserves
    what its results are expected to take, until its every item has one: a second job that
    would pass the room with the first's reservation is refused; once the first ends its
    reservation is given back."""
    admin = aioredis.Redis.from_url(fabric.redis.url)
    per_item = 384 * 4 + RESULT_OVERHEAD_BYTES  # minilm's [384] FP32 a row
    try:
        try:
            used = int((await admin.info("memory"))["used_memory"])
            room = used + int(1.5 * 200 * per_item)  # one job of 200 items, not two
            await admin.config_set("maxmemory", str(int(room / SUBMIT_MEMORY_SHARE) + 1))
            first = await fabric.submit(texts_of(200))
            assert int(await admin.get(fabric.store.reserved_key)) == 200 * per_item
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await fabric.submit(texts_of(200))
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "reserved" in (full.value.details() or "")
            # A job that alone would pass the room is told so, not to retry.
            with pytest.raises(grpc.aio.AioRpcError) as too_large:
                await fabric.submit(texts_of(2_000))
            assert too_large.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "submit fewer items" in (too_large.value.details() or "")
        finally:
            await admin.config_set("maxmemory", "0")
        # Each result written gives its share back (in Redis's memory then), the rest at the end.
        record = await fabric.store.get(first)
        assert record is not None
        await fabric.store.record(record, [item_result(i, ItemStatus.OK, 1) for i in range(50)])
        assert int(await admin.get(fabric.store.reserved_key)) == 150 * per_item
        fabric.start_runner("runner-1")
        assert (await fabric.finished(first)).state == jobs.JOB_STATE_SUCCEEDED
        assert int(await admin.get(fabric.store.reserved_key)) == 0
        assert await admin.hget(fabric.store.job_key(first), "reserved") == b"0"
        assert await fabric.job_ids() == [first]
    finally:
        await admin.aclose()


async def test_a_runner_holds_the_results_redis_refuses_at_its_cap_and_runs_nothing_twice(
    fabric: Fabric,
) -> None:
    """At Redis's memory cap every write of results is refused. The runner left such a chunk
    for a later round: taken again after the claim timeout (3 s here), its calls ran again,
    every round, for results refused alike (review finding). It now holds the results, the
    entry kept claimed, and records them once Redis has room: each text runs once. A cancel at
    the cap is RESOURCE_EXHAUSTED with a retry hint (Redis 6 wraps the OOM of a script's
    write in its own error: UNAVAILABLE before)."""
    fabric.target.hold_after_runs = 0
    runner = fabric.start_runner("runner-1")
    texts = texts_of(4)
    job_id = await fabric.submit(texts)
    await eventually(lambda: fabric.target.num_held >= 1, timeout_s=30.0)
    admin = aioredis.Redis.from_url(fabric.redis.url)

    def held() -> float:
        return total(scrape(runner.metrics_port), names.JOBS_CHUNKS_HELD_FOR_ROOM)

    try:
        await admin.config_set("maxmemory", "1")  # past it: every write refused
        try:
            fabric.target.release()
            await eventually(lambda: held() == 1, timeout_s=30.0)
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await fabric.jobs.CancelJob(jobs.CancelJobRequest(job_id=job_id), metadata=AS_A)
            await asyncio.sleep(5.0)  # past the claim timeout and the runner's reclaims
        finally:
            await admin.config_set("maxmemory", "0")
        job = await fabric.finished(job_id)
    finally:
        await admin.aclose()
    assert job.num_ok == 4
    assert [fabric.target.runs[t] for t in texts] == [1] * 4
    assert held() == 0
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "job store is full" in (full.value.details() or "")
    assert float(dict(full.value.trailing_metadata() or ())[RETRY_AFTER_MS_KEY]) > 0


async def test_jobs_submitted_at_once_on_several_gateways_cannot_pass_the_room_together(
    redis_server: RedisServer,
) -> None:
    """Each gateway looked at the room before its job's items were written and reserved its
    results later: jobs submitted at the same moment on several gateways, with room for the
    results of one, were all taken, and together passed the room (review finding). The
    enqueue script now decides and reserves in one step: one of four is taken, the other
    three are refused StoreFull and leave nothing behind."""
    admin = aioredis.Redis.from_url(redis_server.url)
    stores = [JobStore(aioredis.Redis.from_url(redis_server.url)) for _ in range(4)]
    result_bytes = 2_000_000
    job = NewJob("a", "minilm", "", "batch", [b"x" * 10] * 10, "", 0.0, result_bytes=result_bytes)
    try:
        for store in stores:  # connected first: a connection's buffers count in used_memory
            await store.client.ping()
        used = int((await admin.info("memory"))["used_memory"])
        room = used + 3_000_000  # one job's expected results, not two
        await admin.config_set("maxmemory", str(int(room / SUBMIT_MEMORY_SHARE) + 1))
        try:
            outcomes = await asyncio.gather(
                *(store.submit(job, chunk_size=5) for store in stores), return_exceptions=True
            )
        finally:
            await admin.config_set("maxmemory", "0")
        taken = [o for o in outcomes if isinstance(o, tuple)]
        assert len(taken) == 1, outcomes
        assert [type(o) for o in outcomes if o not in taken] == [StoreFull] * 3
        assert "reserved" in str(next(o for o in outcomes if o not in taken))
        job_id, _ = taken[0]
        assert int(await admin.get(stores[0].reserved_key)) == result_bytes
        assert await admin.xlen(stores[0].queue_key) == 2  # the taken job's two chunks
        key = stores[0].job_key(job_id)
        kept = sorted([k async for k in admin.scan_iter(match=stores[0].job_key("*"))])
        assert kept == sorted([key.encode(), f"{key}:items".encode()])
    finally:
        for store in stores:
            await store.client.aclose()
        await admin.aclose()


async def test_a_stream_that_changes_its_header_or_has_no_items_persists_nothing(
    fabric: Fabric,
) -> None:
    kept = await fabric.submit(texts_of(3))

    async def model_changed() -> AsyncIterator[jobs.SubmitJobRequest]:
        yield jobs.SubmitJobRequest(model_name="minilm", items=text_items(["a", "b"]))
        yield jobs.SubmitJobRequest(model_name="tiny-llama", items=text_items(["c"]))

    async def nothing() -> AsyncIterator[jobs.SubmitJobRequest]:
        return
        yield  # an async generator with no message

    async def header_only() -> AsyncIterator[jobs.SubmitJobRequest]:
        yield jobs.SubmitJobRequest(model_name="minilm")
        yield jobs.SubmitJobRequest()

    for stream, words in (
        (model_changed(), "model_name differs"),
        (nothing(), "no message"),
        (header_only(), "1 to 100000 items"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fabric.jobs.SubmitJobStream(stream, metadata=AS_A, timeout=10.0)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (refused.value.details() or "")
    assert await fabric.job_ids() == [kept]

    # A later message may repeat the first one's fields; items keep the order they were sent.
    async def repeated_header() -> AsyncIterator[jobs.SubmitJobRequest]:
        yield jobs.SubmitJobRequest(model_name="minilm", items=text_items(["a"]))
        yield jobs.SubmitJobRequest(model_name="minilm", items=text_items(["b", "c"]))

    response = await fabric.jobs.SubmitJobStream(repeated_header(), metadata=AS_A, timeout=10.0)
    fabric.start_runner("runner-1")
    await fabric.finished(response.job_id)
    assert_all_ok_in_order(await fabric.results(response.job_id), ["a", "b", "c"])


async def test_list_jobs_pages_newest_first_each_job_once(fabric: Fabric) -> None:
    """Pages of three over seven jobs, with two more submitted after the first page: each of
    the seven once, newest first (the newer two are before the first page's place). Before,
    a page token was a position, and the two new jobs pushed two of the first page's jobs
    into the second."""
    submitted = [await fabric.submit(texts_of(1)) for _ in range(7)]
    pages: list[list[str]] = []
    token = ""
    while True:
        request = jobs.ListJobsRequest(page_size=3, page_token=token)
        page = await fabric.jobs.ListJobs(request, metadata=AS_A)
        pages.append([j.job_id for j in page.jobs])
        token = page.next_page_token
        if len(pages) == 1:
            newer = [await fabric.submit(texts_of(1)) for _ in range(2)]
        if not token:
            break
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [i for p in pages for i in p] == submitted[::-1]
    first = await fabric.jobs.ListJobs(jobs.ListJobsRequest(page_size=2), metadata=AS_A)
    assert [j.job_id for j in first.jobs] == newer[::-1]
    with pytest.raises(grpc.aio.AioRpcError) as bad_token:
        await fabric.jobs.ListJobs(jobs.ListJobsRequest(page_token="not-a-token"), metadata=AS_A)
    assert bad_token.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_command_line_submits_a_file_and_writes_its_results_in_order(
    fabric: Fabric,
) -> None:
    """`python -m services.client job submit | status | results` against the JobService: the
    file goes up in several streamed messages, the results come back one line per input."""
    texts = texts_of(12)
    source = fabric.tmp_path / "texts.jsonl"
    # Both input forms: a JSON string, or an object with "text".
    lines = [json.dumps(t) if i % 2 else json.dumps({"text": t}) for i, t in enumerate(texts)]
    source.write_text("\n".join(lines) + "\n")
    fabric.start_runner("runner-1")
    stdout, stderr = await fabric.cli("job", "submit", str(source), "--items-per-message", "5")
    job_id = stdout.strip()
    assert await fabric.job_ids() == [job_id]
    assert "12/12 succeeded" in stderr  # the progress bar's last state
    status, _ = await fabric.cli("job", "status", job_id)
    shown = json.loads(status)
    assert (shown["state"], shown["num_items"], shown["num_ok"]) == ("succeeded", 12, 12)
    out = fabric.tmp_path / "results.jsonl"
    await fabric.cli("job", "results", job_id, "--out", str(out))
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in results] == list(range(12))
    assert all(r["status"] == "ok" for r in results)
    for result, text in zip(results, texts, strict=True):
        np.testing.assert_array_equal(np.array(result["embedding"], "<f4"), expected_output(text))
    # A job with nothing finished yet: the file is emptied, not left with the other's results.
    fabric.target.hold_after_runs = 0  # the runner's calls wait: no result is written
    waiting = await fabric.submit(texts_of(3))
    await fabric.cli("job", "results", waiting, "--out", str(out), "--no-wait")
    assert out.read_text() == ""


async def test_a_submission_whose_enqueue_reply_is_lost_is_answered_with_its_job(
    redis_server: RedisServer,
) -> None:
    """The enqueue script ran but its reply was lost (a timeout, a dropped connection): the
    job is enqueued, and the submission answers with it, where it failed UNAVAILABLE, "safe to
    retry", and a client resending without an idempotency key ran every item twice (review
    finding). Lost before the script ran, the submission still fails."""
    client = aioredis.Redis.from_url(redis_server.url)
    store = JobStore(client)
    enqueue = store._enqueue

    async def reply_lost(**kwargs: Any) -> Any:
        await enqueue(**kwargs)
        raise redis.exceptions.TimeoutError("Timeout reading from socket")

    async def never_ran(**kwargs: Any) -> Any:
        raise redis.exceptions.ConnectionError("Connection reset by peer")

    def new_job() -> NewJob:
        return NewJob("a", "minilm", "", "batch", [b"x", b"y"], "", 0.0)

    try:
        store._enqueue = reply_lost
        job_id, is_existing = await store.submit(new_job(), chunk_size=1)
        assert not is_existing
        record = await store.get(job_id)
        assert record is not None and record.num_items == 2
        assert await client.xlen(store.queue_key) == 2  # its chunks, enqueued once
        store._enqueue = never_ran
        with pytest.raises(redis.exceptions.ConnectionError):
            await store.submit(new_job(), chunk_size=1)
        assert await client.xlen(store.queue_key) == 2
    finally:
        await client.aclose()


async def test_a_store_whose_acl_predates_reservations_still_takes_jobs(
    redis_server: RedisServer,
) -> None:
    """Redis reads its ACL at start: until an upgrade's is loaded, INCRBY is refused. The
    enqueue then reserves nothing, and the job is taken, where the script failed and every
    submission was UNAVAILABLE until the ACL was loaded."""
    admin = aioredis.Redis.from_url(redis_server.url)
    before = [c for c in JOB_COMMANDS if c not in ("incrby", "decrby", "zscore")]
    allowed = [f"+{command}" for command in ("ping", *before)]
    await admin.execute_command(
        "ACL", "SETUSER", "old", "on", ">pw", "resetkeys", "~fabric:*", "-@all", *allowed
    )
    client = aioredis.Redis.from_url(f"redis://old:pw@127.0.0.1:{redis_server.port}/0")
    store = JobStore(client)
    try:
        job = NewJob("a", "minilm", "", "batch", [b"x", b"y"], "", 0.0, result_bytes=3_200)
        job_id, _ = await store.submit(job, chunk_size=1)
        assert await admin.xlen(store.queue_key) == 2
        assert await admin.hget(store.job_key(job_id), "reserved") is None
        assert await admin.get(store.reserved_key) is None
    finally:
        await client.aclose()
        await admin.aclose()
