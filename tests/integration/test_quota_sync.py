"""Fleet-wide quotas: gateways share their demand through a real Redis, as user `gateway`."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import NoPermissionError

from services.common.redis_acl import GATEWAY
from services.gateway.admission import TenantAdmission
from services.gateway.metrics import GatewayMetrics
from services.gateway.quota_sync import QuotaSync, QuotaSyncConfig
from services.gateway.tenants import TenantLabels, TenantPolicy
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration

SEARCH = TenantPolicy("search", requests_per_s=100.0)
BATCH = TenantPolicy("batch", requests_per_s=1000.0, rows_per_s=1000.0, max_concurrency=10)
TENANTS = {"search": SEARCH, "batch": BATCH}


#: A round's period far longer than any round of these tests takes: each rate is then over
#: exactly it (QuotaSync.sync_once takes the period as a round's least time), so shares are
#: exact ratios of the calls. Over 0.05 s, a quiet gateway's first round counted its calls
#: from its construction, past the other's first connect to Redis: a busy machine's 20 ms
#: more moved the shares past the tests' bounds.
CLAMPED_PERIOD_S = 10.0


def make_gateway(
    redis_server: RedisServer, period_s: float = 0.05
) -> tuple[TenantAdmission, QuotaSync]:
    admission = TenantAdmission(GatewayMetrics(CollectorRegistry()), TenantLabels(TENANTS))
    config = QuotaSyncConfig(redis_url=redis_server.role_url(GATEWAY), period_s=period_s)
    return admission, QuotaSync(config, admission, TENANTS)


def two_clamped_gateways(
    redis_server: RedisServer,
) -> tuple[tuple[TenantAdmission, QuotaSync], tuple[TenantAdmission, QuotaSync]]:
    first = make_gateway(redis_server, CLAMPED_PERIOD_S)
    return first, make_gateway(redis_server, CLAMPED_PERIOD_S)


async def test_each_gateway_enforces_the_share_of_the_demand_it_sees(
    redis_server: RedisServer,
) -> None:
    (busy, busy_sync), (quiet, quiet_sync) = two_clamped_gateways(redis_server)
    try:
        for _ in range(30):
            busy.acquire(SEARCH)
        for _ in range(10):
            quiet.acquire(SEARCH)
        await busy_sync.sync_once()
        quiet_shares = await quiet_sync.sync_once()
        busy_shares = await busy_sync.sync_once()  # now it has read the quiet one's entry too
        assert quiet_shares["search"] == pytest.approx(0.25, abs=0.05)
        # The busy gateway's second round saw no new calls of its own: its demand fell to 0,
        # so it keeps only the floor while the quiet one's entry still shows demand.
        assert busy_shares["search"] < 0.1
        assert busy.quotas.share("search") == busy_shares["search"]
        # A tenant no round has named yet (limited by a keys reload since): an equal share of
        # the two gateways, not the whole limit at each.
        assert busy.quotas.share("newly-limited") == pytest.approx(0.5)
    finally:
        await busy_sync.stop()
        await quiet_sync.stop()


async def held_at_the_floor(
    busy_sync: QuotaSync, quiet: TenantAdmission, quiet_sync: QuotaSync
) -> float:
    """The busy gateway's share once the tenant's calls all went to the quiet one: the floor."""
    for _ in range(10):
        quiet.acquire(SEARCH)
    await busy_sync.sync_once()
    await quiet_sync.sync_once()
    floor = (await busy_sync.sync_once())["search"]
    assert floor < 0.1
    return floor


async def test_while_redis_stays_away_each_gateway_falls_back_to_an_equal_share(
    redis_server: RedisServer,
) -> None:
    """A gateway holding a tenant at the floor (its calls went to the other gateway) keeps
    that share through a short outage, and past `stale_after_periods` failed rounds takes an
    equal one: the demand it followed is stale, and the tenant's calls may have moved to it."""
    (busy, busy_sync), (quiet, quiet_sync) = make_gateway(redis_server), make_gateway(redis_server)
    try:
        floor = await held_at_the_floor(busy_sync, quiet, quiet_sync)
        redis_server.kill()
        for _ in range(busy_sync.config.stale_after_periods - 1):
            await busy_sync.run_round()
        assert busy.quotas.share("search") == floor  # a short outage: the shares stay
        await busy_sync.run_round()
        assert busy.quotas.share("search") == pytest.approx(0.5)  # 1 of the 2 gateways seen
    finally:
        await busy_sync.stop()
        await quiet_sync.stop()


