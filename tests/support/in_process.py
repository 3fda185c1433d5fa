"""The fabric inside the test process: real workers, a router and (optionally) a gateway, each a
grpc.aio server on port 0 over a real redis-server, so that a test can call them over the network
and read their state and metrics directly."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, generate_latest

from services.common import metric_names as names
from services.common.lifecycle import task_stacks
from services.gateway.config import GatewayConfig
from services.gateway.server import Gateway, create_gateway
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.config import HeartbeatConfig, WorkerConfig
from services.gpu_worker.hot_swap import ModelSwapper
from services.gpu_worker.server import Worker, create_worker
from services.router.config import RouterConfig
from services.router.server import Router, create_router
from tests.support.metrics import total
from tests.support.models import release_stall, write_affine_model, write_stalling_model
from tests.support.processes import health_status
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

#: Heartbeat, registry refresh and catalog refresh period: short, so that the fabric is ready fast.
PERIOD_S = 0.05
#: How long the fabric may take to become ready (generous: the machine is shared).
READY_TIMEOUT_S = 30.0


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`, as Prometheus reads them."""
    return total(generate_latest(registry).decode(), name, **labels)


@dataclass
class Fabric:
    """A router, its in-process workers and the gateway in front of it (if the test asked for one);
    workers the test runs as processes on the same Redis are not listed here."""

    router: Router
    workers: list[Worker]
    _gateway: Gateway | None = None
    #: Routers beside `router` on the same Redis (the gateway calls them all).
    more_routers: list[Router] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def gateway(self) -> Gateway:
        if self._gateway is None:
            raise RuntimeError("this fabric was started with_gateway=False")
        return self._gateway

    @property
    def worker(self) -> Worker:
        """The only in-process worker."""
        (worker,) = self.workers
        return worker

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def router_address(self) -> str:
        return f"127.0.0.1:{self.router.port}"

    def router_metric(self, name: str, **labels: str) -> float:
        return metric(self.router.metrics.registry, name, **labels)

    def gateway_metric(self, name: str, **labels: str) -> float:
        return metric(self.gateway.metrics.registry, name, **labels)

    def worker_metric(self, name: str, **labels: str) -> float:
        """Summed over the in-process workers."""
        return sum(metric(w.metrics.registry, name, **labels) for w in self.workers)


async def start_in_process_worker(
    repository: Path, redis_server: RedisServer, worker_id: str
) -> Worker:
    """A loaded worker serving `repository`, heartbeating into `redis_server` every `PERIOD_S`."""
    worker = await create_worker(
        WorkerConfig(
            model_repository=repository,
            grpc_port=0,
            metrics_port=0,
            redis_url=redis_server.worker_url,
            worker_id=worker_id,
            heartbeat=HeartbeatConfig(period_s=PERIOD_S),
        )
    )
    await worker.load()
    return worker


async def start_lone_worker(repository: Path, watchdog_s: float) -> Worker:
    """A loaded worker serving `repository` on port 0, with no Redis, whose executor watchdog
    is `watchdog_s`."""
    worker = await create_worker(
        WorkerConfig(
            model_repository=repository,
            grpc_port=0,
            metrics_port=0,
            batching=DriverConfig(watchdog_s=watchdog_s),
        )
    )
    await worker.load()
    return worker


def swapper_for(worker: Worker, watchdog_s: float = 30.0) -> ModelSwapper:
    """A swapper loading and unloading versions on `worker`'s CPU batching driver (as its own
    follower's would, for a worker started without Redis); what it finds fatal stops the
    worker serving, as there."""
    assert worker.models is not None and worker.batching is not None
    return ModelSwapper(
        models=worker.models,
        batching=worker.batching,
        device=torch.device("cpu"),
        worker_metrics=worker.metrics,
        generation_metrics=worker.generation_metrics,
        on_fatal=worker.on_fatal,
        on_change=lambda: None,
        watchdog_s=watchdog_s,
    )


#: A router address nothing listens on, for gateways whose tests end at the gateway.
NO_ROUTER = "127.0.0.1:1"


async def start_lone_gateway(repository: Path, **settings: Any) -> Gateway:
    """A gateway on port 0 with no router behind it, for what the gateway decides before any
    downstream call (auth, limits, TLS). `settings` are further GatewayConfig fields."""
    return await create_gateway(
        GatewayConfig(
            model_repository=repository,
            router_address=NO_ROUTER,
            grpc_port=0,
            metrics_port=0,
            http_port=0,
            **settings,
        )
    )


