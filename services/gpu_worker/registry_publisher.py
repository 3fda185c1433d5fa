"""The worker's side of the registry: its entry (what it serves, how loaded it is, whether it
drains), published by a heartbeat task in Redis (services.common.registry_schema), never on the
request path. Scored by Redis's own clock (`TIME`), so worker and router clocks never need to
agree."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError

from services.common.backoff import doubled_s
from services.common.lifecycle import cancel_and_wait, stop_if_cancelled
from services.common.redis_acl import WORKER, role_credentials
from services.common.registry_schema import (
    ACL_BEHIND,
    FailedVersion,
    RegistryKeys,
    WorkerRecord,
    connect,
)
from services.common.sparse_log import SparseLog
from services.common.wakeup import Wakeup
from services.gpu_worker.batching.driver import BatchingDriver
from services.gpu_worker.config import HeartbeatConfig, WorkerConfig
from services.gpu_worker.loaded_models import LoadedModels

log = logging.getLogger(__name__)
#: A Redis ACL older than this release: said hourly while it lasts.
_hourly = SparseLog(log, period_s=3600.0)

# Score = Redis server time in ms, taken inside the script so the write is one atomic step.
# Members that have not beaten for ARGV[4] ms go: workers that died without deregistering
# (killed, their node lost), whose record keys expired long ago. A pcall: under a Redis that
# still runs an older ACL (not reloaded since an upgrade), the heartbeat itself must not fail.
_PUBLISH = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZADD', KEYS[1], ms, ARGV[1])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.pcall('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (ms - tonumber(ARGV[4])))
return ms
"""
#: How long a worker that stopped beating stays a member of the registry's sorted set.
FORGET_AFTER_S = 600.0


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
        #: What this publisher writes as the registry's epoch when it finds none (RegistryKeys).
        self._epoch = secrets.token_hex(8)
        self._wake = Wakeup()
        self.is_connected = False

    async def publish_once(self) -> None:
        record = self._record()
        await self._script(
            keys=[self._keys.workers, self._keys.worker(record.worker_id)],
            args=[
                record.worker_id,
                record.to_json(),
                int(self._config.ttl_s * 1000),
                int(FORGET_AFTER_S * 1000),
            ],
        )
        # Apart, after the beat: under a Redis still on an older ACL (not reloaded since an
        # upgrade) the epoch's key is refused, and in the script it failed the whole beat
        # (diff review). Without it, a Redis that loses the registry unseen is not told.
        try:
            await self._client.set(self._keys.epoch, self._epoch, nx=True)
        except NoPermissionError as error:
            _hourly.warning(ACL_BEHIND, f"heartbeat: {ACL_BEHIND}: {error}")

    def publish_soon(self) -> None:
        """Publish now rather than at the next period (e.g. when draining starts)."""
        self._wake.set()

    async def run(self) -> None:
        failures = 0
        while True:
            stop_if_cancelled()  # a round, or the wait below, may have swallowed a stop
            # Before the publish, not after: a change told while it is in flight (its record
            # may be older) is published at once, not a period later.
            self._wake.clear()
            try:
                await self.publish_once()
                if not self.is_connected:
                    log.info("heartbeat: registered in Redis")
                self.is_connected, failures = True, 0
            except Exception as error:  # Redis away, or anything else: a heartbeat that
                stop_if_cancelled()  # stopped would take the worker out of routing for good
                if self.is_connected or failures == 0:
                    is_redis = isinstance(error, RedisError | OSError)
                    log.warning(
                        "heartbeat: %s (%s); retrying with backoff",
                        "Redis unreachable" if is_redis else "publish failed",
                        error,
                        exc_info=not is_redis,
                    )
                self.is_connected = False
                failures += 1
            if failures == 1:
                # Once at once: a restarted Redis closed every pooled connection, and only the
                # first command on each fails; waiting a period would leave the registry empty
                # for two.
                continue
            config = self._config
            await self._wake.wait(doubled_s(config.period_s, failures - 2, config.max_backoff_s))

    async def deregister(self, worker_id: str) -> None:
        try:
            await self._client.zrem(self._keys.workers, worker_id)
            await self._client.delete(self._keys.worker(worker_id))
        except (RedisError, OSError) as error:
            log.warning("could not deregister %s (%s); its entry will go stale", worker_id, error)


class RegistryPublisher:
    def __init__(
        self,
        config: WorkerConfig,
        address: str,
        models: LoadedModels,
        batching: BatchingDriver,
    ) -> None:
        assert config.redis_url is not None
        self._worker_id = config.worker_id
        self._address = address
        self._models = models
        self._batching = batching
        self._is_draining = False
        self._started_at_ms = int(time.time() * 1000)
        credentials = role_credentials(WORKER, config.redis_url, config.redis_password_file)
        self._client = connect(config.redis_url, credentials=credentials)
        self._publisher = HeartbeatPublisher(
            self._client, RegistryKeys(config.registry_prefix), config.heartbeat, self.record
        )
        self._task: asyncio.Task[None] | None = None

    def record(self) -> WorkerRecord:
        is_ready = not self._is_draining
        applied = self._models.applied_revisions
        models = tuple(
            replace(
                m.model_record(is_ready=is_ready, batching=self._batching),
                revision=applied.get(m.config.name, 0),
            )
            for m in self._models.all
        )
        return WorkerRecord(
            worker_id=self._worker_id,
            address=self._address,
            is_draining=self._is_draining,
            sent_at_ms=int(time.time() * 1000),
            models=models,
            failed=tuple(
                FailedVersion(f.model, f.version, f.error, f.revision) for f in self._models.failed
            ),
            started_at_ms=self._started_at_ms,
        )

    @property
    def client(self) -> aioredis.Redis:
        """The worker role's Redis client (the repository follower reads through it too)."""
        return self._client

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._publisher.run(), name="heartbeat")

    def publish_soon(self) -> None:
        """Publish now, not at the next period (the served set changed)."""
        self._publisher.publish_soon()

    def mark_draining(self) -> None:
        """Routers stop choosing this worker at their next registry refresh."""
        self._is_draining = True
        self._publisher.publish_soon()

    async def close(self) -> None:
        # Ended before the record is deleted: a write of its still in flight would bring the
        # record back.
        await cancel_and_wait(self._task, "the heartbeat")
        await self._publisher.deregister(self._worker_id)
        await self._client.aclose()