async def test_a_gateway_that_stopped_publishing_is_forgotten(redis_server: RedisServer) -> None:
    (alive, alive_sync), (_, gone_sync) = make_gateway(redis_server), make_gateway(redis_server)
    try:
        await gone_sync.sync_once()
        alive.acquire(SEARCH)
        shares = await alive_sync.sync_once()
        assert shares["search"] == pytest.approx(1.0)  # the other has shown no demand
        for _ in range(alive_sync.config.stale_after_periods + 1):
            await alive_sync.sync_once()
        # No demand anywhere and the other entry stale: alone, this gateway takes it all.
        assert (await alive_sync.sync_once())["search"] == pytest.approx(1.0)
        client = aioredis.Redis.from_url(redis_server.url)
        assert await client.hlen(alive_sync.config.demand_key) == 2
        await client.aclose()
    finally:
        await alive_sync.stop()
        await gone_sync.stop()


async def test_the_gateway_user_cannot_touch_the_registry(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.role_url(GATEWAY))
    try:
        # ZRANGE itself it may run (ListJobs pages its tenant's jobs with it), on its keys only.
        with pytest.raises(NoPermissionError, match="no permissions to access one of the keys"):
            await client.zrange("fabric:workers", 0, -1)
        with pytest.raises(NoPermissionError, match="no permissions to access"):
            await client.hset("fabric:worker:w1", "x", "1")
    finally:
        await client.aclose()


async def test_a_killed_gateways_entry_counts_briefly_for_a_new_gateway_and_is_deleted(
    redis_server: RedisServer,
) -> None:
    """A gateway killed without deleting its entry (its demand frozen at 100/s): a gateway that
    starts now counts it for two rounds, then takes the whole share; past
    `forget_after_periods` rounds it deletes the entry. Before, a new gateway counted every
    such entry for `stale_after_periods` rounds (each start held its tenants near the floor
    for about 2 s), and the entries stayed in Redis for good."""
    admin = aioredis.Redis.from_url(redis_server.url)
    admission = TenantAdmission(GatewayMetrics(CollectorRegistry()), TenantLabels(TENANTS))
    config = QuotaSyncConfig(
        redis_url=redis_server.role_url(GATEWAY), period_s=0.05, forget_after_periods=6
    )
    sync = QuotaSync(config, admission, TENANTS)
    try:
        await admin.hset(config.demand_key, "killed", '{"seq": 7, "demand": {"search": 100.0}}')
        shares = []
        for _ in range(3):
            admission.acquire(SEARCH)
            shares.append((await sync.sync_once())["search"])
        assert shares[0] < 0.5 and shares[1] < 0.5  # the dead entry's demand, counted
        assert shares[2] == pytest.approx(1.0)  # its number never moved: stale
        for _ in range(config.forget_after_periods):
            await sync.sync_once()
        assert await admin.hkeys(config.demand_key) == [sync.gateway_id.encode()]
    finally:
        await sync.stop()
        await admin.aclose()


async def test_entries_that_do_not_parse_are_skipped_and_the_sync_goes_on(
    redis_server: RedisServer,
) -> None:
    """Entries another version might write (a null demand, a field name that is not UTF-8)
    are skipped; the round computes its shares from the rest. Before, they raised out of the
    round, past its error handling, and ended the sync loop: the shares froze."""
    admin = aioredis.Redis.from_url(redis_server.url)
    admission, sync = make_gateway(redis_server)
    try:
        key = sync.config.demand_key
        await admin.hset(key, "newer", '{"seq": 1, "demand": {"search": null}}')
        await admin.hset(key, b"\xff\xfe", '{"seq": 1, "demand": {"search": 5.0}}')
        await admin.hset(key, "list", '{"seq": 1, "demand": ["search"]}')
        await admin.hset(key, "huge", '{"seq": 1e400, "demand": {}}')
        await admin.hset(key, "deep", "[" * 100_000 + "]" * 100_000)
        # Numbers no count or rate is: a -5 against the local demand made this gateway's share
        # twice the whole limit, and a NaN sent every gateway to the floor (review finding).
        await admin.hset(key, "negative", '{"seq": 1, "demand": {"search": -5.0}}')
        await admin.hset(key, "nan", '{"seq": 1, "demand": {"search": NaN}}')
        await admin.hset(key, "in-flight", '{"seq": 1, "demand": {}, "in_flight": {"search": -3}}')
        admission.acquire(SEARCH)
        assert (await sync.sync_once())["search"] == pytest.approx(1.0)
    finally:
        await sync.stop()
        await admin.aclose()


