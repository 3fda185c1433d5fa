"""The router's registry sync (services.router.registry_reader.RegistrySync) against a real
Redis that goes away and comes back empty."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest

from services.common.lifecycle import sleep_unless_stopped
from services.common.registry_schema import RegistryKeys, WorkerRecord, connect
from services.gpu_worker.config import HeartbeatConfig
from services.gpu_worker.registry_publisher import HeartbeatPublisher
from services.router import registry_reader
from services.router.metrics import RouterMetrics
from services.router.registry_reader import RegistrySync
from services.router.routing import RouteTable
from services.router.routing_config import RoutingConfig
from services.router.worker_networks import DEFAULT_WORKER_NETWORKS, WorkerNetworks
from tests.support.records import model_record
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

KEYS = RegistryKeys()
RECORD = WorkerRecord(
    worker_id="w0", address="127.0.0.1:50051", is_draining=False, sent_at_ms=0, models=()
)


def new_sync(router: aioredis.Redis, table: RouteTable) -> RegistrySync:
    """A router's registry sync reading every 0.05 s through `router` into `table`."""

    async def degraded(_: bool) -> None:
        pass

    return RegistrySync(
        router,
        KEYS,
        table,
        RouterMetrics(CollectorRegistry()),
        period_s=0.05,
        on_degraded_change=degraded,
        worker_networks=WorkerNetworks.parse(DEFAULT_WORKER_NETWORKS),
    )


def two_workers(worker: aioredis.Redis) -> list[HeartbeatPublisher]:
    """A heartbeat publisher of workers w0 and w1 each, writing through `worker`."""
    records = [
        WorkerRecord(f"w{n}", f"127.0.0.1:5005{n}", is_draining=False, sent_at_ms=0, models=())
        for n in (0, 1)
    ]
    publishers = [
        HeartbeatPublisher(worker, KEYS, HeartbeatConfig(), lambda r=r: r) for r in records
    ]
    return publishers


async def heartbeats(publisher: HeartbeatPublisher) -> None:
    """`publisher`'s heartbeat every 0.2 s until cancelled."""
    while True:
        await publisher.publish_once()
        # Stops though redis-py swallowed the cancel (Python 3.11's wait_for): with a plain
        # sleep the loop could go on, and the test's end wait on it for good (a run on a
        # loaded machine hung until pytest's 300 s timeout, most likely there).
        await sleep_unless_stopped(0.2)


async def ended(tasks: Sequence[asyncio.Task[None]], clients: Sequence[aioredis.Redis]) -> None:
    """`tasks` cancelled and waited for, then `clients` closed."""
    for running in tasks:
        running.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients:
        await client.aclose()


@dataclass
class FreshFleet:
    """Workers w0 and w1 (their publishers, not beating) and a router's sync reading every
    0.05 s into a table whose heartbeats stay fresh 30 s: only a hold keeps a worker that no
    longer beats."""

    table: RouteTable
    admin: aioredis.Redis
    worker: aioredis.Redis
    router: aioredis.Redis
    sync: RegistrySync
    w0: HeartbeatPublisher
    w1: HeartbeatPublisher

    @classmethod
    def start(cls, redis_server: RedisServer) -> FreshFleet:
        table = RouteTable(RoutingConfig(stale_after_s=30.0), random.Random())
        admin, worker = connect(redis_server.url), connect(redis_server.worker_url)
        router = connect(redis_server.router_url)
        return cls(table, admin, worker, router, new_sync(router, table), *two_workers(worker))

    def live(self) -> set[str]:
        return {w.worker_id for w in self.table.live_workers(time.monotonic())}

    async def end(self, *tasks: asyncio.Task[None]) -> None:
        await ended(tasks, (self.admin, self.worker, self.router))


