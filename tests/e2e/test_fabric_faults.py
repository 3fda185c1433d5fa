"""Faults under load, end to end: each test kills a part of its own stack (a worker, Redis),
so no other test runs on what it leaves behind."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from services.common import metric_names as names
from tests.support.fabric_load import routed_to, run_load
from tests.support.metrics import samples, scrape, total
from tests.support.models import write_minilm_repository
from tests.support.processes import health_status
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """A fresh two-worker stack per test. SLO 30 s: these tests are about losing nothing when
    parts fail, under load two CPU cores cannot serve within the default 250 ms."""
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=30_000)
    stack = start_stack(tmp_path, num_workers=2, model_repository=repository, tolerate_exits=True)
    yield stack
    assert stack.stop() == 0, stack.stop_report()


async def test_s21_worker_killed_under_load_loses_no_request(stack: Stack) -> None:
    victim = stack.workers[1]
    survivor = stack.workers[0]
    load = asyncio.ensure_future(run_load(stack.gateway.address, seconds=8.0))
    await asyncio.sleep(2.0)  # the scenario: the kill lands mid-load
    os.kill(victim.pid, signal.SIGKILL)
    results = await load
    failures = [r for r in results if r is not None]
    assert len(results) > 50
    assert not failures, failures[:3]

    # The router stops choosing it within the heartbeat TTL (3 s) plus one refresh.
    def router_sees_one_worker() -> bool:
        live = samples(scrape(stack.router.metrics_port), names.ROUTER_LIVE_WORKERS)
        return bool(live) and live[0][1] == 1

    await eventually(router_sees_one_worker, timeout_s=10.0)
    routed_before = routed_to(stack, victim.worker_id)
    survivor_before = routed_to(stack, survivor.worker_id)
    assert not [r for r in await run_load(stack.gateway.address, seconds=2.0) if r is not None]
    assert routed_to(stack, victim.worker_id) == routed_before
    assert routed_to(stack, survivor.worker_id) > survivor_before
    live = samples(scrape(stack.router.metrics_port), names.ROUTER_LIVE_WORKERS)
    assert live and live[0][1] == 1


async def test_s25_redis_stopped_under_load_requests_keep_succeeding(stack: Stack) -> None:
    load = asyncio.ensure_future(run_load(stack.gateway.address, seconds=6.0))
    await asyncio.sleep(1.0)  # the scenario: the kill lands mid-load
    os.kill(stack.redis_pid, signal.SIGKILL)
    results = await load
    assert len(results) > 30
    assert not [r for r in results if r is not None]
    # Degraded, not dead: liveness stays SERVING, the registry check says NOT_SERVING.
    assert await health_status(stack.router.address) == health_pb2.HealthCheckResponse.SERVING
    assert (
        await health_status(stack.router.address, "fabric.registry")
        == health_pb2.HealthCheckResponse.NOT_SERVING
    )
    assert total(scrape(stack.router.metrics_port), names.ROUTER_REGISTRY_DEGRADED) == 1