async def test_a_password_file_emptied_mid_rotation_fails_rounds_like_an_outage(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The gateway's password file is empty for a while (a Secret being rotated): reading it
    raises ValueError, not a Redis error. Those rounds fail as an outage's do, so past
    `stale_after_periods` the equal share applies, and the stop still goes through. Before,
    they were logged as bugs with the floor share kept for good, and the stop raised."""
    password = tmp_path / "gateway-password"
    password.write_text(redis_server.passwords[GATEWAY])
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    admission = TenantAdmission(GatewayMetrics(CollectorRegistry()), TenantLabels(TENANTS))
    config = QuotaSyncConfig(redis_url=url, redis_password_file=password, period_s=0.05)
    busy_sync = QuotaSync(config, admission, TENANTS)
    quiet, quiet_sync = make_gateway(redis_server)
    try:
        await held_at_the_floor(busy_sync, quiet, quiet_sync)
        password.write_text("")
        admin = aioredis.Redis.from_url(redis_server.url)
        try:  # its next round connects anew, and reads the file
            await admin.client_kill_filter(user=GATEWAY)
        finally:
            await admin.aclose()
        for _ in range(config.stale_after_periods):
            await busy_sync.run_round()
        assert admission.quotas.share("search") == pytest.approx(0.5)
    finally:
        await busy_sync.stop()
        await quiet_sync.stop()


async def test_rows_and_calls_in_flight_are_shared_by_what_each_gateway_reports(
    redis_server: RedisServer,
) -> None:
    """Rows are split by rows (a gateway of 5 calls of 150 rows beside one of 95 single rows
    takes nearly 0.9 of the row rate, where split by calls it took 0.05), and calls in flight
    are held to what the other gateways left of the limit."""
    (big, big_sync), (small, small_sync) = two_clamped_gateways(redis_server)

    def big_calls() -> None:
        for _ in range(5):
            big.acquire(BATCH)
            big.quotas.take_rows(BATCH, 150, now_s=0.0)

    try:
        big_calls()
        for _ in range(5):
            big.enter(BATCH)  # five long calls in flight here
        await big_sync.sync_once()
        for _ in range(95):
            small.acquire(BATCH)
            small.quotas.take_rows(BATCH, 1, now_s=0.0)
        await small_sync.sync_once()
        assert small.quotas.row_share("batch") == pytest.approx(95 / 845, abs=0.01)
        big_calls()  # a round of the same demand again, to read the small one's entry
        shares = await big_sync.sync_once()
        assert shares["batch"] == pytest.approx(5 / 100, abs=0.01)  # of calls
        assert big.quotas.row_share("batch") == pytest.approx(750 / 845, abs=0.01)
        # The small gateway, 0.95 of the calls, may start 5 calls: the big one holds 5.
        admitted = 0
        while small.acquire(BATCH) is None and admitted < 20:
            small.enter(BATCH)
            admitted += 1
        assert admitted == 5
    finally:
        await big_sync.stop()
        await small_sync.stop()


async def test_demand_is_a_rate_over_the_time_a_round_really_took(
    redis_server: RedisServer,
) -> None:
    """A gateway whose rounds lag (its loop busy) reported a round's calls as the nominal
    period's (0.05 s here): 30 calls over 0.3 s as 600 a second, six times its real rate, and
    took that share of the limits from the other gateways (review finding)."""
    admission, sync = make_gateway(redis_server)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        started_s = time.monotonic()
        await sync.sync_once()
        for _ in range(30):
            admission.acquire(SEARCH)
        await asyncio.sleep(0.3)
        await sync.sync_once()
        taken_s = time.monotonic() - started_s  # at least the round's (however slow a machine)
        entry = json.loads(await client.hget(sync.config.demand_key, sync.gateway_id))
    finally:
        await sync.stop()
        await client.aclose()
    assert 30 / taken_s <= entry["demand"]["search"] <= 30 / 0.3
