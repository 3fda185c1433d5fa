"""A tenant flooding far past the fleet's capacity while another sends within its quota (issue 12;
RELIABILITY.md 4), the whole stack as separate processes.

A deployment runs GPU workers on nodes of their own and the gateway tier on others; on one
machine the launcher pins them apart (`--cpus`): the worker on one CPU, the CPU tiers, this
test's client and the flooding client on another. The flood (64 callers back to back, retry
hints ignored, in its own process) is refused by its quota at the gateway, before the request
body is parsed; the victim's open-loop traffic is sent alone, then beside the flood.

Asserted on statuses and counts: the victim's every call is served, the flood is refused with a
retry hint. The pinning presumes the machine: the test is `solo` (`make test` runs it after the
parallel tests), since beside another module's stack the pinned worker's CPU is shared, its
queue grows past the flood's admitted calls' 1 s deadline, and it rightly refuses victim rows
that would make those late (a CI run saw 11 of 189). The figures (the victim's good share
within the SLO and p99 beside the flood against alone, the flood's rate as a multiple of
capacity) are `make bench-tenants`' (bench/fabric/tenants.py).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from bench.fabric.loadgen import OK, Outcome, arrival_schedule, noting_errors, run_open_loop
from bench.fabric.targets import make_texts
from bench.fabric.tenants import FloodProcess, keys_toml, sender
from services.common import metric_names as names
from services.common.errors import RETRY_AFTER_MS_KEY
from tests.support.metrics import scrape, total
from tests.support.models import write_small_minilm_repository
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.solo]

MODEL = "minilm"
TEXTS = make_texts(256, 3)
#: The victim sends at VICTIM_RATE_PER_S against a quota twice that, a fraction of what the
#: pinned worker serves (about 200 short texts/s with its CPU to itself): every call fits. The
#: flood's quota is a sliver, so nearly all it sends is refused and what it is admitted barely
#: loads the worker.
VICTIM_RATE_PER_S, VICTIM_QUOTA_PER_S, FLOOD_QUOTA_PER_S = 20.0, 40.0, 5.0
WINDOW_S = 10.0
#: The victim's deadline: far past what a call takes, so that a neighbour on the shared cores
#: makes answers late, not failed; what is checked is that the flood costs the victim no call.
VICTIM_TIMEOUT_S = 5.0
#: Refusals of the flood's calls at the gateway that show it is running (before the victim's
#: window); one gateway process refuses about 800-900 calls/s here.
FLOOD_RUNNING_REFUSALS = 200
#: The flood refused at least this many times the victim's calls during the victim's window:
#: that it was a flood, not a trickle (the benchmark reports its rate against capacity).
MIN_FLOOD_PER_VICTIM_CALL = 5
CPUS = sorted(os.sched_getaffinity(0))
#: The CPU tiers, this client and the flood share this CPU; the worker has the other one.
CPU_TIERS_CPU, WORKER_CPU = CPUS[0], CPUS[-1]


@dataclass(frozen=True)
class FloodRun:
    alone: list[Outcome]
    beside_flood: list[Outcome]
    flood_statuses: Counter[str]
    #: A burst of the flooding tenant's calls sent from here after the flood: their errors.
    refusals: list[grpc.aio.AioRpcError]
    #: The flood's calls refused at the gateway during the victim's window beside it.
    refused_at_gateway: float
    #: What each of the victim's failed calls was told (none expected): who refused it.
    victim_errors: list[str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    """The small minilm config (SLO 30 s): what is asserted is the quota's isolation, in
    statuses. Under the default 250 ms a CI run once saw the worker rightly refuse one of the
    victim's calls as predicted past its SLO (the CI machine's two cores are shared with other
    tests). The victim's share within the SLO is `make bench-tenants`'."""
    tmp = tmp_path_factory.mktemp("flood")
    keys = tmp / "api-keys.toml"
    keys.write_text(keys_toml({}))
    stack = start_stack(
        tmp,
        model_repository=write_small_minilm_repository(tmp / "repo"),
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
        keys.write_text(keys_toml({"victim": VICTIM_QUOTA_PER_S, "flood": FLOOD_QUOTA_PER_S}))
        flooding = sender(channel, "flood", TEXTS, VICTIM_TIMEOUT_S)

        async def quota_in_force() -> bool:
            burst = await asyncio.gather(*(_error_of(flooding) for _ in range(20)))
            return any(_is_quota_refusal(e) for e in burst)

        await eventually(
            quota_in_force, timeout_s=30.0, interval_s=0.2,
            message="the gateway did not reload its keys file (no quota refusal of 'flood')",
        )  # fmt: skip
        victim_errors: list[str] = []
        victim = noting_errors(sender(channel, "victim", TEXTS, VICTIM_TIMEOUT_S), victim_errors)
        alone = await run_open_loop(victim, arrival_schedule(VICTIM_RATE_PER_S, WINDOW_S, 5))
        refused_at_start = _refused_at_gateway(stack)
        flood = FloodProcess(address, TEXTS, 1.0)
        try:
            await eventually(
                lambda: _refused_at_gateway(stack) - refused_at_start >= FLOOD_RUNNING_REFUSALS,
                timeout_s=60.0,
                message=f"the flood was not refused {FLOOD_RUNNING_REFUSALS} times at the gateway",
            )
            refused_before = _refused_at_gateway(stack)
            beside = await run_open_loop(victim, arrival_schedule(VICTIM_RATE_PER_S, WINDOW_S, 6))
            refused = _refused_at_gateway(stack) - refused_before
        finally:
            statuses = await flood.stop()
        burst = await asyncio.gather(*(_error_of(flooding) for _ in range(40)))
    return FloodRun(
        alone=alone,
        beside_flood=beside,
        flood_statuses=statuses,
        refusals=[e for e in burst if e is not None],
        refused_at_gateway=refused,
        victim_errors=victim_errors,
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


def _is_quota_refusal(error: grpc.aio.AioRpcError | None) -> bool:
    return (
        error is not None
        and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "tenant 'flood' is over its quota" in (error.details() or "")
    )


def _is_door_refusal(error: grpc.aio.AioRpcError) -> bool:
    return error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (
        "this caller sent at least its share" in (error.details() or "")
    )


def describe(run: FloodRun) -> str:
    def side(outcomes: list[Outcome]) -> str:
        slowest_ms = max((o.latency_s for o in outcomes), default=0.0) * 1000
        return f"{dict(Counter(o.status for o in outcomes))}, slowest {slowest_ms:.0f} ms"

    return (
        f"flood refused at the gateway {run.refused_at_gateway:.0f} times in the window, "
        f"statuses {dict(run.flood_statuses)}; victim alone: {side(run.alone)}; beside the "
        f"flood: {side(run.beside_flood)}; the victim's errors: {dict(Counter(run.victim_errors))}"
    )


def test_a_tenant_within_its_quota_is_served_beside_a_flood(flood_run: FloodRun) -> None:
    """Every call the victim sends, alone and beside the flood, is answered OK: the flood is
    refused at the gateway, and costs the victim no refusal and no missed deadline. The premise:
    the flood was refused many times over what the victim sent in the same window."""
    print(describe(flood_run))
    assert flood_run.alone and flood_run.beside_flood, describe(flood_run)
    min_refused = MIN_FLOOD_PER_VICTIM_CALL * len(flood_run.beside_flood)
    assert flood_run.refused_at_gateway >= min_refused, describe(flood_run)
    assert all(o.status == OK for o in flood_run.alone), describe(flood_run)
    assert all(o.status == OK for o in flood_run.beside_flood), describe(flood_run)


def test_the_flood_is_refused_at_the_gateway_with_a_retry_hint(flood_run: FloodRun) -> None:
    """Nearly all the flood's calls are refused RESOURCE_EXHAUSTED (its quota admits a sliver),
    and each refusal names the quota and carries a retry hint. Right after the flood, the
    gateway's door (services.common.door) may still hold a lowered limit: it may refuse some of
    a burst from the flooding tenant, over its share, with a hint of its own."""
    statuses = flood_run.flood_statuses
    assert sum(statuses.values()) > 0, statuses  # the flood ran (an empty count passed)
    assert statuses["RESOURCE_EXHAUSTED"] >= 0.9 * sum(statuses.values()), statuses
    assert len(flood_run.refusals) >= 30, flood_run.refusals
    over_quota = [e for e in flood_run.refusals if _is_quota_refusal(e)]
    assert over_quota, flood_run.refusals
    for error in flood_run.refusals:
        assert _is_quota_refusal(error) or _is_door_refusal(error), error
        assert int(dict(error.trailing_metadata() or ())[RETRY_AFTER_MS_KEY]) > 0
