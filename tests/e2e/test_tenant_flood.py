"""A tenant flooding far past the fleet's capacity while another sends at its quota (issue 12;
RELIABILITY.md 4), the whole stack as separate processes.

A deployment runs GPU workers on nodes of their own and the gateway tier on others; on one
machine the launcher pins them apart (`--cpus`): the worker on one CPU, the CPU tiers, this
test's client and the flooding client on another. The flood (64 callers back to back, retry
hints ignored, in its own process) is refused by its quota at the gateway, before the request
body is parsed; the victim's open-loop traffic is measured alone, then beside the flood.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.fabric.loadgen import OK, Outcome, poisson_schedule, run_closed_loop, run_open_loop
from bench.fabric.targets import make_texts
from bench.fabric.tenants import FloodProcess, keys_toml, sender
from services.common import metric_names as names
from services.common.errors import RETRY_AFTER_MS_KEY
from services.common.model_repository import load_repository
from tests.support.metrics import scrape, total
from tests.support.processes import REPO_ROOT
from tests.support.stack import Stack, start_stack

pytestmark = pytest.mark.e2e

MODEL = "minilm"
SLO_S = next(
    v.config.slo_s for v in load_repository(REPO_ROOT / "models") if v.config.name == MODEL
)
TEXTS = make_texts(256, 3)
#: The victim sends at VICTIM_SHARE of capacity against a quota of QUOTA_SHARE; the flood's
#: quota is a sliver, so nearly all it sends is refused and what it is admitted barely loads
#: the worker.
VICTIM_SHARE, VICTIM_QUOTA_SHARE, FLOOD_QUOTA_SHARE = 0.3, 0.4, 0.05
WINDOW_S = 20.0
#: The flood must reach at least this multiple of capacity for the test to mean anything. One
#: gateway process on one CPU refuses about 800-900 calls/s (4-4.5x this capacity): a second
#: flooding process only makes it refuse fewer, so the issue's 10x needs more gateway CPU
#: (in a deployment, the gateway tier's CPU autoscaling).
MIN_FLOOD_FACTOR = 3.0
CPUS = sorted(os.sched_getaffinity(0))
#: The CPU tiers, this client and the flood share this CPU; the worker has the other one.
CPU_TIERS_CPU, WORKER_CPU = CPUS[0], CPUS[-1]


@dataclass(frozen=True)
class FloodRun:
    capacity_per_s: float
    alone: list[Outcome]
    beside_flood: list[Outcome]
    flood_statuses: Counter[str]
    flood_per_s: float
    #: A burst of the flooding tenant's calls sent from here after the flood: their errors.
    refusals: list[grpc.aio.AioRpcError]
    refused_at_gateway: float


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    tmp = tmp_path_factory.mktemp("flood")
    keys = tmp / "api-keys.toml"
    keys.write_text(keys_toml({}))
    stack = start_stack(
        tmp,
        extra_gateway_args=(f"--api-keys-file={keys}",),
        extra_worker_args=("--torch-threads=1",),
        launcher_args=(
            "--cpus", f"worker={WORKER_CPU}",
            "--cpus", f"gateway,router,redis,jobs={CPU_TIERS_CPU}",
        ),
    )  # fmt: skip
    yield stack, keys
    assert stack.stop() == 0, stack.stop_report()


@pytest.fixture(scope="module")
def flood_run(stack: tuple[Stack, Path]) -> FloodRun:
    own_cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {CPU_TIERS_CPU})  # the flood's process inherits it
    try:
        return asyncio.run(_measure(*stack))
    finally:
        os.sched_setaffinity(0, own_cpus)


async def _measure(stack: Stack, keys: Path) -> FloodRun:
    address = stack.gateway.address
    async with grpc.aio.insecure_channel(address) as channel:
        probe = sender(channel, "probe", TEXTS, 30.0)
        await run_closed_loop(probe, concurrency=8, duration_s=2.0)
        window = await run_closed_loop(probe, concurrency=8, duration_s=5.0)
        capacity = sum(s <= SLO_S for s in window.latencies_s) / window.elapsed_s
        keys.write_text(
            keys_toml(
                {"victim": VICTIM_QUOTA_SHARE * capacity, "flood": FLOOD_QUOTA_SHARE * capacity}
            )
        )
        await asyncio.sleep(2.0)  # the gateway re-reads its keys file within a second
        victim = sender(channel, "victim", TEXTS, 1.0)
        schedule = poisson_schedule(VICTIM_SHARE * capacity, WINDOW_S, seed=5)
        alone = await run_open_loop(victim, schedule)
        flood = FloodProcess(address, TEXTS, 1.0)
        try:
            await asyncio.sleep(2.0)  # the flood is running at full rate
            started_s = time.monotonic()
            refused_before = _refused_at_gateway(stack)
            beside = await run_open_loop(victim, poisson_schedule(
                VICTIM_SHARE * capacity, WINDOW_S, seed=6))  # fmt: skip
            refused = _refused_at_gateway(stack) - refused_before
            elapsed_s = time.monotonic() - started_s
        finally:
            statuses = await flood.stop()
        flooding = sender(channel, "flood", TEXTS, 5.0)
        burst = await asyncio.gather(*(_error_of(flooding) for _ in range(40)))
    return FloodRun(
        capacity_per_s=capacity,
        alone=alone,
        beside_flood=beside,
        flood_statuses=statuses,
        flood_per_s=refused / elapsed_s,
        refusals=[e for e in burst if e is not None],
        refused_at_gateway=refused,
    )


def _refused_at_gateway(stack: Stack) -> float:
    return total(
        scrape(stack.gateway.metrics_port),
        names.GATEWAY_TENANT_REFUSED_TOTAL,
        tenant="flood",
        reason="requests_per_s",
    )


async def _error_of(send: object) -> grpc.aio.AioRpcError | None:
    try:
        await send()  # type: ignore[operator]
    except grpc.aio.AioRpcError as error:
        return error
    return None


def good_share(outcomes: list[Outcome]) -> float:
    return sum(o.status == OK and o.latency_s <= SLO_S for o in outcomes) / len(outcomes)


def p99_s(outcomes: list[Outcome]) -> float:
    return float(np.percentile([o.latency_s for o in outcomes if o.status == OK], 99))


def describe(run: FloodRun) -> str:
    return (
        f"capacity {run.capacity_per_s:.0f}/s; flood refused at the gateway "
        f"{run.flood_per_s:.0f}/s ({run.flood_per_s / run.capacity_per_s:.1f}x capacity), "
        f"statuses {dict(run.flood_statuses)}; victim alone: {good_share(run.alone):.1%} good, "
        f"p99 {p99_s(run.alone) * 1000:.0f} ms; beside the flood: "
        f"{good_share(run.beside_flood):.1%} good, p99 {p99_s(run.beside_flood) * 1000:.0f} ms, "
        f"statuses {dict(Counter(o.status for o in run.beside_flood))}"
    )


def test_a_tenant_at_its_quota_is_served_within_the_slo_beside_a_flood(flood_run: FloodRun) -> None:
    print(describe(flood_run))
    assert flood_run.flood_per_s >= MIN_FLOOD_FACTOR * flood_run.capacity_per_s, describe(flood_run)
    assert good_share(flood_run.alone) >= 0.99, describe(flood_run)
    assert good_share(flood_run.beside_flood) >= 0.99, describe(flood_run)


def test_the_flood_is_refused_at_the_gateway_with_a_retry_hint(flood_run: FloodRun) -> None:
    statuses = flood_run.flood_statuses
    assert statuses["RESOURCE_EXHAUSTED"] >= 0.9 * sum(statuses.values()), statuses
    assert len(flood_run.refusals) >= 30, flood_run.refusals
    for error in flood_run.refusals:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'flood' is over its quota" in (error.details() or "")
        assert int(dict(error.trailing_metadata() or ())[RETRY_AFTER_MS_KEY]) > 0


@pytest.mark.xfail(
    reason="known gap (issue 12), measured on 2 cores with the tiers pinned apart: the victim's "
    "p99 beside a flood of 4.5x capacity was 3x its p99 alone (36 -> 109 ms; 40 -> 190 ms with "
    "two flooding processes, which saturate the gateway). "
    "Each refused call costs the gateway's one event-loop thread about 0.5 ms of CPU, so the "
    "flood keeps it about 94% busy and the victim's calls queue behind the flood's; the "
    "flooding client shares that CPU too",
    strict=False,
)
def test_the_victims_p99_beside_the_flood_stays_within_10_percent_of_alone(
    flood_run: FloodRun,
) -> None:
    assert p99_s(flood_run.beside_flood) <= 1.1 * p99_s(flood_run.alone), describe(flood_run)
