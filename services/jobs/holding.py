"""How a runner holds a chunk it runs: its queue entry kept claimed while its calls run,
however long their retries take, and its results kept while Redis, at its memory cap, refuses
them (services/jobs/runner.py)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from prometheus_client import Gauge
from redis.exceptions import RedisError

from services.common.job_records import QueueEntry
from services.common.job_room import is_out_of_memory
from services.common.job_store import JobStore
from services.common.lifecycle import stop_if_cancelled

log = logging.getLogger(__name__)

#: What a keep allows Redis's clock to have run slower than this process's since the last
#: (NTP slews a clock by 0.05% at most; a takeover needs a whole claim timeout of idleness).
KEEP_SLACK_MS = 50
#: Mean pause before a chunk's results, refused by Redis at its memory cap, are tried again.
STORE_FULL_RETRY_S = 2.0


async def keep_claimed(
    store: JobStore, consumer: str, entry: QueueEntry, claim_timeout_s: float
) -> None:
    """Keeps `entry` `consumer`'s while its chunk runs: its idle time restarts every third of
    the claim timeout, so another runner's reclaim (of entries idle past it: their runner
    died) leaves it alone. Once it could not keep it for a whole claim timeout (Redis away,
    this process paused), another runner may have taken it over: it stops, rather than take
    it back. Each keep claims the entry only if it has been idle since the last (Redis's
    clock runs on between the two as this one does, less KEEP_SLACK_MS): a keep that reached
    Redis just after another runner took the entry over took it back, and both ran the
    chunk (review finding); such a keep now finds it taken, and stops."""
    kept_s = time.monotonic()  # after the entry was claimed or kept: its idle time is longer
    while True:
        await asyncio.sleep(claim_timeout_s / 3)
        idle_s = time.monotonic() - kept_s
        if idle_s > claim_timeout_s:
            log.warning("chunk %s not kept claimed for %.0fs", entry.entry_id, claim_timeout_s)
            return
        try:
            if not await store.keep(consumer, entry, int(idle_s * 1000) - KEEP_SLACK_MS):
                log.warning("chunk %s no longer this runner's (taken over)", entry.entry_id)
                return
            kept_s = time.monotonic()
        except (RedisError, OSError) as error:  # the next try, or the reclaim, decides
            stop_if_cancelled()
            log.warning("could not keep chunk %s claimed: %s", entry.entry_id, error)


async def record_when_room(
    record: Callable[[], Awaitable[object]], entry: QueueEntry, held: Gauge, rng: random.Random
) -> None:
    """Records the outcomes of `entry`'s chunk, its calls run (`record`). While Redis, at its
    memory cap, refuses them, holds them (counted in `held`) and tries again every
    STORE_FULL_RETRY_S or so, the entry kept claimed meanwhile: left for a later round, the
    chunk's calls ran again every claim timeout for results refused alike (review finding).
    A chunk held so keeps its runner's slot: a runner takes no more chunks than it holds.
    Any other failure is raised."""
    is_held = False
    try:
        while True:
            try:
                await record()
                return
            except RedisError as error:
                if not is_out_of_memory(error):
                    raise
                if not is_held:
                    log.warning(
                        "chunk %s of job %s: results held, Redis at its memory cap refuses "
                        "them: %s", entry.entry_id, entry.job_id, error,
                    )  # fmt: skip
                    held.inc()
                    is_held = True
            await asyncio.sleep(STORE_FULL_RETRY_S * (0.5 + rng.random()))
    finally:
        if is_held:
            held.dec()
