"""Faults under load, end to end, on one two-worker stack: the first test kills a worker, the
last kills Redis (the one worker left is all it needs). Tests run in file order."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health_pb2

from services.common import metric_names as names
from tests.support.fabric_load import ANSWERS_TIMEOUT_S, routed_to
from tests.support.fabric_load import ClosedLoopLoad as Load
from tests.support.metrics import samples, scrape, total
from tests.support.models import write_small_minilm_repository
from tests.support.processes import health_status
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """SLO 30 s: these tests are about losing nothing when parts fail, under load two CPU cores
    cannot serve within the default 250 ms; `tolerate_exits`: the tests kill parts of it."""
    tmp_path = tmp_path_factory.mktemp("faults")
    repository = write_small_minilm_repository(tmp_path / "repo")
    stack = start_stack(tmp_path, num_workers=2, model_repository=repository, tolerate_exits=True)
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def live_workers(stack: Stack) -> float | None:
    live = samples(scrape(stack.router.metrics_port), names.ROUTER_LIVE_WORKERS)
    return live[0][1] if live else None


async def test_s21_worker_killed_under_load_loses_no_request(stack: Stack) -> None:
    victim = stack.workers[1]
    survivor = stack.workers[0]
    load = Load(stack.gateway.address)
    # The scenario: the kill lands mid-load, once calls are flowing to the victim.
    await load.answered(30, "before the kill")
    await eventually(
        lambda: routed_to(stack, victim.worker_id) > 0,
        timeout_s=ANSWERS_TIMEOUT_S,
        message="the router sent the victim calls before the kill",
    )
    os.kill(victim.pid, signal.SIGKILL)
    await load.answered(50, "after the kill")
    results = await load.stop()
    failures = [r for r in results if r is not None]
    assert not failures, failures[:3]

    # The router stops choosing it once its heartbeat goes stale (3 s) and a refresh reads it.
    await eventually(
        lambda: live_workers(stack) == 1, timeout_s=60.0, message="the router dropped the victim"
    )
    routed_before = routed_to(stack, victim.worker_id)
    survivor_before = routed_to(stack, survivor.worker_id)
    after = Load(stack.gateway.address)
    await after.answered(20, "once the router had dropped the victim")
    assert not [r for r in await after.stop() if r is not None]
    assert routed_to(stack, victim.worker_id) == routed_before
    assert routed_to(stack, survivor.worker_id) > survivor_before
    assert live_workers(stack) == 1


async def test_s25_redis_stopped_under_load_requests_keep_succeeding(stack: Stack) -> None:
    """Kills the stack's Redis: last in the module."""
    load = Load(stack.gateway.address)
    await load.answered(20, "before the kill")  # the scenario: the kill lands mid-load
    os.kill(stack.redis_pid, signal.SIGKILL)
    await eventually(
        lambda: total(scrape(stack.router.metrics_port), names.ROUTER_REGISTRY_DEGRADED) == 1,
        timeout_s=60.0,
        message="the router found Redis unreachable",
    )
    await load.answered(30, "with Redis gone")
    results = await load.stop()
    assert not [r for r in results if r is not None]
    # Degraded, not dead: liveness stays SERVING, the registry check says NOT_SERVING.
    assert await health_status(stack.router.address) == health_pb2.HealthCheckResponse.SERVING
    assert (
        await health_status(stack.router.address, "fabric.registry")
        == health_pb2.HealthCheckResponse.NOT_SERVING
    )