@contextlib.asynccontextmanager
async def running_fabric(
    repository: Path,
    redis_server: RedisServer,
    *,
    num_workers: int = 1,
    num_live_workers: int | None = None,
    with_gateway: bool = True,
    num_routers: int = 1,
    gateway_settings: Mapping[str, Any] | None = None,
    **router_settings: Any,
) -> AsyncIterator[Fabric]:
    """`num_workers` in-process workers (`w0`, `w1`, ...) over `repository`, a router and, unless
    `with_gateway` is False, a gateway (no API keys), all ready: the router sees
    `num_live_workers` (default `num_workers`; count any the test runs as processes on the same
    Redis), the gateway serves every model in `repository` and reports SERVING.

    `router_settings` are `RouterConfig` fields (`routing`, `worker_networks`, ...); the registry
    refresh period defaults to `PERIOD_S`. `gateway_settings`: more GatewayConfig fields."""
    workers = [
        await start_in_process_worker(repository, redis_server, f"w{i}") for i in range(num_workers)
    ]
    router_settings.setdefault("refresh_period_s", PERIOD_S)
    routers = [
        await create_router(
            RouterConfig(
                redis_url=redis_server.router_url, grpc_port=0, metrics_port=0, **router_settings
            )
        )
        for _ in range(num_routers)
    ]
    fabric = Fabric(routers[0], workers, more_routers=routers[1:])
    for router in routers:
        fabric._tasks.append(asyncio.create_task(router.sync.run(), name="registry-sync"))
    expected_live = num_workers if num_live_workers is None else num_live_workers
    try:
        if with_gateway:
            fabric._gateway = await create_gateway(
                GatewayConfig(
                    model_repository=repository,
                    router_address=",".join(f"127.0.0.1:{r.port}" for r in routers),
                    grpc_port=0,
                    metrics_port=0,
                    http_port=0,
                    catalog_refresh_s=PERIOD_S,
                    allow_unauthenticated=True,
                    **(gateway_settings or {}),
                )
            )
            fabric._tasks.append(
                asyncio.create_task(fabric.gateway.refresh_catalog(), name="catalog")
            )
        # Heartbeat reads and catalog refreshes happen in background loops: poll.
        await eventually(
            lambda: _is_ready(fabric, repository, expected_live),
            timeout_s=READY_TIMEOUT_S,
            message="the fabric did not become ready",
        )
        yield fabric
    finally:
        hung: list[str] = []
        if fabric._gateway is not None:
            await _stop_within("the gateway", fabric._gateway.stop(), hung)
        for router in routers:
            await _stop_within("the router", router.stop(), hung)
        await _cancel_within(fabric._tasks, hung)
        for worker in workers:
            await _stop_within(f"worker {worker.config.worker_id}", worker.stop(), hung)
        if hung:
            raise AssertionError("teardown: " + "\n".join(hung))


#: How long one tier may take to stop at teardown (its drain grace is 10-30 s) before the test
#: fails naming it, with every asyncio task's stack: a hung stop otherwise shows only as the
#: suite's timeout and a dump of idle threads. Four such waits plus the test stay inside
#: pytest-timeout's 300 s.
STOP_TIMEOUT_S = 50.0


async def _stop_within(what: str, stop: Awaitable[Any], hung: list[str]) -> None:
    """Awaits `stop` for at most STOP_TIMEOUT_S; past it, leaves it running and adds `what`
    and every task's stack to `hung` (so the other tiers are still stopped)."""
    task = asyncio.ensure_future(stop)
    done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
    if task in done:
        task.result()
        return
    hung.append(f"{what} did not stop within {STOP_TIMEOUT_S:.0f}s; tasks:\n{task_stacks()}")


#: How often a background task still running after its cancellation is cancelled again.
RECANCEL_PERIOD_S = 0.5


async def _cancel_within(tasks: list[asyncio.Task[Any]], hung: list[str]) -> None:
    """Cancels `tasks` (the registry sync and the catalog refresh: endless loops that go on
    after an error) until they end, for at most STOP_TIMEOUT_S; past it, adds the names and
    stacks of those still running to `hung`.

    Cancelled again every RECANCEL_PERIOD_S: both loops log an error and go on, so a
    cancellation that a client library turns into its own error (an RPC ending CANCELLED, a
    Redis read failing) is lost, and one lost cancel held this teardown for its whole bound
    in a full-suite run."""
    deadline_s = time.monotonic() + STOP_TIMEOUT_S
    pending = {task for task in tasks if not task.done()}
    while pending and time.monotonic() < deadline_s:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_PERIOD_S)
    if pending:
        stacks = io.StringIO()
        for task in pending:
            print(f"-- {task.get_name()}", file=stacks)
            task.print_stack(file=stacks)
        hung.append(f"tasks still running {STOP_TIMEOUT_S:.0f}s after cancel:\n{stacks.getvalue()}")


async def _is_ready(fabric: Fabric, repository: Path, num_live_workers: int) -> bool:
    for router in (fabric.router, *fabric.more_routers):
        if metric(router.metrics.registry, names.ROUTER_LIVE_WORKERS) != num_live_workers:
            return False
    if fabric._gateway is None:
        return True
    models = [path.name for path in repository.iterdir() if (path / "config.toml").exists()]
    return all(fabric.gateway.catalog.served_versions(model) for model in models) and (
        await health_status(fabric.gateway_address) == health_pb2.HealthCheckResponse.SERVING
    )


@contextlib.asynccontextmanager
async def affine_and_stall_fabric(
    tmp_path: Path, redis_server: RedisServer, **settings: Any
) -> AsyncIterator[Fabric]:
    """`running_fabric` (with `settings`) over the affine model and the `stall` model
    (tests/support/models.py), whose calls with a STALL row hold the worker's executor until
    `release_stall(tmp_path / "gate")`; the gate is opened when the fabric stops too."""
    gate = tmp_path / "gate"
    write_affine_model(tmp_path / "repo", slo_p99_ms=30_000)
    write_stalling_model(tmp_path / "repo", gate)
    try:
        async with running_fabric(tmp_path / "repo", redis_server, **settings) as fabric:
            yield fabric
    finally:
        release_stall(gate)
