"""Admission and overload as traffic really arrives: from cold, in bursts, with mixed lengths and
past capacity. Each test runs `python -m services.local_stack` as `make run` does, with the
default model repository, and calls it as a user would (the stock Triton client for the burst).

Capacity is measured here, on this machine, with a closed loop on a warm stack: these tests are
about behaviour (no lockout, no collapse), not speed, and must hold on a slow CI machine too.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from bench.fabric.loadgen import OK, Outcome, poisson_schedule, run_closed_loop, run_open_loop
from bench.fabric.targets import make_mixed_texts
from services.common.model_repository import load_repository
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.kserve import run_kserve_client
from tests.support.processes import REPO_ROOT, health_status
from tests.support.stack import start_stack

pytestmark = pytest.mark.e2e

MODEL = "minilm"
SLO_S = next(
    v.config.slo_s for v in load_repository(REPO_ROOT / "models") if v.config.name == MODEL
)
#: What a patient caller allows: far past the SLO, as the issue's stock-client user did.
PATIENT_TIMEOUT_S = 30.0
#: The open-loop callers' deadline: past the SLO (late answers are seen as late, not cut off),
#: short enough that a flood cannot queue more than a second of work.
OPEN_LOOP_TIMEOUT_S = 1.0
TEXTS = make_mixed_texts(512, seed=11)
CALIBRATION_CALLERS = 8


def sender(channel: grpc.aio.Channel, texts: Sequence[str], timeout_s: float):
    stub = api_grpc.InferenceServiceStub(channel)
    requests = [
        api.PredictRequest(model_name=MODEL, inputs=[api.PredictInput(text=t)]) for t in texts
    ]
    counter = iter(range(1 << 62))

    async def send() -> None:
        await stub.Predict(requests[next(counter) % len(requests)], timeout=timeout_s)

    return send


def good_share(outcomes: Sequence[Outcome]) -> float:
    """Share of outcomes that are OK within the SLO."""
    good = sum(o.status == OK and o.latency_s <= SLO_S for o in outcomes)
    return good / len(outcomes)


def describe(outcomes: Sequence[Outcome]) -> str:
    statuses = Counter(o.status for o in outcomes)
    late = [o for o in outcomes if o.status == OK and o.latency_s > SLO_S]
    by_second = Counter(int(o.scheduled_s) for o in late)
    worst_ms = round(max((o.latency_s for o in late), default=0.0) * 1000)
    return (
        f"{len(outcomes)} requests: {dict(statuses)}, {len(late)} OK but past the SLO"
        f" (by second sent: {dict(sorted(by_second.items()))}, worst {worst_ms} ms)"
    )


@pytest.fixture(scope="module")
def capacity_per_s(tmp_path_factory: pytest.TempPathFactory) -> float:
    """Capacity at the SLO, estimated from a warm stack on the mixed texts with 8 closed-loop
    callers (latency stays near the SLO's knee; with many patient callers, throughput keeps
    rising with latencies far past the SLO, which is not capacity an SLO service can offer):
    answers within the SLO per second, the lower of two windows, so that one lucky window on
    a shared 2-core machine does not set a rate the stack cannot hold. That stack is stopped
    before the tests run: each test's stack has the machine to itself."""
    stack = start_stack(tmp_path_factory.mktemp("calibration"))

    async def measure() -> float:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            send = sender(channel, TEXTS, PATIENT_TIMEOUT_S)
            await run_closed_loop(send, concurrency=CALIBRATION_CALLERS, duration_s=2.0)
            windows = [
                await run_closed_loop(send, concurrency=CALIBRATION_CALLERS, duration_s=4.0)
                for _ in range(2)
            ]
        return min(sum(s <= SLO_S for s in w.latencies_s) / w.elapsed_s for w in windows)

    try:
        capacity = asyncio.run(measure())
    finally:
        assert stack.stop() == 0, stack.stop_report()
    assert capacity > 5, f"the stack served {capacity:.1f} requests/s"
    return capacity


def test_a_burst_on_a_fresh_stack_is_served_whole_and_nothing_locks_out(tmp_path: Path) -> None:
    """The issue's first report: 64 concurrent mixed-length calls with a 30 s deadline, the
    moment the stack is ready, through the stock Triton client; then single calls."""
    stack = start_stack(tmp_path)
    try:
        report = run_kserve_client(
            stack.gateway.address,
            "--model", MODEL, "--timeout-s", str(PATIENT_TIMEOUT_S),
            "--burst", "64", "--sequential", "20",
            *TEXTS[:64],
        )  # fmt: skip
        assert report["burst"] == ["OK"] * 64, Counter(report["burst"])
        assert report["sequential"] == ["OK"] * 20, Counter(report["sequential"])
    finally:
        assert stack.stop() == 0, stack.stop_report()


