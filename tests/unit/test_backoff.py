"""Doubling pauses (services.common.backoff) and the heartbeat loop that retries with them for
the worker's whole life."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from services.common.backoff import doubled_s
from services.common.registry_schema import RegistryKeys, WorkerRecord
from services.gpu_worker.config import HeartbeatConfig
from services.gpu_worker.registry_publisher import HeartbeatPublisher

pytestmark = pytest.mark.unit


def test_pauses_double_up_to_their_cap_however_many_failures_came() -> None:
    assert [doubled_s(0.5, n, 3.0) for n in (-2, 0, 1, 2, 3)] == [0.5, 0.5, 1.0, 2.0, 3.0]
    # 2.0 ** 1024 overflows a float: a loop counting an hour's failures died of it.
    assert doubled_s(1.0, 5000, 5.0) == 5.0


async def test_the_heartbeat_keeps_retrying_past_a_thousand_failures() -> None:
    """Each attempt fails (its record cannot be built: a failure like Redis's, counted and
    backed off from); past 1,026 failures the pause once overflowed, and the loop ended for
    good: a worker whose Redis was away for an hour and a half never registered again."""
    attempts = 0

    def record() -> WorkerRecord:
        nonlocal attempts
        attempts += 1
        raise RuntimeError("no record")

    client = aioredis.Redis()  # never used: no record is ever built to send
    config = HeartbeatConfig(period_s=1e-5, ttl_s=1.0, max_backoff_s=1e-5)
    publisher = HeartbeatPublisher(client, RegistryKeys(), config, record)
    task = asyncio.create_task(publisher.run())
    try:
        while attempts < 1_100 and not task.done():
            await asyncio.sleep(0.01)
        assert not task.done(), task.exception()
        assert not publisher.is_connected
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.aclose()


@pytest.mark.parametrize(("period_s", "ttl_s"), [(5.0, 3.0), (1.0, 1.0), (1e-4, 4e-4)])
def test_a_heartbeat_record_that_would_expire_between_beats_is_refused(
    period_s: float, ttl_s: float
) -> None:
    """A TTL at or under the period leaves the worker out of routing for part of each period
    (routers skip a member whose record expired); one under 1 ms is `PX 0`, which Redis
    refuses at every heartbeat."""
    with pytest.raises(ValueError, match="must exceed its period"):
        HeartbeatConfig(period_s=period_s, ttl_s=ttl_s)
