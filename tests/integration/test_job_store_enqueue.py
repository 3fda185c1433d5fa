"""A job whose record is gone from Redis between being written and being enqueued (evicted
under a `volatile-*` policy, which picks exactly such keys with an expiry, or lost with a
restart) is refused with nothing written. Its enqueue script had failed half-way, and Redis
undoes no write of a failed script: the idempotency key named a job that never was, so every
resend was answered with it (GetJob: NOT_FOUND, for good), and its bytes stayed reserved,
shrinking every tenant's room (review finding). A real redis-server, the jobs role's ACL."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from services.common.job_records import NewJob
from services.common.job_store import JobLost, JobStore
from services.common.redis_acl import JOBS
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration


async def test_a_job_whose_record_vanished_before_its_enqueue_is_refused_with_nothing_written(
    redis_server: RedisServer,
) -> None:
    store = JobStore(aioredis.Redis.from_url(redis_server.role_url(JOBS)))
    admin = aioredis.Redis.from_url(redis_server.url)
    enqueue = store._enqueue

    async def after_an_eviction(*, keys: list[str], args: list[Any]) -> Any:
        await admin.delete(keys[0])  # the job's hash, evicted as its script is sent
        return await enqueue(keys=keys, args=args)

    job = NewJob("a", "minilm", "", "batch", [b"x", b"y"], "key-1", 0.0, result_bytes=4_000)
    try:
        store._enqueue = after_an_eviction  # type: ignore[method-assign]
        with pytest.raises(JobLost):
            await store.submit(job, chunk_size=2)
        assert await store.job_of_key("a", "key-1") is None
        assert int(await admin.get(store.reserved_key) or 0) == 0
        assert await admin.xlen(store.queue_key) == 0
        assert await admin.keys(f"{store.job_key('')}*") == []  # its items too

        store._enqueue = enqueue  # type: ignore[method-assign]
        job_id, is_existing = await store.submit(job, chunk_size=2)  # sent again: a new job
        assert not is_existing
        assert await store.job_of_key("a", "key-1") == job_id
        record = await store.get(job_id)
        assert record is not None and record.num_items == 2
        assert await admin.xlen(store.queue_key) == 1
    finally:
        await store.client.aclose()
        await admin.aclose()
