"""The registry Redis's ACL on a real redis-server (tests/support/redis.py starts it with the
fabric's ACL file): no access without a password, and each role only what its tier does, run
through the tiers' own registry code."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.retry import Retry

from services.common.redis_acl import WORKER, role_credentials
from services.common.redis_server import ping
from services.common.registry_schema import INTERNAL_API, RegistryKeys, WorkerRecord, connect
from services.common.sparse_log import SparseLog
from services.gpu_worker import registry_publisher
from services.gpu_worker.config import HeartbeatConfig
from services.gpu_worker.registry_publisher import HeartbeatPublisher
from services.router import registry_reader
from services.router.registry_reader import read_fleet
from services.router.worker_networks import WorkerNetworks
from tests.support.records import model_record
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

KEYS = RegistryKeys()
RECORD = WorkerRecord(
    worker_id="w0", address="127.0.0.1:8201", is_draining=False, sent_at_ms=0, models=()
)


@pytest.fixture
async def clients(redis_server: RedisServer) -> AsyncIterator[dict[str, aioredis.Redis]]:
    """A connected client per role, as the tiers connect (services.common.registry_schema)."""
    made = {
        "admin": connect(redis_server.url),
        "router": connect(redis_server.router_url),
        "worker": connect(redis_server.worker_url),
    }
    yield made
    for client in made.values():
        await client.aclose()


def publisher(client: aioredis.Redis, record: WorkerRecord = RECORD) -> HeartbeatPublisher:
    return HeartbeatPublisher(client, KEYS, HeartbeatConfig(), lambda: record)


def test_no_password_no_access(redis_server: RedisServer) -> None:
    anonymous = redis.Redis.from_url(redis_server.anonymous_url, protocol=2, socket_timeout=5)
    # NOAUTH, which redis-py raises as "Authentication required."
    with pytest.raises(AuthenticationError, match="required"):
        anonymous.get(KEYS.workers)
    with pytest.raises(AuthenticationError, match="required"):
        anonymous.flushall()
    assert not ping(redis_server.port)
    # WRONGPASS: a wrong password, or the disabled default user.
    for username, password in (("router", "guess"), ("default", "")):
        client = redis.Redis(
            port=redis_server.port,
            username=username,
            password=password,
            protocol=2,
            retry=Retry(NoBackoff(), 0),  # redis-py would retry an auth failure with backoff
        )
        with pytest.raises(AuthenticationError, match="invalid username-password"):
            client.zrange(KEYS.workers, 0, -1)


async def test_router_reads_the_registry_but_cannot_change_it(
    clients: dict[str, aioredis.Redis],
) -> None:
    await publisher(clients["worker"]).publish_once()
    records = (await read_fleet(clients["router"], KEYS)).records
    assert [r.worker_id for r, _ in records] == ["w0"]

    router = clients["router"]
    forged = RECORD.to_json().replace("127.0.0.1", "10.255.0.1")
    for call in (
        lambda: router.set(KEYS.worker("w0"), forged),
        lambda: router.zadd(KEYS.workers, {"forged": 1}),
        lambda: router.delete(KEYS.worker("w0")),
        lambda: router.zrem(KEYS.workers, "w0"),
        lambda: router.flushall(),
        lambda: router.config_get("*"),
        lambda: router.keys("*"),
        lambda: router.eval("return 1", 0),
    ):
        with pytest.raises(NoPermissionError):
            await call()
    # Nothing the router tried took effect.
    assert await clients["admin"].get(KEYS.worker("w0")) == RECORD.to_json().encode()
    assert await clients["admin"].zrange(KEYS.workers, 0, -1) == [b"w0"]


async def test_a_worker_of_an_older_internal_api_is_not_routed_to_for_what_current_ones_serve(
    clients: dict[str, aioredis.Redis],
) -> None:
    """A heartbeat from before bundles carries no internal_api: such a worker refuses every
    bundle, so for a model version a current one serves, routers leave it out rather than
    send it calls that fail. A version only older workers serve keeps them (the cut was
    fleet-wide: once one current worker registered, a model only older workers served got
    no worker at all, mid-upgrade; review finding)."""
    admin = clients["admin"]

    async def register(
        worker_id: str,
        *models: tuple[str, str],
        is_current: bool,
        is_draining: bool = False,
        address: str = "127.0.0.1:1",
        is_ready: bool = True,
    ) -> None:
        record = json.loads(
            WorkerRecord(worker_id=worker_id, address=address, is_draining=is_draining,
                         sent_at_ms=0, models=tuple(model_record(name=n, version=v,
                                                                 is_ready=is_ready)
                                                    for n, v in models)).to_json()
        )  # fmt: skip
        if not is_current:
            del record["internal_api"]
        await admin.set(KEYS.worker(worker_id), json.dumps(record))
        await admin.zadd(KEYS.workers, {worker_id: time.time() * 1000})

    await register("w0", ("minilm", "1"), is_current=True)
    await register("w-old", ("minilm", "1"), ("other", "1"), is_current=False)
    await register("w-older", ("minilm", "1"), is_current=False)
    records = (await read_fleet(clients["router"], KEYS)).records
    served = {r.worker_id: [(m.name, m.version) for m in r.models] for r, _ in records}
    assert served == {"w0": [("minilm", "1")], "w-old": [("other", "1")]}
    assert {r.worker_id: r.internal_api for r, _ in records} == {"w0": INTERNAL_API, "w-old": 1}
    # With no current worker left (routers upgraded before every worker), the older ones are
    # routed to for everything again: older gateways' calls, which they serve, keep being served.
    await admin.zrem(KEYS.workers, "w0")
    records = (await read_fleet(clients["router"], KEYS)).records
    served = {r.worker_id: [(m.name, m.version) for m in r.models] for r, _ in records}
    assert served == {"w-old": [("minilm", "1"), ("other", "1")], "w-older": [("minilm", "1")]}
    # Nor while the only current worker drains: it serves nothing new, and the older ones
    # were cut for the length of its drain (review finding).
    await register("w-draining", ("minilm", "1"), is_current=True, is_draining=True)
    records = (await read_fleet(clients["router"], KEYS)).records
    served = {r.worker_id: [(m.name, m.version) for m in r.models] for r, _ in records}
    assert served["w-older"] == [("minilm", "1")]
    assert served["w-old"] == [("minilm", "1"), ("other", "1")]
    # Nor one still loading the version (not ready: it serves nothing of it yet).
    await admin.zrem(KEYS.workers, "w-draining")
    await register("w-loading", ("minilm", "1"), is_current=True, is_ready=False)
    records = (await read_fleet(clients["router"], KEYS)).records
    served = {r.worker_id: [(m.name, m.version) for m in r.models] for r, _ in records}
    assert served["w-older"] == [("minilm", "1")]
    await admin.zrem(KEYS.workers, "w-loading")
    # Nor one at an address the router will not route to (a forged record, a pod network
    # misconfigured): it cut every older worker, then was itself refused (review finding).
    await register("w-elsewhere", ("minilm", "1"), is_current=True, address="10.9.9.9:1")
    networks = WorkerNetworks.parse("127.0.0.0/8")
    records = (await read_fleet(clients["router"], KEYS, networks)).records
    served = {r.worker_id: [(m.name, m.version) for m in r.models] for r, _ in records}
    assert served["w-older"] == [("minilm", "1")]


async def test_worker_publishes_and_deregisters_but_reads_and_administers_nothing(
    clients: dict[str, aioredis.Redis],
) -> None:
    admin, worker = clients["admin"], clients["worker"]
    await admin.set("tenant:secret", "input")
    heartbeat = publisher(worker)
    await heartbeat.publish_once()
    assert await admin.get(KEYS.worker("w0")) == RECORD.to_json().encode()

    steal = worker.register_script("return redis.call('GET', KEYS[1])")
    for call in (
        lambda: worker.get(KEYS.worker("w0")),
        lambda: worker.zrange(KEYS.workers, 0, -1),
        lambda: worker.get("tenant:secret"),
        lambda: worker.set("tenant:secret", "overwritten"),
        lambda: worker.keys("*"),
        lambda: worker.flushall(),
        lambda: worker.config_get("*"),
        lambda: worker.config_set("protected-mode", "no"),
        lambda: worker.acl_list(),
        lambda: worker.eval("return 1", 0),
        lambda: steal(keys=["tenant:secret"]),
    ):
        with pytest.raises(NoPermissionError):
            await call()
    # A script runs with the caller's rights: loading one gains nothing (Redis 6 words the
    # refusal inside a script differently from NOPERM).
    with pytest.raises(ResponseError, match=r"can't run this command|no permissions"):
        await steal(keys=[KEYS.worker("w0")])
    assert await admin.get("tenant:secret") == b"input"

    await heartbeat.deregister("w0")
    assert await admin.exists(KEYS.worker("w0")) == 0
    assert await admin.zrange(KEYS.workers, 0, -1) == []


async def test_a_tier_authenticates_from_its_password_file(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    password_file = tmp_path / "worker-password"
    password_file.write_text(redis_server.passwords[WORKER] + "\n")
    url = redis_server.anonymous_url
    client = connect(url, credentials=role_credentials(WORKER, url, password_file))
    try:
        await publisher(client).publish_once()
        # Re-read on the next connection: a wrong (rotated-away) password is refused.
        password_file.write_text("stale")
        await client.connection_pool.disconnect()
        with pytest.raises(AuthenticationError):
            await publisher(client).publish_once()
    finally:
        await client.aclose()
    router = connect(redis_server.router_url)
    records = (await read_fleet(router, KEYS)).records
    await router.aclose()
    assert [r.worker_id for r, _ in records] == ["w0"]


async def test_records_that_do_not_parse_are_skipped(clients: dict[str, aioredis.Redis]) -> None:
    """A record whose time is 1e400 (OverflowError in int()) or whose JSON nests past Python's
    limit (RecursionError) is skipped beside a good one. Before, either raised out of the
    router's refresh, past its handling of Redis errors, and ended its registry loop: routing
    froze on the last snapshot, and once it aged out every call was refused."""
    await publisher(clients["worker"]).publish_once()
    admin = clients["admin"]
    late = json.loads(RECORD.to_json()) | {"worker_id": "w-inf", "sent_at_ms": 1e400}
    bad = {
        "w-inf": json.dumps(late).replace("Infinity", "1e400"),
        "w-deep": "[" * 100_000 + "]" * 100_000,
    }
    for worker_id, raw in bad.items():
        await admin.set(KEYS.worker(worker_id), raw)
        await admin.zadd(KEYS.workers, {worker_id: time.time() * 1000})
    records = (await read_fleet(clients["router"], KEYS)).records
    assert [r.worker_id for r, _ in records] == ["w0"]


async def test_a_member_that_is_not_utf8_or_a_record_of_another_id_is_skipped(
    clients: dict[str, aioredis.Redis],
) -> None:
    """A workers member that is not UTF-8 (anyone holding the worker credential can write
    one) failed every router's refresh, for good; a record under one id claiming another's
    (forged, or copied) put that id twice in the table. Both are skipped beside a good one
    (review findings)."""
    await publisher(clients["worker"]).publish_once()
    admin = clients["admin"]
    await admin.zadd(KEYS.workers, {b"\xff\xfe": time.time() * 1000})
    await admin.set(KEYS.worker("w-copy"), RECORD.to_json())  # claims to be w0
    await admin.zadd(KEYS.workers, {"w-copy": time.time() * 1000})
    records = (await read_fleet(clients["router"], KEYS)).records
    assert [r.worker_id for r, _ in records] == ["w0"]


async def test_a_heartbeat_outlives_an_empty_password_file(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The password file is empty when the heartbeat reconnects (a rotation that truncates,
    then writes): that round fails, and once the file holds the password again the worker is
    registered again. Before, the error (a ValueError, not a Redis error) ended the heartbeat
    loop: the worker left routing for good while staying healthy."""
    password_file = tmp_path / "worker-password"
    password_file.write_text(redis_server.passwords[WORKER])
    url = redis_server.anonymous_url
    client = connect(url, credentials=role_credentials(WORKER, url, password_file))
    heartbeat = HeartbeatPublisher(
        client, KEYS, HeartbeatConfig(period_s=0.05, max_backoff_s=0.1), lambda: RECORD
    )
    admin = connect(redis_server.url)
    task = asyncio.create_task(heartbeat.run())
    try:
        await eventually(lambda: heartbeat.is_connected, message="never registered")
        password_file.write_text("")
        await client.connection_pool.disconnect()
        await eventually(lambda: not heartbeat.is_connected, message="the round did not fail")
        assert not task.done()
        password_file.write_text(redis_server.passwords[WORKER])
        # Registered again: a round after this delete writes the record back. (The flag
        # alone can say so before the delete lands: a round between the password's return
        # and the delete reconnected, and the record it wrote is then deleted.)
        await admin.delete(KEYS.worker("w0"))
        await eventually(lambda: admin.exists(KEYS.worker("w0")), message="not registered again")
        assert heartbeat.is_connected
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        await admin.aclose()


