"""Durable batch jobs in Redis: the key schema and every read and write of it, for the gateway's
JobService (submit, read, cancel) and the job runners (claim, record, acknowledge).

Keys (`<p>` is the fabric's key prefix, "fabric" by default; Redis user `jobs` and the
gateway's may touch `<p>:job:*` and `<p>:jobs:*` only):

- `<p>:jobs:queue`: the work queue, a stream read by consumer group `runners`. One entry per
  chunk of a job: {job, start, end} (item indices, end exclusive).
- `<p>:job:<id>`: hash, the job: tenant, model, version, priority, num_items, created_s,
  started_s, complete_by_s, idempotency_key, cancelled, the counters num_ok, num_failed,
  num_cancelled, `rounds:<start>`: rounds the chunk from item <start> waited for the fleet,
  `fleet_since:<start>`: when the first of them was (seconds since the epoch), and
  `crashes:<start>`: rounds it failed in a runner with an unexpected error, `reserved`: the
  bytes its results not yet written are expected to take (`reserve_each` a result; 0 once
  its every item has a result).
- `<p>:job:<id>:items`: list, item i is the i-th serialized `PredictInput`.
- `<p>:job:<id>:results`: hash, item index -> serialized `JobItemResult`. Written with HSETNX
  together with its counter (one script): a result, once written, is never overwritten, and
  each item is counted once, however many times a retry or a reclaimed entry re-runs it.
- `<p>:jobs:tenant:<tenant>`: sorted set, job ids by creation time (ListJobs).
- `<p>:jobs:idem:<tenant>:<key>`: string, the job id an idempotency key named first; the
  tenant percent-encoded (`:` as `%3A`, `%` as `%25`), so that no two tenants' keys meet.
- `<p>:jobs:dead`: stream of dead letters {job, index, code, message}, capped, for operators.
- `<p>:jobs:reserved`: integer, the `reserved` bytes of every job not ended (a runner older
  than reservations never gives one back: README, durable jobs). A new job is taken only while
  what Redis holds, these and its own items and expected results stay within
  SUBMIT_MEMORY_SHARE of `maxmemory`: counting items alone, jobs accepted back to back filled
  Redis with their results, and a job whose results Redis refused never ended (nor expired).

Submission is two steps: the items and the job hash are written (with a one-hour expiry, in one
MULTI), then one script checks the room, claims the idempotency key, reserves, lifts the expiry
and enqueues every chunk. A crash between them leaves only expiring garbage; the script is
atomic, so a job is either enqueued whole under its key or not at all; the loser of a race on a
key deletes its own copy and answers with the winner's id. Durability across a Redis crash is
the AOF's (README "Durable batch jobs").

A job is kept `retention_s` (7 days by default) from the moment its every item has a result:
then its hash, items, results and idempotency key expire together (a ListJobs that finds one
gone takes it out of its tenant's list), and the idempotency key may name a new job.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.credentials import CredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.job_policy import ItemStatus, chunk_ends, chunk_ranges
from services.common.job_records import (
    ItemOutcome,
    JobCursor,
    JobRecord,
    NewJob,
    QueueEntry,
)
from services.common.job_room import SUBMIT_MEMORY_SHARE, StoreFull, check_room, is_out_of_memory
from services.common.job_scripts import (
    CANCEL,
    COUNT_ROUND,
    ENQUEUE,
    FLEET_ROUND,
    FORGET_CONSUMERS,
    KEEP,
    MARK_STARTED,
    RECORD,
)

log = logging.getLogger(__name__)

#: Consumer group of the job runners on the queue stream.
GROUP = "runners"
#: Unacknowledged submissions (items written, script not run) vanish after this.
ORPHAN_TTL_S = 3600
#: How long a finished job (its record, items, results and idempotency key) is kept, seconds.
RETENTION_S = 7 * 24 * 3600
#: Most jobs of one tenant sharing one creation time (to the microsecond) that a page of
#: ListJobs steps over correctly.
MAX_TIED_JOBS = 64


#: Dead-letter stream length kept (approximately).
MAX_DEAD_LETTERS = 100_000


class JobLost(RedisError):
    """A job's record, written a moment before, was gone from Redis when its chunks were to
    be enqueued (evicted, or lost with a restart): nothing of it was enqueued or reserved, and
    its idempotency key names nothing; submitted again, it is a new job (UNAVAILABLE)."""


def connect_jobs_redis(
    url: str, *, timeout_s: float, credentials: CredentialProvider | None = None
) -> aioredis.Redis:
    """A client for the job keys. `timeout_s` bounds every call (a submission of 100,000
    items is a few MB, so it is larger than the registry's). A connection idle for a second is
    pinged before use, so the first call after a Redis restart reconnects instead of failing;
    commands are never retried (a retried submission could run twice)."""
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False,
        health_check_interval=1, credential_provider=credentials,
    )  # fmt: skip


class JobStore:
    """Reads and writes of the job keys; one per process, over one Redis client."""

    def __init__(
        self, client: aioredis.Redis, *, prefix: str = "fabric", retention_s: float = RETENTION_S
    ) -> None:
        """`retention_s`: how long a job is kept once its every item has a result (recorded
        here); 0 keeps it for good."""
        # Any: redis-py's stubs type replies as bytes | str unions; this client never decodes
        # (decode_responses is off), so every reply is bytes.
        self.client: Any = client
        self.prefix = prefix
        self.queue_key = f"{prefix}:jobs:queue"
        self.dead_key = f"{prefix}:jobs:dead"
        #: Bytes the results of the jobs not ended are expected to add (their reservations).
        self.reserved_key = f"{prefix}:jobs:reserved"
        self.retention_s = retention_s
        self._enqueue = client.register_script(ENQUEUE)
        self._record = client.register_script(RECORD)
        self._count_round = client.register_script(COUNT_ROUND)
        self._cancel = client.register_script(CANCEL)
        self._fleet_round = client.register_script(FLEET_ROUND)
        self._forget_consumers = client.register_script(FORGET_CONSUMERS)
        self._keep = client.register_script(KEEP)
        self._mark_started = client.register_script(MARK_STARTED)
        #: Where the next `reclaim` scans the runners' pending entries from (XAUTOCLAIM's cursor).
        self._reclaim_from: bytes | str = "0-0"

    def job_key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def _tenant_key(self, tenant: str) -> str:
        return f"{self.prefix}:jobs:tenant:{tenant}"

    async def submit(
        self, job: NewJob, *, chunk_size: int, max_chunk_bytes: int = 2**62
    ) -> tuple[str, bool]:
        """Persists `job` and enqueues its chunks (`chunk_size` items and `max_chunk_bytes`
        bytes at most each, job_policy.chunk_ends); returns (job id, is_existing): with an
        idempotency key already used by this tenant, the existing job's id and True. Raises
        StoreFull while Redis holds more than SUBMIT_MEMORY_SHARE of its `maxmemory`: looked
        at before the items are written, and decided with the reservation in the enqueue
        script, so that jobs submitted at once on several gateways cannot pass it together."""
        idem_key = self.idempotency_key(job.tenant, job.idempotency_key)
        if (existing := await self.job_of_key(job.tenant, job.idempotency_key)) is not None:
            return existing, True  # a resend: its job exists, however full the store
        num_bytes = sum(map(len, job.items)) + job.result_bytes
        await check_room(self.client, self.reserved_key, num_bytes)  # a first look
        job_id = uuid.uuid4().hex
        key = self.job_key(job_id)
        created_s = time.time()
        meta: dict[str, str | int | float] = {
            "tenant": job.tenant, "model": job.model_name, "version": job.model_version,
            "priority": job.priority, "num_items": len(job.items), "created_s": created_s,
            "complete_by_s": job.complete_by_s, "idempotency_key": job.idempotency_key,
            "cancelled": 0, "num_ok": 0, "num_failed": 0, "num_cancelled": 0,
        }  # fmt: skip
        async with self.client.pipeline(transaction=True) as pipe:
            for start, end in chunk_ranges(len(job.items), 10_000):
                pipe.rpush(f"{key}:items", *job.items[start:end])
            pipe.hset(key, mapping=meta)
            pipe.expire(key, ORPHAN_TTL_S)
            pipe.expire(f"{key}:items", ORPHAN_TTL_S)
            await pipe.execute()
        keys = [key, f"{key}:items", idem_key, self.queue_key, self._tenant_key(job.tenant),
                self.reserved_key]  # fmt: skip
        has_key = "1" if job.idempotency_key else "0"
        ends = chunk_ends([len(item) for item in job.items], chunk_size, max_chunk_bytes)
        args: list[str | int | float] = [
            job_id, created_s, has_key, job.result_bytes, SUBMIT_MEMORY_SHARE, *ends
        ]  # fmt: skip
        try:
            reply = await self._enqueue(keys=keys, args=args)
        except (RedisTimeoutError, RedisConnectionError):
            # Its reply lost, the script may have run: a job it enqueued is answered, not
            # refused UNAVAILABLE (resent without an idempotency key, it would run twice).
            if await self.client.zscore(self._tenant_key(job.tenant), job_id) is None:
                raise
            return job_id, False
        if reply == 0:  # its hash gone before it was enqueued: the script wrote nothing
            await self.client.delete(key, f"{key}:items")
            raise JobLost(job_id)
        if isinstance(reply, list):  # no room: refused by the script, which reserved nothing
            await self.client.delete(key, f"{key}:items")
            used, reserved, room = map(int, reply)
            raise StoreFull(used, reserved, job.result_bytes, room)
        if (winner := reply.decode()) != job_id:
            await self.client.delete(key, f"{key}:items")
            return winner, True
        return job_id, False

    async def job_of_key(self, tenant: str, key: str) -> str | None:
        """The job `tenant`'s idempotency key `key` names (None: none, or no key)."""
        existing = await self.client.get(self.idempotency_key(tenant, key)) if key else None
        return None if existing is None else existing.decode()

    def idempotency_key(self, tenant: str, key: str) -> str:
        """The Redis key of `tenant`'s idempotency key `key`. The tenant percent-encoded:
        tenant "a:b" with key "c" and tenant "a" with key "b:c" must not share one. A tenant
        without ":" or "%" keeps the key it had before."""
        encoded = tenant.replace("%", "%25").replace(":", "%3A")
        return f"{self.prefix}:jobs:idem:{encoded}:{key}"

    async def get(self, job_id: str) -> JobRecord | None:
        return (await self.get_many([job_id]))[0]

    async def get_many(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        """The records of `job_ids` (None: gone), in one round trip (a page of ListJobs)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self.job_key(job_id))
            raws = await pipe.execute()
        return [
            JobRecord.from_hash(job_id, raw) if raw and b"num_items" in raw else None
            for job_id, raw in zip(job_ids, raws, strict=True)
        ]

    async def list_ids(
        self, tenant: str, *, after: JobCursor | None, limit: int
    ) -> list[tuple[str, JobCursor]]:
        """Up to `limit` of the tenant's job ids, newest first, strictly after `after` (None:
        from the newest), each with its cursor: a position that jobs submitted meanwhile do not
        move, so no page repeats or skips one."""
        key = self._tenant_key(tenant)
        if after is None:
            top, ties = "+inf", 0
        else:
            top, ties = repr(after.created_s), MAX_TIED_JOBS
        found = await self.client.zrange(
            key, top, "-inf", desc=True, byscore=True, offset=0, num=limit + ties, withscores=True
        )
        ids = []
        for member, score in found:
            job_id = member.decode()
            # Members of one score come in reverse order of their bytes.
            if after is None or score < after.created_s or job_id < after.job_id:
                ids.append((job_id, JobCursor(score, job_id)))
        return ids[:limit]

    async def cancel(self, job_id: str) -> bool:
        """Marks the job cancelled unless every item finished (or it is gone); True if so."""
        return int(await self._cancel(keys=[self.job_key(job_id)])) == 1

    async def results(self, job_id: str, start: int, count: int) -> list[bytes | None]:
        """Stored results of items [start, start+count): None where not finished yet."""
        fields = [str(i) for i in range(start, start + count)]
        return list(await self.client.hmget(f"{self.job_key(job_id)}:results", fields))

    async def items(self, job_id: str, start: int, end: int) -> list[bytes]:
        return list(await self.client.lrange(f"{self.job_key(job_id)}:items", start, end - 1))

    async def count_round(self, job_id: str, start: int, kind: str = "rounds") -> int:
        """Counts one more round the chunk from item `start` spent waiting for the fleet
        (`kind` "rounds"), or failed in its runner ("crashes"): a field of the job's hash, so
        it outlives runners and goes with the job. Returns the rounds so far; -1 if the job is
        gone."""
        keys = [self.job_key(job_id)]
        return int(await self._count_round(keys=keys, args=[f"{kind}:{start}"]))

    async def fleet_round(self, job_id: str, start: int, now_s: float) -> tuple[int, float]:
        """Counts one more round the fleet could not serve the chunk from item `start` in
        (`rounds:<start>`, as `count_round`); returns the rounds so far and how long ago the
        first was (`fleet_since:<start>`); (-1, 0) if the job is gone. Timed by Redis's clock;
        by `now_s` (seconds since the epoch) only under an ACL without TIME."""
        keys = [self.job_key(job_id)]
        args = [f"rounds:{start}", f"fleet_since:{start}", repr(now_s)]
        rounds, waited_s = await self._fleet_round(keys=keys, args=args)
        return int(rounds), float(waited_s)

    async def mark_started(self, job_id: str) -> None:
        """The job's start time, once, unless it is gone (job_scripts.MARK_STARTED)."""
        await self._mark_started(keys=[self.job_key(job_id)], args=[repr(time.time())])

    async def ensure_group(self) -> None:
        """Creates the runners' group (and the stream) unless they exist."""
        try:
            await self.client.xgroup_create(self.queue_key, GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as error:
            # At its memory cap Redis refuses the create before it would say the group exists:
            # a runner that took that for Redis away reclaimed no abandoned chunk until there
            # was room (reclaiming is no write). A group missing then fails the reclaim instead.
            if "BUSYGROUP" not in str(error) and not is_out_of_memory(error):
                raise

    async def read_new(self, consumer: str, count: int, block_ms: int) -> list[QueueEntry]:
        """Up to `count` entries no runner has claimed, waiting up to `block_ms` for one."""
        reply = await self.client.xreadgroup(
            GROUP, consumer, {self.queue_key: ">"}, count=count, block=block_ms
        )
        return [_entry(i, f) for _, entries in reply or () for i, f in entries if f]

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int) -> list[QueueEntry]:
        """Up to `count` entries another runner claimed and left idle for `min_idle_ms` (it
        died, or is stuck): now this consumer's. Each call scans on from where the last one
        stopped, back at the start once past the end: Redis 7 scans at most 10 x `count`
        pending entries a call, and from the start every time it never got past older ones
        kept running (or left for a later round by a fleet away), however long a dead
        runner's newer entries had waited."""
        reply = await self.client.xautoclaim(
            self.queue_key, GROUP, consumer, min_idle_ms, start_id=self._reclaim_from, count=count
        )
        self._reclaim_from = reply[0]
        return [_entry(i, f) for i, f in reply[1] if f]

    async def forget_consumers(self, keep: str, min_idle_ms: int) -> int:
        """Deletes the runners' consumers (but `keep`) idle `min_idle_ms` or more with no
        entry pending (FORGET_CONSUMERS); returns how many."""
        return int(await self._forget_consumers(keys=[self.queue_key],
                                                args=[GROUP, keep, min_idle_ms]))  # fmt: skip

    async def keep(self, consumer: str, entry: QueueEntry, min_idle_ms: int) -> bool:
        """Restarts the idle time of `consumer`'s `entry`, still running, so that no other
        runner's `reclaim` takes it, while it is still `consumer`'s (KEEP): one another runner
        took over stays theirs. Returns whether it was kept (False: taken over, or no longer
        pending). Where Redis still runs an ACL of before KEEP (README: ACL LOAD on upgrades),
        the entry is kept if it has been idle `min_idle_ms` (the time since this consumer last
        kept it), as before."""
        args: list[str | int] = [GROUP, consumer, entry.entry_id, max(0, min_idle_ms)]
        return bool(await self._keep(keys=[self.queue_key], args=args))

    async def record(
        self, job: JobRecord, outcomes: Sequence[ItemOutcome], *, ack: QueueEntry | None = None
    ) -> list[ItemOutcome]:
        """Writes the results not already written and counts them, dead-letters the failed ones
        among them ({job, index, code, message} on `<p>:jobs:dead`), and acknowledges `ack`
        (None: nothing), in one atomic step; returns the outcomes written (of a job gone,
        none). A result
        already written (a rerun of a reclaimed chunk) changes nothing and is not dead-lettered
        twice. Once every item of the job has its result, the job expires after
        `retention_s`."""
        job_id = job.job_id
        key = self.job_key(job_id)
        ack_id = ack.entry_id if ack is not None else ""
        ttl_s = math.ceil(self.retention_s) if self.retention_s > 0 else 0
        args: list[Any] = [GROUP, ack_id, job_id, MAX_DEAD_LETTERS, ttl_s, self.job_key("")]
        for outcome in outcomes:
            dead = outcome.status is ItemStatus.FAILED
            args += [outcome.index, outcome.payload, f"num_{outcome.status.value}",
                     outcome.code if dead else "", outcome.message if dead else ""]  # fmt: skip
        keys = [key, f"{key}:results", self.queue_key, self.dead_key, f"{key}:items",
                self._tenant_key(job.tenant), self.reserved_key]  # fmt: skip
        if job.idempotency_key:
            keys.append(self.idempotency_key(job.tenant, job.idempotency_key))
        written = await self._record(keys=keys, args=args)
        return [outcomes[int(position)] for position in written]

    async def forget(self, tenant: str, job_ids: Sequence[str]) -> None:
        """Takes jobs that expired out of `tenant`'s list."""
        await self.client.zrem(self._tenant_key(tenant), *job_ids)

    async def drop(self, entry: QueueEntry) -> None:
        """Acknowledges and deletes an entry whose job no longer exists, in one step: one
        acknowledged but left in the stream (a connection lost between the two) would never
        be read or claimed again, yet counted queued, and its age would grow for good."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(self.queue_key, GROUP, entry.entry_id)
            pipe.xdel(self.queue_key, entry.entry_id)
            await pipe.execute()

    async def backlog(self) -> tuple[int, int, float]:
        """(entries never claimed, entries claimed and unacknowledged, age in seconds of the
        oldest entry still in the queue; 0 when empty)."""
        # Acknowledged entries are deleted, so the stream holds exactly the entries not yet
        # claimed plus the pending ones (XINFO's `lag` would need Redis 7).
        groups = await self.client.xinfo_groups(self.queue_key)
        group = next((g for g in groups if g["name"] in (GROUP, GROUP.encode())), None)
        pending = int(group["pending"]) if group else 0
        queued = max(0, int(await self.client.xlen(self.queue_key)) - pending)
        async with self.client.pipeline(transaction=False) as pipe:  # ids hold Redis's clock
            oldest, now = await pipe.xrange(self.queue_key, count=1).time().execute(False)
        if isinstance(oldest, Exception):
            raise oldest
        now_s = time.time() if isinstance(now, Exception) else now[0] + now[1] / 1e6
        age_s = 0.0
        if oldest:
            created_ms = int(oldest[0][0].decode().split("-")[0])
            age_s = max(0.0, now_s - created_ms / 1000)
        return queued, pending, age_s


def _entry(entry_id: bytes, fields: dict[bytes, bytes]) -> QueueEntry:
    return QueueEntry(
        entry_id=entry_id.decode(),
        job_id=fields[b"job"].decode(),
        start=int(fields[b"start"]),
        end=int(fields[b"end"]),
    )
