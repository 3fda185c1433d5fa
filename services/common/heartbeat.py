"""Publishing and reading worker heartbeats in Redis (see services.common.registry).

Both sides use Redis's own clock (`TIME`), so worker and router clocks never need to agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.registry import RegistryKeys, WorkerRecord

log = logging.getLogger(__name__)

# Score = Redis server time in ms, taken inside the script so the write is one atomic step.
_PUBLISH = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZADD', KEYS[1], ms, ARGV[1])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return ms
"""


def connect(url: str, *, timeout_s: float = 0.5) -> aioredis.Redis:
    """A client whose calls fail fast: a slow or dead Redis must never stall the event loop."""
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
    )


@dataclass(frozen=True)
class HeartbeatConfig:
    period_s: float = 1.0
    #: TTL of the record key (a safety net; routers judge liveness by the zset score).
    ttl_s: float = 3.0
    #: Longest pause between attempts while Redis is unreachable.
    max_backoff_s: float = 5.0


class HeartbeatPublisher:
    """Writes `record()` every period until stopped; never raises on Redis errors."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RegistryKeys,
        config: HeartbeatConfig,
        record: Callable[[], WorkerRecord],
    ) -> None:
        self._client = client
        self._keys = keys
        self._config = config
        self._record = record
        self._script = client.register_script(_PUBLISH)
        self._wake = asyncio.Event()
        self.is_connected = False

    async def publish_once(self) -> None:
        record = self._record()
        await self._script(
            keys=[self._keys.workers, self._keys.worker(record.worker_id)],
            args=[record.worker_id, record.to_json(), int(self._config.ttl_s * 1000)],
        )

    def publish_soon(self) -> None:
        """Publish now rather than at the next period (e.g. when draining starts)."""
        self._wake.set()

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                await self.publish_once()
                if not self.is_connected:
                    log.info("heartbeat: registered in Redis")
                self.is_connected, failures = True, 0
            except (RedisError, OSError) as error:
                if self.is_connected or failures == 0:
                    log.warning("heartbeat: Redis unreachable (%s); retrying with backoff", error)
                self.is_connected = False
                failures += 1
            period_s = self._config.period_s
            delay_s = period_s * 2 ** max(0, failures - 1) if failures else period_s
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(self._config.max_backoff_s, delay_s))

    async def deregister(self, worker_id: str) -> None:
        try:
            await self._client.zrem(self._keys.workers, worker_id)
            await self._client.delete(self._keys.worker(worker_id))
        except (RedisError, OSError) as error:
            log.warning("could not deregister %s (%s); its entry will go stale", worker_id, error)


async def read_registry(
    client: aioredis.Redis, keys: RegistryKeys
) -> tuple[list[tuple[WorkerRecord, float]], float]:
    """Every registered worker with its heartbeat time, and Redis's `now`, both in seconds.

    Two round trips (ids+scores+time, then records), once per refresh period: never per request.
    """
    async with client.pipeline(transaction=False) as pipe:
        pipe.zrange(keys.workers, 0, -1, withscores=True)
        pipe.time()
        members, (seconds, micros) = await pipe.execute()
    now_s = seconds + micros / 1e6
    if not members:
        return [], now_s
    ids = [m.decode() if isinstance(m, bytes) else m for m, _ in members]
    raw_records = await client.mget([keys.worker(i) for i in ids])
    records = []
    for (_, score_ms), raw in zip(members, raw_records, strict=True):
        if raw is None:
            continue  # record key expired: the worker stopped long ago
        try:
            records.append((WorkerRecord.from_json(raw), score_ms / 1000.0))
        except (ValueError, KeyError, TypeError) as error:
            log.warning("skipping malformed registry record: %s", error)
    return records, now_s