def test_open_loop_traffic_from_the_moment_of_ready_meets_the_slo(
    tmp_path: Path, capacity_per_s: float
) -> None:
    """A rollout or a scale-up: traffic at half capacity starts as soon as the stack is ready,
    with no warm-up traffic before it."""
    rate_per_s = capacity_per_s / 2
    stack = start_stack(tmp_path)
    ready_at_s = time.monotonic()

    async def run() -> list[Outcome]:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            assert time.monotonic() - ready_at_s < 1.0
            schedule = poisson_schedule(rate_per_s, 10.0, seed=1)
            return await run_open_loop(sender(channel, TEXTS, OPEN_LOOP_TIMEOUT_S), schedule)

    try:
        outcomes = asyncio.run(run())
    finally:
        assert stack.stop() == 0, stack.stop_report()
    assert good_share(outcomes) >= 0.99, f"at {rate_per_s:.1f}/s: {describe(outcomes)}"


def test_s03_after_a_flood_at_10x_capacity_normal_traffic_is_served_normally(
    tmp_path: Path, capacity_per_s: float
) -> None:
    """10 s at 10x capacity, then 10 s at half: no lockout, no collapse. The second phase is
    judged from 5 s after the flood ends; its first 5 s are reported, not judged."""
    flood_s, calm_s, recovery_s = 10.0, 10.0, 5.0
    flood = poisson_schedule(10 * capacity_per_s, flood_s, seed=2)
    calm = [flood_s + t for t in poisson_schedule(capacity_per_s / 2, calm_s, seed=3)]
    stack = start_stack(tmp_path)

    async def run() -> tuple[list[Outcome], int]:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            send = sender(channel, TEXTS, OPEN_LOOP_TIMEOUT_S)
            outcomes = await run_open_loop(send, flood + calm)
        return outcomes, await health_status(stack.gateway.address)

    try:
        outcomes, health = asyncio.run(run())
    finally:
        assert stack.stop() == 0, stack.stop_report()
    in_flood = [o for o in outcomes if o.scheduled_s < flood_s]
    recovering = [o for o in outcomes if flood_s <= o.scheduled_s < flood_s + recovery_s]
    recovered = [o for o in outcomes if o.scheduled_s >= flood_s + recovery_s]
    summary = (
        f"capacity {capacity_per_s:.1f}/s; flood: {describe(in_flood)}; first 5 s after: "
        f"{describe(recovering)}; then: {describe(recovered)}"
    )
    # The flood was served in part (no collapse to zero) and refused with a status, not hung.
    assert sum(o.status == OK for o in in_flood) > 0, summary
    assert "RESOURCE_EXHAUSTED" in {o.status for o in in_flood}, summary
    assert good_share(recovered) >= 0.99, summary
    assert health == health_pb2.HealthCheckResponse.SERVING


#: Client-side latency includes the load generator's own scheduling on the same 2 shared cores:
#: an accepted call carries the SLO as its deadline, so a server-side overrun shows as a few ms.
CLIENT_SLACK = 1.1


@pytest.mark.parametrize("factor", [2, 10])
@pytest.mark.xfail(
    reason="known gap (issues 10 and 18), measured on 2 shared cores: at 2x goodput is 0.88-1.04 "
    "of capacity with p99 of accepted calls 250-414 ms; at 10x refusing the flood takes the CPU "
    "that serving needs, goodput 0.42-0.47",
    strict=False,
)
def test_s03_open_loop_past_capacity_keeps_goodput_and_accepted_latency(
    tmp_path: Path, capacity_per_s: float, factor: int
) -> None:
    """Scenario 3: 12 s of open-loop traffic at `factor` x capacity, from callers whose deadline
    is the SLO (DESIGN.md: the deadline is the caller's; a caller with a longer one is served
    late rather than refused). Judged from 2 s in (the first seconds fill the queues): answers
    within the SLO per second stay at 90% of capacity or more, accepted requests answer within
    the SLO at p99, every refusal is RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED, and every tier
    is still up afterwards."""
    duration_s, settle_s = 12.0, 2.0
    schedule = poisson_schedule(factor * capacity_per_s, duration_s, seed=factor)
    stack = start_stack(tmp_path)

    async def run() -> tuple[list[Outcome], int]:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            outcomes = await run_open_loop(sender(channel, TEXTS, SLO_S), schedule)
        return outcomes, await health_status(stack.gateway.address)

    try:
        outcomes, health = asyncio.run(run())
        # Nothing crashed or restarted: every child is the process the stack started.
        dead = [name for name, pid in stack.pids().items() if not Path(f"/proc/{pid}").exists()]
    finally:
        assert stack.stop() == 0, stack.stop_report()
    judged = [o for o in outcomes if o.scheduled_s >= settle_s]
    accepted = sorted(o.latency_s for o in judged if o.status == OK)
    goodput_per_s = sum(s <= SLO_S for s in accepted) / (duration_s - settle_s)
    summary = (
        f"{factor}x of {capacity_per_s:.1f}/s: goodput {goodput_per_s:.1f}/s "
        f"({goodput_per_s / capacity_per_s:.2f} of capacity); {describe(judged)}"
    )
    assert goodput_per_s >= 0.9 * capacity_per_s, summary
    assert accepted and accepted[int(0.99 * (len(accepted) - 1))] <= SLO_S * CLIENT_SLACK, summary
    assert {o.status for o in judged} <= {OK, "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, summary
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert dead == [], dead