async def test_a_heartbeat_forgets_members_silent_for_ten_minutes(
    clients: dict[str, aioredis.Redis],
) -> None:
    """A worker killed without deregistering (its record expired, its member left in the
    sorted set) is dropped from the set by the next heartbeat once it has been silent for
    FORGET_AFTER_S; one silent for less stays. Under a Redis still running an ACL without
    the command (upgraded code, ACL not reloaded), the heartbeat goes on all the same.
    Before, such members stayed for good, and every router read them all twice a second."""
    admin = clients["admin"]
    now_ms = time.time() * 1000
    await admin.zadd(KEYS.workers, {"killed": now_ms - 3_600_000, "quiet": now_ms - 60_000})
    await publisher(clients["worker"]).publish_once()
    assert set(await admin.zrange(KEYS.workers, 0, -1)) == {b"w0", b"quiet"}
    await admin.zadd(KEYS.workers, {"killed": now_ms - 3_600_000})
    await admin.execute_command("ACL", "SETUSER", "worker", "-zremrangebyscore")
    await publisher(clients["worker"]).publish_once()  # no error
    assert set(await admin.zrange(KEYS.workers, 0, -1)) == {b"w0", b"quiet", b"killed"}


async def test_a_malformed_record_is_warned_of_once_while_it_lasts(
    clients: dict[str, aioredis.Redis],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record that does not read was warned of at every refresh (twice a second, per
    router, for as long as it lasted); now once, and again once it breaks anew."""
    admin = clients["admin"]
    await admin.zadd(KEYS.workers, {"bad": time.time() * 1000})

    async def reads(record: str, times: int) -> list[str]:
        await admin.set(KEYS.worker("bad"), record)
        caplog.clear()
        for _ in range(times):
            await read_fleet(clients["router"], KEYS)
        return [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]

    assert len(await reads('{"worker_id": "bad"}', 3)) == 1
    assert await reads(dataclasses.replace(RECORD, worker_id="bad").to_json(), 2) == []
    warned = await reads('{"worker_id": "bad", "address": 7}', 2)
    assert len(warned) == 1 and "of bad" in warned[0]


async def test_a_worker_and_a_router_under_the_previous_acl_still_beat_and_read(
    clients: dict[str, aioredis.Redis],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis reads its ACL file only at start: after an upgrade it runs the previous one, with
    no right to the registry's epoch key (nor GET for the router) until it is reloaded. The
    epoch written inside the heartbeat's script failed the whole beat (NOPERM before the
    script ran), and the router's GET of it failed its every read (diff review): a fleet
    upgraded before Redis's ACL was reloaded would have vanished from routing. Both go on
    without the epoch."""
    admin, worker, router = clients["admin"], clients["worker"], clients["router"]
    for module in (registry_publisher, registry_reader):  # unsaid yet in this process
        monkeypatch.setattr(module, "_hourly", SparseLog(module.log, period_s=3600.0))
    for role, keys in (
        ("worker", "~fabric:workers ~fabric:worker:* ~fabric:repository"),
        ("router", "~fabric:workers ~fabric:worker:*"),
    ):
        await admin.execute_command("ACL", "SETUSER", role, "resetkeys", *keys.split())
    await admin.execute_command("ACL", "SETUSER", "router", "-get")
    await publisher(worker).publish_once()
    assert await admin.get(KEYS.worker("w0")) == RECORD.to_json().encode()
    assert await admin.get(KEYS.epoch) is None
    read = await read_fleet(router, KEYS)
    assert [r.worker_id for r, _ in read.records] == ["w0"] and read.epoch is None
    await admin.set(KEYS.epoch, "e1")  # there, but refused to this router: read as none
    assert (await read_fleet(router, KEYS)).epoch is None
    # Said, not only borne: the protection is off until the ACL is reloaded (review finding).
    said = [r.getMessage() for r in caplog.records if "ACL LOAD" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == ["heartbeat", "registry"], said