async def test_an_empty_registry_after_an_outage_is_taken_once_no_worker_returns_in_time(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarts empty and the worker never re-registers (its node was lost with it): the
    outage's snapshot is held for REFILL_S of empty reads, then the empty registry is taken.
    Before, it was held until the snapshot's maximum age (120 s), the dead worker routed to.
    A Redis that flaps counts REFILL_S from its last return: empty reads before an outage do
    not make the next return take the empty registry at once."""
    monkeypatch.setattr(registry_reader, "REFILL_S", 5.0)
    table = RouteTable(RoutingConfig(), random.Random())
    worker, router = connect(redis_server.worker_url), connect(redis_server.router_url)
    sync = new_sync(router, table)
    task = asyncio.create_task(sync.run())
    try:
        await HeartbeatPublisher(worker, KEYS, HeartbeatConfig(), lambda: RECORD).publish_once()
        await eventually(lambda: table.live_workers(time.monotonic()) == (RECORD,), timeout_s=10)
        for empty_reads_s in (2.0, None):  # it flaps: back for 2 s, gone again, back
            redis_server.kill()
            await eventually(lambda: sync.is_degraded, timeout_s=10)
            await asyncio.sleep(3.5)  # past REFILL_S since the first return, by the second
            redis_server.restart()  # empty; no heartbeat comes
            await eventually(lambda: not sync.is_degraded, timeout_s=10)
            # Held: REFILL_S counts from this return, not the first.
            assert table.live_workers(time.monotonic()) == (RECORD,)
            if empty_reads_s is not None:
                await asyncio.sleep(empty_reads_s)
        await eventually(lambda: table.live_workers(time.monotonic()) == (), timeout_s=20)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker.aclose()
        await router.aclose()


async def test_a_worker_gone_during_an_outage_is_held_once_however_often_redis_fails_again(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker w1 deregisters while the router cannot read Redis (its user refused ZRANGE,
    NOPERM: the data stays), so the first read after it holds w1 for REFILL_S, as a worker that
    has not re-registered yet. Redis then keeps failing every 1.5 s: w1 leaves when that first
    hold ends, not later. Before, each failure restarted the hold for every worker live at the
    next good read, w1 included, so w1 stayed routable for as long as the failures went on,
    while w0, which heartbeats, was served throughout."""
    monkeypatch.setattr(registry_reader, "REFILL_S", 3.0)
    table = RouteTable(RoutingConfig(), random.Random())
    admin, worker = connect(redis_server.url), connect(redis_server.worker_url)
    router = connect(redis_server.router_url)
    sync = new_sync(router, table)
    publishers = two_workers(worker)

    def live() -> set[str]:
        return {w.worker_id for w in table.live_workers(time.monotonic())}

    async def refused(seconds: float) -> None:  # reads fail for `seconds`, the data kept
        await admin.execute_command("ACL", "SETUSER", "router", "-zrange")
        await eventually(lambda: sync.is_degraded, timeout_s=10)
        await asyncio.sleep(seconds)
        await admin.execute_command("ACL", "SETUSER", "router", "+zrange")
        await eventually(lambda: not sync.is_degraded, timeout_s=10)

    task = asyncio.create_task(sync.run())
    beating = asyncio.create_task(heartbeats(publishers[0]))
    try:
        await publishers[1].publish_once()
        await eventually(lambda: live() == {"w0", "w1"}, timeout_s=10)
        await admin.execute_command("ACL", "SETUSER", "router", "-zrange")
        await eventually(lambda: sync.is_degraded, timeout_s=10)
        await publishers[1].deregister("w1")  # gone while the router cannot see it go
        await admin.execute_command("ACL", "SETUSER", "router", "+zrange")
        await eventually(lambda: not sync.is_degraded, timeout_s=10)
        held_since_s = time.monotonic()
        assert live() == {"w0", "w1"}  # held: it may only not have re-registered yet
        while time.monotonic() - held_since_s < 3 * registry_reader.REFILL_S:
            await refused(0.3)
            assert "w0" in live()
            await asyncio.sleep(1.2)
            if time.monotonic() - held_since_s > registry_reader.REFILL_S + 1.0:
                assert live() == {"w0"}, "w1 held past its first hold"
    finally:
        await ended((task, beating), (admin, worker, router))


async def test_workers_cut_off_with_the_router_are_held_until_they_return(
    redis_server: RedisServer,
) -> None:
    """Redis kept its data but no one could reach it for longer than the records' TTL (a
    partition): when it is back every worker is still registered, every record expired, and
    the workers return one by one over their backoff. The first back must not stand for the
    fleet: w1, not back yet, stays held. (A change that dropped registered workers whose
    record had expired, meant for workers that died while only the router was cut off, did
    exactly that: diff review.) Heartbeats stay fresh 30 s here: only the hold keeps it."""
    fleet = FreshFleet.start(redis_server)
    admin, sync, w0, w1, live = fleet.admin, fleet.sync, fleet.w0, fleet.w1, fleet.live
    task = asyncio.create_task(sync.run())
    try:
        for publisher in (w0, w1):
            await publisher.publish_once()
        await eventually(lambda: live() == {"w0", "w1"}, timeout_s=10)
        await admin.execute_command("ACL", "SETUSER", "router", "-zrange")
        await eventually(lambda: sync.is_degraded, timeout_s=10)
        # The records expire as their TTL has it (the members stay for FORGET_AFTER_S).
        assert await admin.delete(KEYS.worker("w0"), KEYS.worker("w1")) == 2
        await admin.execute_command("ACL", "SETUSER", "router", "+zrange")
        await eventually(lambda: not sync.is_degraded, timeout_s=10)
        await w0.publish_once()  # the first back

        async def read_w0_back() -> bool:
            return await admin.exists(KEYS.worker("w0")) == 1

        await eventually(read_w0_back, timeout_s=10)
        await asyncio.sleep(0.3)  # several reads (every 0.05 s) with w0 back alone
        assert live() == {"w0", "w1"}
    finally:
        await fleet.end(task)


async def test_a_version_no_worker_serves_any_more_has_its_series_removed(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """w0 serves m@1, then m@2 only (a rollout): m@1's series (its calls' histograms, codes,
    reasons, workers) are removed FORGET_VERSION_S later; they piled up, every rollout's, for
    as long as the router ran (review finding). m@2's stay."""
    monkeypatch.setattr(registry_reader, "FORGET_VERSION_S", 0.5)
    table = RouteTable(RoutingConfig(), random.Random())
    worker, router = connect(redis_server.worker_url), connect(redis_server.router_url)
    sync = new_sync(router, table)
    metrics = sync._metrics
    serving = [model_record(name="m", version="1")]

    def record() -> WorkerRecord:
        return dataclasses.replace(RECORD, models=tuple(serving))

    def exported(version: str) -> bool:
        text = generate_latest(metrics.registry).decode()
        return f'version="{version}"' in text

    task = asyncio.create_task(sync.run())
    beating = asyncio.create_task(
        heartbeats(HeartbeatPublisher(worker, KEYS, HeartbeatConfig(), record))
    )
    try:
        await eventually(lambda: table.live_workers(time.monotonic()) != (), timeout_s=10)
        for version in ("1", "2"):
            metrics.request_seconds_of["m", version].observe(0.01)
            metrics.responses_total_of["m", version, "OK"].inc()
            metrics.routed_total_of["m", version, "w0"].inc()
            metrics.retries_total.labels("m", version).inc()
        serving[:] = [model_record(name="m", version="2")]
        await eventually(lambda: not exported("1"), timeout_s=10)
        assert exported("2")
        assert ("m", "1", "OK") not in metrics.responses_total_of
        # Calls still asking for m@1 are refused: its series come back, and go again.
        metrics.rejected_total_of["m", "1", "no_worker"].inc()
        assert exported("1")
        await eventually(lambda: not exported("1"), timeout_s=10)
    finally:
        await ended((task, beating), (worker, router))


async def test_a_redis_that_lost_the_registry_with_no_read_failing_is_refilled(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis loses the registry between two reads, none failing (FLUSHALL here; as well a
    restart the router's client reconnects through, or a failover to an empty replica): w0
    re-registers at its next beat, w1 not yet. The first read after took w0 for the fleet and
    dropped w1 (review finding); the registry's epoch changed, so w1 is held for REFILL_S,
    as after an outage, then dropped. Heartbeats stay fresh 30 s: only the hold keeps it."""
    # Long enough that a loaded machine's stall before the look cannot outlast the hold.
    monkeypatch.setattr(registry_reader, "REFILL_S", 8.0)
    fleet = FreshFleet.start(redis_server)
    admin, sync, w0, w1, live = fleet.admin, fleet.sync, fleet.w0, fleet.w1, fleet.live
    task = asyncio.create_task(sync.run())
    beating = asyncio.create_task(heartbeats(w0))
    try:
        await w1.publish_once()
        await eventually(lambda: live() == {"w0", "w1"}, timeout_s=10)
        await admin.flushall()

        async def w0_back() -> bool:
            return await admin.zscore(KEYS.workers, "w0") is not None

        await eventually(w0_back, timeout_s=10)
        await asyncio.sleep(0.3)  # several reads (every 0.05 s) with w0 alone registered
        assert not sync.is_degraded  # no read failed
        assert live() == {"w0", "w1"}
        await eventually(lambda: live() == {"w0"}, timeout_s=20)  # the hold ends
    finally:
        await fleet.end(task, beating)


async def test_a_dead_worker_stamped_before_redis_stepped_back_goes_stale_on_our_clock(
    redis_server: RedisServer,
) -> None:
    """w1's last heartbeat was scored 60 s ahead of Redis's clock now (the clock stepped back
    60 s after it; its record's expiry moved with it) and w1 beats no more: it leaves the
    table `stale_after_s` (6 s here) after the router first read it, not 60 s later. w0
    beats every 0.2 s in the stepped-back clock and stays live throughout (registry review)."""
    # Stale after 6 s: a loaded machine's stall before the first look cannot pass it.
    config = RoutingConfig(stale_after_s=6.0)
    table = RouteTable(config, random.Random())
    admin, worker = connect(redis_server.url), connect(redis_server.worker_url)
    router = connect(redis_server.router_url)
    sync = new_sync(router, table)
    publishers = two_workers(worker)
    await publishers[1].publish_once()
    seconds, micros = await admin.time()
    await admin.zadd(KEYS.workers, {"w1": seconds * 1000 + micros // 1000 + 60_000})
    await admin.pexpire(KEYS.worker("w1"), 120_000)

    def live() -> set[str]:
        return {w.worker_id for w in table.live_workers(time.monotonic())}

    beating = asyncio.create_task(heartbeats(publishers[0]))
    task = asyncio.create_task(sync.run())
    try:
        await eventually(lambda: live() == {"w0", "w1"}, timeout_s=10)
        # Not 60 s: eventually's bound (16 s) is far past stale_after_s (6 s), far short of 60.
        await eventually(lambda: live() == {"w0"}, timeout_s=config.stale_after_s + 10)
        for _ in range(5):  # w0 stays
            await asyncio.sleep(0.3)
            assert live() == {"w0"}
    finally:
        await ended((task, beating), (admin, worker, router))
