"""RELIABILITY.md's registry and health scenarios (25, 26, 27, 28, 33, 35), end to end.

One two-worker stack (`python -m services.local_stack`) serves the whole module: each test
restores what it breaks (a stopped worker continues, a stopped Redis comes back on the same port
with the same ACL), except the last, s33, which drains a worker and kills the router. Tests run
in file order, so it goes last.

What is checked are states: nothing lost, every tier serving, the registry refilled, a worker
routed again. How long a fault is held comes from the tiers' own defaults (heartbeat period,
staleness), so a changed default changes the scenario with it. Waits for the fabric to react are
bounded generously (the stack shares two cores with another test module); how fast each
reaction comes, and whether a hung Redis slows calls or health checks at all, are figures:
`python -m bench.registry` measures them on the same scenarios (bench/results/registry.json).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import metric_names as names
from services.common.processes import ChildProcess, launch, wait_ready
from services.common.procfs import is_alive
from services.common.redis_acl import ACL_FILE_NAME, ADMIN, WORKER, password_file_name
from services.common.redis_server import ping, redis_command
from services.common.registry_schema import RegistryKeys
from services.gateway.config import GatewayConfig
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.router.routing_config import RoutingConfig
from services.router.server import REGISTRY_HEALTH_NAME
from tests.support.fabric_load import predict_request, predict_row_request, routed_to
from tests.support.metrics import scrape, total
from tests.support.models import (
    STALL,
    release_stall,
    row,
    write_small_minilm_repository,
    write_stalling_model,
)
from tests.support.processes import REPO_ROOT, ServiceProcess, start_worker
from tests.support.stack import Stack, Tier, start_stack
from tests.support.waiting import eventually, eventually_sync

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STALE_AFTER_S = RoutingConfig.stale_after_s
#: Scenario 25's outage.
OUTAGE_S = 30.0
#: Client deadline: far above any latency here (a call caught on a stopped worker waits for it
#: to continue), so a stall shows as latency, not as an error.
TIMEOUT_S = 60.0
#: Bound on each wait for the fabric to react (a fault noticed, a worker dropped or back, the
#: registry refilled): the defaults make each a matter of seconds (bench/registry.py measures
#: them); the bound only turns "never" into a failure that names what did not happen.
REACTION_TIMEOUT_S = 60.0
#: Bound on each wait for the load to reach a count of answers.
ANSWERS_TIMEOUT_S = 120.0


# -- Redis under the test's control -----------------------------------------------------------


@dataclass
class FabricRedis:
    """The stack's Redis: the launcher's process at first; after `start`, ours, on the same port
    with the same ACL file (so every tier's password file still works), and empty."""

    port: int
    acl_file: Path
    admin_password: str
    state_dir: Path
    pid: int
    #: Set once this test module started the current server (None: the launcher's).
    child: ChildProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://{ADMIN}:{self.admin_password}@127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        return ping(self.port, timeout_s=0.2, auth=(ADMIN, self.admin_password))

    def kill(self) -> None:
        """SIGKILL: a crash or a lost node."""
        self._signal_and_wait(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM: a clean shutdown."""
        self._signal_and_wait(signal.SIGTERM)

    def _signal_and_wait(self, signum: int) -> None:
        os.kill(self.pid, signum)
        os.kill(self.pid, signal.SIGCONT)  # a paused server would hold SIGTERM pending
        if self.child is not None:
            self.child.process.wait(10)
        # The launcher reaps its own child; the port is free once nothing answers on it.
        eventually_sync(
            lambda: not self.answers() and not is_alive(self.pid),
            timeout_s=30,
            interval_s=0.01,
            message=f"redis {self.pid} stopped and its port free",
        )

    def start(self) -> None:
        """A new, empty redis-server on the same port and ACL; returns once it answers."""
        data_dir = self.state_dir / f"redis-{time.monotonic_ns()}"
        data_dir.mkdir()
        argv = redis_command(self.port, appendonly=False, dir=data_dir, acl_file=self.acl_file)
        self.child = launch("redis-server", argv, log_path=data_dir.with_suffix(".log"))
        self.pid = self.child.pid
        wait_ready([self.child], timeout_s=10, is_ready=lambda _: self.answers(), poll_s=0.01)

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers (slower than any socket timeout)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.child is not None and self.child.process.poll() is None:
            self.resume()
            self.child.terminate(10)

    def registered_workers(self) -> set[str]:
        """Worker ids in the registry's sorted set, read as an admin."""
        with redis.Redis.from_url(self.url, socket_timeout=1) as client:
            members = client.zrange(RegistryKeys("fabric").workers, 0, -1)
        return {m.decode() for m in members}


@dataclass
class Fabric:
    stack: Stack
    redis: FabricRedis
    model_repository: Path
    #: The stalling model's gate (tests.support.models.write_stalling_model), closed until
    #: released.
    stall_gate: Path


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    """The two-worker stack every test here shares."""
    tmp_path = tmp_path_factory.mktemp("registry")
    repository = write_small_minilm_repository(tmp_path / "repo")
    stall_gate = tmp_path / "stall-gate"
    write_stalling_model(repository, stall_gate)
    stack = start_stack(tmp_path, num_workers=2, model_repository=repository, tolerate_exits=True)
    fabric_redis = FabricRedis(
        port=stack.redis_port,
        acl_file=stack.state_dir / "redis-acl" / ACL_FILE_NAME,
        admin_password=stack.redis_admin_password,
        state_dir=stack.state_dir,
        pid=stack.redis_pid,
    )
    try:
        yield Fabric(stack, fabric_redis, repository, stall_gate)
    finally:
        release_stall(stall_gate)  # a test that failed while a call stalled
        if is_alive(fabric_redis.pid):
            fabric_redis.resume()
        code = stack.stop()
        fabric_redis.close()
    assert code == 0, stack.log("launcher")


# -- load and probes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    #: time.monotonic() when the call was sent, and its latency.
    sent_s: float
    latency_s: float
    error: grpc.aio.AioRpcError | None


@dataclass
class Load:
    """Closed-loop Predict callers sharing one channel to the gateway, opened before any fault,
    until `stop`."""

    address: str
    concurrency: int = 4
    outcomes: list[Outcome] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _channel: grpc.aio.Channel | None = None
    _is_stopping: bool = False

    def start(self) -> Load:
        self._channel = grpc.aio.insecure_channel(self.address)
        stub = api_grpc.InferenceServiceStub(self._channel)

        async def caller(n: int) -> None:
            i = 0
            while not self._is_stopping:
                sent_s = time.monotonic()
                error = None
                try:
                    reply = await stub.Predict(
                        predict_request(f"caller {n} row {i}"), timeout=TIMEOUT_S
                    )
                    assert len(reply.outputs) == 1
                except grpc.aio.AioRpcError as rpc_error:
                    error = rpc_error
                self.outcomes.append(Outcome(sent_s, time.monotonic() - sent_s, error))
                i += 1

        self._tasks = [asyncio.create_task(caller(n)) for n in range(self.concurrency)]
        return self

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]

    async def served_more_than(self, count: int) -> None:
        await eventually(
            lambda: len(self.outcomes) > count,
            timeout_s=ANSWERS_TIMEOUT_S,
            message=f"the load made more than {count} calls",
        )

    async def stop(self) -> list[Outcome]:
        self._is_stopping = True
        await asyncio.gather(*self._tasks)
        if self._channel is not None:
            await self._channel.close()
        return self.outcomes

    def errors(self) -> list[grpc.aio.AioRpcError]:
        return [o.error for o in self.outcomes if o.error is not None]


async def health(address: str, service: str = "", timeout_s: float = 5.0) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return reply.status


async def registry_is(stack: Stack, status: int) -> bool:
    """The router's registry health (NOT_SERVING while Redis is unreachable) is `status`."""
    return await health(stack.router.address, REGISTRY_HEALTH_NAME) == status


async def hold(until_s: float) -> None:
    """Keeps a fault in place until time.monotonic() reaches `until_s`: a scenario's duration,
    not a wait for a condition."""
    await asyncio.sleep(max(0.0, until_s - time.monotonic()))


async def predict_stalled(address: str) -> api.PredictResponse:
    """One call of the stalling model with a row that stalls until its gate opens."""
    request = predict_row_request(row(STALL, 0.0, 0.0, 0.0), model="stall")
    async with grpc.aio.insecure_channel(address) as channel:
        return await api_grpc.InferenceServiceStub(channel).Predict(request, timeout=TIMEOUT_S)


def stalled_queued(worker: Tier) -> float:
    """Rows of the stalling model queued (admitted, not yet running) on `worker`."""
    return total(scrape(worker.metrics_port), names.WORKER_QUEUE_DEPTH, model="stall")


def stalled_admitted(worker: Tier) -> float:
    """Rows of the stalling model admitted on `worker`: queued, or dispatched (their queue
    wait observed; this module's only stalling rows are one test's, none answered before its
    gate opens)."""
    text = scrape(worker.metrics_port)
    dispatched = total(text, names.WORKER_QUEUE_WAIT_SECONDS + "_count", model="stall")
    return total(text, names.WORKER_QUEUE_DEPTH, model="stall") + dispatched


def router_metric(stack: Stack, name: str) -> float:
    return total(scrape(stack.router.metrics_port), name)


def live_workers(stack: Stack) -> float:
    return router_metric(stack, names.ROUTER_LIVE_WORKERS)


def rows_executed(stack: Stack) -> float:
    return sum(total(scrape(w.metrics_port), names.WORKER_ROWS_TOTAL) for w in stack.workers)


def start_time(tier: Tier) -> float:
    """The process's start time, from its own metrics: changes if the tier restarted."""
    return total(scrape(tier.metrics_port), "process_start_time_seconds")


def probe_services(manifest: str) -> dict[str, str]:
    """The health service each probe of a base manifest's Deployment asks for."""
    documents = yaml.safe_load_all((REPO_ROOT / "deploy/k8s/base" / manifest).read_text())
    deployment = next(d for d in documents if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {
        probe: container[probe]["grpc"].get("service", "")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe")
    }


# -- the scenarios, in an order where each leaves the stack whole for the next -----------------


async def test_s28_a_hung_redis_never_stalls_a_tier(fabric: Fabric) -> None:
    """While Redis hangs (SIGSTOP: connections open, nothing answers), every call and every
    health check on every tier is answered: nothing on the request path, and no event loop,
    waits on Redis. Whether the hang slows them at all is bench/registry.py's figure."""
    stack = fabric.stack
    tiers = [stack.gateway, stack.router, *stack.workers]
    checks: list[tuple[bool, str, bool]] = []  # (during the pause, tier, SERVING)
    is_paused = False

    async def probe() -> None:
        while True:
            for tier in tiers:
                try:
                    is_serving = await health(tier.address, timeout_s=5.0) == SERVING
                except grpc.aio.AioRpcError:
                    is_serving = False
                checks.append((is_paused, tier.address, is_serving))
            await asyncio.sleep(0.05)  # the prober's pace

    def probed_while_paused(num_checks: int) -> bool:
        counts = {t.address: 0 for t in tiers}
        for is_during, address, _ in checks:
            counts[address] += is_during
        return min(counts.values()) >= num_checks

    prober = asyncio.create_task(probe())
    # One caller: while Redis is unreachable the router may send everything to one worker
    # (test_s25_the_load_stays_spread_while_redis_is_down), which carries one caller as fast
    # as two workers do. What is measured here is whether anything waits on Redis.
    load = Load(stack.gateway.address, concurrency=1).start()
    await load.served_more_than(40)
    paused_at = time.monotonic()
    is_paused = True
    fabric.redis.pause()
    try:
        await eventually(
            lambda: registry_is(stack, NOT_SERVING),
            timeout_s=REACTION_TIMEOUT_S,
            message="the router's registry health NOT_SERVING while Redis hangs",
        )
        # The scenario: several heartbeats and refreshes time out against the hung server.
        await hold(paused_at + STALE_AFTER_S + 1)
        # And through it, calls were answered and every tier was probed a few times.
        await eventually(
            lambda: sum(paused_at <= o.sent_s and o.error is None for o in load.outcomes) >= 10,
            timeout_s=ANSWERS_TIMEOUT_S,
            message="10 calls sent while Redis hangs were answered",
        )
        await eventually(
            lambda: probed_while_paused(3),
            timeout_s=ANSWERS_TIMEOUT_S,
            message="every tier answered 3 health checks while Redis hangs",
        )
    finally:
        is_paused = False
        fabric.redis.resume()
    await eventually(
        lambda: registry_is(stack, SERVING),
        timeout_s=REACTION_TIMEOUT_S,
        message="the router's registry health SERVING once Redis answers again",
    )
    await load.stop()
    prober.cancel()

    # Requests never touch Redis: none failed or ran into its deadline.
    assert not load.errors()[:3]
    # No event loop stalled on a Redis call: every health check was SERVING within its deadline.
    assert all(is_serving for _, _, is_serving in checks), [c for c in checks if not c[2]][:3]
    await eventually(
        lambda: live_workers(stack) == 2,
        timeout_s=REACTION_TIMEOUT_S,
        message="both workers live once Redis answers again",
    )


async def test_s26_a_worker_that_stops_heartbeating_leaves_routing_and_returns(
    fabric: Fabric,
) -> None:
    stack = fabric.stack
    victim, survivor = stack.workers[1], stack.workers[0]
    # More callers than one worker's batch, as for the return below: with a few, the first
    # worker's predicted wait may stay the lower one, and none reach the victim (seen once).
    load = Load(stack.gateway.address, concurrency=16).start()
    victim_before = routed_to(stack, victim.worker_id)
    await eventually(lambda: routed_to(stack, victim.worker_id) > victim_before)

    os.kill(victim.pid, signal.SIGSTOP)
    try:
        await eventually(
            lambda: live_workers(stack) == 1,
            timeout_s=REACTION_TIMEOUT_S,
            message="the router dropped the worker that stopped heartbeating",
        )
        victim_routed = routed_to(stack, victim.worker_id)
        survivor_routed = routed_to(stack, survivor.worker_id)
        # The first load's callers may all be waiting on calls the stopped worker holds (until
        # it continues, or keepalive gives up on it): new callers are served by the survivor.
        meanwhile = Load(stack.gateway.address, concurrency=2).start()
        await meanwhile.served_more_than(10)
        # The router counts what it routes, and the gateway may bundle both callers' calls
        # into one: ten calls served can be fewer than ten routed (seen once: nine).
        await eventually(
            lambda: routed_to(stack, survivor.worker_id) >= survivor_routed + 10,
            message="the survivor was routed ten more",
        )
        await meanwhile.stop()
        assert not meanwhile.errors()[:3]
        assert routed_to(stack, victim.worker_id) == victim_routed
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    await eventually(
        lambda: live_workers(stack) == 2,
        timeout_s=REACTION_TIMEOUT_S,
        message="the continued worker is live again",
    )
    # Back in the registry; traffic reaches it again once the router spreads load to it: more
    # callers than one worker's batch make its predicted wait the lower one at times. Calls that
    # timed out on it while stopped may have ejected it (EjectionConfig.eject_s, 10 s), which
    # the bound covers.
    returned = Load(stack.gateway.address, concurrency=16).start()
    await eventually(
        lambda: routed_to(stack, victim.worker_id) > victim_routed,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router sent the continued worker calls again",
    )
    await returned.stop()
    await load.stop()
    assert not returned.errors()[:3]
    # Calls caught on the stopped worker finish once it continues, within their deadline.
    assert not load.errors()[:3]


async def test_s35_a_new_worker_replica_gets_requests(fabric: Fabric, tmp_path: Path) -> None:
    stack = fabric.stack
    load = Load(stack.gateway.address).start()
    await load.served_more_than(20)
    password_file = stack.state_dir / "redis-acl" / password_file_name(WORKER)
    args = ("--redis-url", f"redis://127.0.0.1:{stack.redis_port}/0", "--host", "127.0.0.1",
            "--redis-password-file", str(password_file), "--worker-id", "worker-new",
            # A drain that hangs then says so, with what it waits for, well inside terminate's
            # 30 s (it once overran them, unexplained: no log said where).
            "--drain-grace-s", "5")  # fmt: skip
    extra: ServiceProcess = await asyncio.to_thread(
        start_worker, tmp_path, model_repository=fabric.model_repository, extra_args=args
    )
    try:
        await eventually(
            lambda: routed_to(stack, "worker-new") > 0,
            timeout_s=REACTION_TIMEOUT_S,
            message="the router sent the new replica calls",
        )
        # It ran them itself, over the connections the router already had to the gateway and
        # the client to the gateway.
        await eventually(
            lambda: total(scrape(extra.metrics_port), names.WORKER_ROWS_TOTAL) > 5,
            timeout_s=ANSWERS_TIMEOUT_S,
            message="the new replica ran rows",
        )
    finally:
        # Also on failure: the fabric is shared, and a load left running would count its rows
        # in the next test (s27 then saw 3 rows "run twice").
        await load.stop()
        code = extra.terminate()
    assert code == 0, extra.log()
    assert "drain did not finish" not in extra.log(), extra.log()
    assert not load.errors()[:3]
    await eventually(
        lambda: live_workers(stack) == 2,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router dropped the stopped replica",
    )


async def test_s27_redis_restarted_empty_is_refilled_by_heartbeats_and_runs_nothing_twice(
    fabric: Fabric,
) -> None:
    """How soon the heartbeats refill it (within a period) is bench/registry.py's figure."""
    stack = fabric.stack
    worker_ids = {w.worker_id for w in stack.workers}
    rows_before = rows_executed(stack)
    load = Load(stack.gateway.address).start()
    await load.served_more_than(20)

    fabric.redis.stop()
    fabric.redis.start()
    restarted_at = time.monotonic()
    await eventually(
        lambda: fabric.redis.registered_workers() == worker_ids,
        timeout_s=REACTION_TIMEOUT_S,
        message="every worker registered in the restarted Redis",
    )
    await eventually(
        lambda: router_metric(stack, names.ROUTER_REGISTRY_DEGRADED) == 0,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router reads the restarted Redis",
    )
    # The scenario, past the staleness limit: the router's workers are the refilled ones, not
    # the old snapshot's (whose heartbeats are stale by now).
    await hold(restarted_at + STALE_AFTER_S + 1)
    await eventually(
        lambda: live_workers(stack) == 2,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router's workers are the two refilled ones",
    )
    outcomes = await load.stop()

    assert not load.errors()[:3]
    assert rows_executed(stack) - rows_before == len(outcomes)


async def test_s25_redis_stopped_for_30_s_routes_from_the_snapshot_and_refills_on_return(
    fabric: Fabric,
) -> None:
    stack = fabric.stack
    tiers = [stack.gateway, stack.router, *stack.workers]
    started = {t.pid: start_time(t) for t in tiers}
    load = Load(stack.gateway.address).start()
    await load.served_more_than(20)

    fabric.redis.kill()
    killed_at = time.monotonic()
    await eventually(
        lambda: router_metric(stack, names.ROUTER_REGISTRY_DEGRADED) == 1,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router found Redis gone",
    )
    assert await health(stack.router.address, REGISTRY_HEALTH_NAME) == NOT_SERVING
    routed = {w.worker_id: routed_to(stack, w.worker_id) for w in stack.workers}
    await hold(killed_at + OUTAGE_S)  # the scenario: the outage
    # Half a minute later: still routing from the snapshot, still degraded.
    await eventually(
        lambda: sum(routed_to(stack, w) for w in routed) > sum(routed.values()) + 20,
        timeout_s=ANSWERS_TIMEOUT_S,
        message="20 calls routed from the snapshot during the outage",
    )
    assert not load.failures()
    # The gauge is set at each of the router's attempts (backoff up to 5 s apart).
    await eventually(
        lambda: router_metric(stack, names.ROUTER_REGISTRY_SNAPSHOT_AGE_SECONDS) >= OUTAGE_S - 5,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router's snapshot as old as the outage",
    )
    assert await health(stack.router.address) == SERVING
    assert await health(stack.router.address, probe_services("router.yaml")["readinessProbe"]) == (
        SERVING
    )

    fabric.redis.start()
    # Workers retry with backoff up to its cap; the router reads again within its own cap
    # (how soon: bench/registry.py's outage figures).
    worker_ids = {w.worker_id for w in stack.workers}
    await eventually(
        lambda: fabric.redis.registered_workers() == worker_ids,
        timeout_s=REACTION_TIMEOUT_S,
        message="every worker registered in the returned Redis",
    )
    await eventually(
        lambda: router_metric(stack, names.ROUTER_REGISTRY_DEGRADED) == 0,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router reads the returned Redis",
    )
    assert await health(stack.router.address, REGISTRY_HEALTH_NAME) == SERVING
    # The router's snapshot is the refilled registry, not the outage's.
    await eventually(
        lambda: router_metric(stack, names.ROUTER_REGISTRY_SNAPSHOT_AGE_SECONDS) < 2,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router's snapshot refreshed from the returned Redis",
    )
    await load.served_more_than(len(load.outcomes) + 20)
    await load.stop()

    assert not load.errors()[:3]
    # Each worker is back once its own heartbeat is (a first read may find only one).
    await eventually(
        lambda: live_workers(stack) == 2,
        timeout_s=REACTION_TIMEOUT_S,
        message="both workers live after the outage",
    )
    # No tier restarted: the same processes, started when they were before.
    assert {t.pid: start_time(t) for t in tiers} == started
    assert all(is_alive(pid) for pid in started)


async def test_s33_liveness_holds_when_redis_or_a_peer_is_down_and_readiness_drops_in_drain(
    fabric: Fabric,
) -> None:
    """Damages the stack (drains a worker, kills the router): last in the module."""
    stack = fabric.stack
    probes = {
        stack.gateway.address: probe_services("gateway.yaml"),
        stack.router.address: probe_services("router.yaml"),
        **{w.address: probe_services("gpu-worker.yaml") for w in stack.workers},
    }

    async def statuses(probe: str, addresses: list[str]) -> set[int]:
        return {await health(a, probes[a][probe]) for a in addresses}

    everyone = list(probes)
    # Redis down, past the staleness limit: every tier alive and ready. The scenario is the
    # whole window, probed throughout at the probes' pace.
    fabric.redis.kill()
    killed_at = time.monotonic()
    while time.monotonic() < killed_at + STALE_AFTER_S + 1:
        assert await statuses("livenessProbe", everyone) == {SERVING}
        assert await statuses("readinessProbe", everyone) == {SERVING}
        await asyncio.sleep(0.2)  # the probes' pace
    await eventually(
        lambda: router_metric(stack, names.ROUTER_REGISTRY_DEGRADED) == 1,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router found Redis gone",
    )
    fabric.redis.start()
    await eventually(
        lambda: live_workers(stack) == 2,
        timeout_s=REACTION_TIMEOUT_S,
        message="both workers live once Redis is back",
    )

    # A worker drains: its readiness turns NOT_SERVING while it still runs, its admitted rows
    # keeping it draining; its peers stay up and serve everything. The rows that keep it are
    # stalled ones (the stalling model's gate closed): a drain of ordinary queued rows may end
    # within milliseconds, before any probe asks. Four stalled calls over two workers, each
    # running one at a time: once all four are admitted, at least one waits in some worker's
    # queue (none may still be on its way when the drain begins: it would be refused there).
    stalled = [asyncio.ensure_future(predict_stalled(stack.gateway.address)) for _ in range(4)]
    await eventually(
        lambda: sum(stalled_admitted(w) for w in stack.workers) == len(stalled),
        timeout_s=ANSWERS_TIMEOUT_S,
        message="every stalled call admitted",
    )
    drained = next(w for w in stack.workers if stalled_queued(w) >= 1)
    peer = next(w for w in stack.workers if w is not drained)
    load = Load(stack.gateway.address, concurrency=24).start()
    readiness = health_pb2.HealthCheckRequest(service=probes[drained.address]["readinessProbe"])
    async with grpc.aio.insecure_channel(drained.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        assert (await check(readiness, timeout=5)).status == SERVING
        os.kill(drained.pid, signal.SIGTERM)
        # Polled: the standard Watch fails INTERNAL on every tier (the error-mapping interceptor
        # cannot wrap grpcio's coroutine-style Watch handler). Bounded well within the
        # executor's watchdog (30 s), which would also turn the worker NOT_SERVING.
        async with asyncio.timeout(10.0):
            while (status := (await check(readiness, timeout=5)).status) == SERVING:
                await asyncio.sleep(0.005)
        assert status == NOT_SERVING
        assert is_alive(drained.pid)  # still draining: its stalled row holds it
        assert total(scrape(drained.metrics_port), names.WORKER_WATCHDOG_EXPIRED_TOTAL) == 0
    release_stall(fabric.stall_gate)
    # Admitted work finishes in the drain: every stalled call is answered, on either worker.
    assert all(len(reply.outputs) == 1 for reply in await asyncio.gather(*stalled))
    await eventually(
        lambda: not is_alive(drained.pid), timeout_s=60, message="the drained worker exited"
    )
    others = [a for a in everyone if a != drained.address]
    assert await statuses("livenessProbe", others) == {SERVING}
    await eventually(
        lambda: live_workers(stack) == 1,
        timeout_s=REACTION_TIMEOUT_S,
        message="the router dropped the drained worker",
    )
    await load.served_more_than(len(load.outcomes) + 10)
    await load.stop()
    assert not load.errors()[:3]

    # The router dies: the gateway and the worker behind it stay alive, probed throughout a
    # window of several of the gateway's catalog refreshes (the scenario).
    os.kill(stack.router.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    alive = [stack.gateway.address, peer.address]
    while time.monotonic() < killed_at + 3 * GatewayConfig.catalog_refresh_s + 1:
        assert await statuses("livenessProbe", alive) == {SERVING}
        await asyncio.sleep(0.2)  # the probes' pace
