"""The worker's heartbeat (HeartbeatPublisher) against a real redis-server, as the worker's
Redis user."""

from __future__ import annotations

import asyncio

import pytest

from services.common.registry_schema import RegistryKeys, WorkerRecord, connect
from services.gpu_worker.config import HeartbeatConfig
from services.gpu_worker.registry_publisher import HeartbeatPublisher
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

RECORD = WorkerRecord(
    worker_id="w0", address="127.0.0.1:8201", is_draining=False, sent_at_ms=0, models=()
)
#: Long: a publish that waited for the period would not come within the test's patience.
PERIOD_S = 60.0


async def test_a_change_told_while_a_heartbeat_is_in_flight_is_published_at_once(
    redis_server: RedisServer,
) -> None:
    """`publish_soon` (a version unloaded, draining begun) while a heartbeat is in flight,
    after its record was built: the next heartbeat, with the change, goes at once. Before,
    the wake-up was cleared after the publish, and the change waited a whole period."""
    client = connect(redis_server.worker_url)
    publisher: HeartbeatPublisher | None = None
    num_built = 0

    def record() -> WorkerRecord:
        nonlocal num_built
        num_built += 1
        if num_built == 1 and publisher is not None:
            publisher.publish_soon()  # the change, just after this record was built
        return RECORD

    config = HeartbeatConfig(period_s=PERIOD_S, ttl_s=2 * PERIOD_S, max_backoff_s=PERIOD_S)
    publisher = HeartbeatPublisher(client, RegistryKeys(), config, record)
    task = asyncio.create_task(publisher.run())
    try:
        await eventually(lambda: num_built >= 2, timeout_s=PERIOD_S / 4, message="published again")
        assert publisher.is_connected
    finally:
        task.cancel()
        await client.aclose()
