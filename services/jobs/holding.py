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

#: Under an ACL of before the keep's script (JobStore.keep): what a keep allows Redis's clock
#: to have run slower than this process's since the last (NTP slews a clock by 0.05% at most).
KEEP_SLACK_MS = 50
#: Mean pause before a chunk's results, refused by Redis at its memory cap, are tried again.
STORE_FULL_RETRY_S = 2.0


async def keep_claimed(
    store: JobStore, consumer: str, entry: QueueEntry, claim_timeout_s: float
) -> None:
    """Keeps `entry` `consumer`'s while its chunk runs: its idle time restarts every third of
    the claim timeout, so another runner's reclaim (of entries idle past it: their runner
    died) leaves it alone. A keep restarts it only while the entry is still this runner's
    (JobStore.keep): once another runner took it over (this one away from Redis, or paused,
    for a claim timeout), it stops, rather than take it back; a keep that failed (Redis away,
    a reply lost) is tried again at the next third. Before, a keep claimed the entry only if
    it had been idle since the last keep this runner saw succeed: a keep whose reply was lost
    had restarted it, the next found it idle too short and stopped, and another runner ran
    the chunk beside this one (review finding). That is still how a keep works, and fails,
    while Redis runs an ACL of before the keep's script (until ACL LOAD)."""
    kept_s = time.monotonic()  # after the entry was claimed or kept: its idle time is longer
    while True:
        await asyncio.sleep(claim_timeout_s / 3)
        # What an ACL of before the keep's script is kept by (JobStore.keep).
        min_idle_ms = int((time.monotonic() - kept_s) * 1000) - KEEP_SLACK_MS
        is_taken_over = False
        try:
            if await store.keep(consumer, entry, min_idle_ms):
                kept_s = time.monotonic()
            else:
                is_taken_over = True
        except (RedisError, OSError) as error:  # the next try, or the reclaim, decides
            log.warning("could not keep chunk %s claimed: %s", entry.entry_id, error)
        # The chunk ended as a keep ran, and redis-py swallowed the cancel: stop all the same.
        stop_if_cancelled()
        if is_taken_over:
            log.warning("chunk %s no longer this runner's (taken over)", entry.entry_id)
            return


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
