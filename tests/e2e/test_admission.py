"""Admission and overload as traffic really arrives: from cold, in bursts, with mixed lengths and
past capacity. Each stack runs `python -m services.local_stack` as `make run` does, with the
default model repository, and is called as a user would (the stock Triton client for the burst).

These tests are about behaviour (no lockout, no collapse, refusals with a status, nothing
crashed), asserted on statuses and counts, never on latency: they must hold on a slow machine.
They need it to themselves (`solo`: `make test` runs them after the parallel tests): beside
another module's stack on the same two cores, the worker rightly refuses as predicted past the
SLO calls these tests expect served (a CI run saw 23 of 126 normal calls after the flood). The
figures (good share within the SLO from ready and
right after a flood, goodput at 2x and 10x capacity as a share of capacity, p99 of accepted
calls) are `make bench-fabric`'s: its `from ready`, `overload 2x`/`10x` and `after overload`
rows (bench/fabric/__main__.py).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from bench.fabric.loadgen import OK, Outcome, arrival_schedule, noting_errors, run_open_loop
from bench.fabric.targets import make_mixed_texts
from services.common import metric_names as names
from services.common.model_repository import load_repository
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.kserve import run_kserve_client
from tests.support.metrics import scrape, total
from tests.support.processes import REPO_ROOT, health_status
from tests.support.stack import Stack, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.solo]

MODEL = "minilm"
SLO_S = next(
    v.config.slo_s for v in load_repository(REPO_ROOT / "models") if v.config.name == MODEL
)
#: What a patient caller allows: far past the SLO, as the issue's stock-client user did.
PATIENT_TIMEOUT_S = 30.0
#: Deadline of normal traffic (from ready, and after the flood): past the SLO by far, so that a
#: neighbour on the shared cores makes answers late, not failed; what is checked is that every
#: call is answered, with no lockout and no leftover refusals.
NORMAL_TIMEOUT_S = 5.0
#: The flood's callers' deadline: past the SLO, short enough that a flood cannot queue more
#: than a second of work.
FLOOD_TIMEOUT_S = 1.0
#: Normal traffic: a few times below this machine's capacity on the mixed texts (about 100/s
#: served within the SLO on 2 cores), so that every call is served even beside another module.
NORMAL_RATE_PER_S = 15.0
NORMAL_S = 8.0
#: The flood: past what the model can run on 2 cores whatever else runs (the mixed texts'
#: raw model tops out near 130 sequences/s); the test checks it was refused in part.
FLOOD_RATE_PER_S = 400.0
FLOOD_S = 8.0
#: Normal traffic after the flood is judged from this long after the flood's last send: the
#: flood's own calls end within FLOOD_TIMEOUT_S, and what follows is the stack's recovery.
RECOVERY_S = 5.0
#: The share of normal calls from RECOVERY_S after the flood that must be OK. Not all: a busy
#: moment on the 2 cores can make a batch take past the SLO, and then the worker refuses the
#: odd online row predicted to finish past its SLO, as issue 33 asks (2 of 126 in one of seven
#: `make test` runs, when this module still ran beside another). A lockout (a throttle or a
#: standing queue that never lets go) refuses far more than this leaves room for. Spread: 0 of
#: 126 refused in each of 10 runs of this test alone beside a core-bound process (stop 78).
RECOVERED_OK_SHARE = 0.9
#: How the worker refuses a row predicted to finish past its SLO, or past a batch-mate's
#: limit (batching/lane.py), the one refusal normal traffic after the flood may still get.
WORKER_PREDICTION = "predicted to finish"
#: minilm's configured queue bound (models/minilm/config.toml).
MAX_QUEUE_SIZE = next(
    v.config.max_queue_size for v in load_repository(REPO_ROOT / "models") if v.config.name == MODEL
)
#: How much a tier's resident memory may grow over the flood: per-call state that outlived
#: its call, 16,000 calls of it, would show well past this.
RESIDENT_GROWTH_BYTES = 200 * 1024 * 1024
#: What an overloaded stack may answer a caller: served, refused, or not in time.
#: CANCELLED: dropped unseen by the gateway's grpc past --max-pending-calls (this client never
#: cancels a call).
OVERLOAD_STATUSES = {OK, "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED"}
TEXTS = make_mixed_texts(512, seed=11)


def sender(channel: grpc.aio.Channel, texts: Sequence[str], timeout_s: float):
    stub = api_grpc.InferenceServiceStub(channel)
    requests = [
        api.PredictRequest(model_name=MODEL, inputs=[api.PredictInput(text=t)]) for t in texts
    ]
    counter = iter(range(1 << 62))

    async def send() -> None:
        await stub.Predict(requests[next(counter) % len(requests)], timeout=timeout_s)

    return send


def describe(outcomes: Sequence[Outcome]) -> str:
    statuses = Counter(o.status for o in outcomes)
    late = [o for o in outcomes if o.status == OK and o.latency_s > SLO_S]
    worst_ms = round(max((o.latency_s for o in outcomes), default=0.0) * 1000)
    return (
        f"{len(outcomes)} requests: {dict(statuses)}, {len(late)} OK but past the SLO, "
        f"slowest {worst_ms} ms"
    )


def bounded_state(stack: Stack) -> dict[str, float]:
    """What must stay bounded under a flood, now: the worker's queue."""
    worker = scrape(stack.workers[0].metrics_port)
    return {"worker_queue_depth": total(worker, names.WORKER_QUEUE_DEPTH)}


def resident_bytes(stack: Stack) -> dict[str, float]:
    tiers = {"gateway": stack.gateway, "router": stack.router, "worker": stack.workers[0]}
    return {
        name: total(scrape(tier.metrics_port), names.PROCESS_RESIDENT_MEMORY_BYTES)
        for name, tier in tiers.items()
    }


def dead_processes(stack: Stack) -> list[str]:
    """The stack's children that are no longer the processes it started."""
    return [name for name, pid in stack.pids().items() if not Path(f"/proc/{pid}").exists()]


@dataclass(frozen=True)
class FromReady:
    """The shared stack, and the open-loop traffic it got from the moment it was ready."""

    stack: Stack
    outcomes: list[Outcome]


@pytest.fixture(scope="module")
def from_ready(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FromReady]:
    """One stack for the module. Its first traffic, sent here, starts as soon as it reports
    ready (a rollout or a scale-up: no warm-up traffic before), so it is a fresh stack's whatever
    order the tests run in; the flood test then uses the same stack."""
    stack = start_stack(tmp_path_factory.mktemp("admission"))

    async def run() -> list[Outcome]:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            schedule = arrival_schedule(NORMAL_RATE_PER_S, NORMAL_S, seed=1)
            return await run_open_loop(sender(channel, TEXTS, NORMAL_TIMEOUT_S), schedule)

    try:
        outcomes = asyncio.run(run())
        yield FromReady(stack, outcomes)
    finally:
        assert stack.stop() == 0, stack.stop_report()


def test_a_burst_on_a_fresh_stack_is_served_whole_and_nothing_locks_out(tmp_path: Path) -> None:
    """The issue's first report: 64 concurrent mixed-length calls with a 30 s deadline, the
    moment the stack is ready, through the stock Triton client; then single calls. Its own
    stack: the burst must be the first thing a fresh stack sees (the module's stack has had
    traffic by the time a test gets it)."""
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


def test_open_loop_traffic_from_the_moment_of_ready_is_all_served(from_ready: FromReady) -> None:
    """Open-loop traffic well below capacity from the moment of ready: every call is answered
    OK (no lockout, no refusal while the stack warms its shapes)."""
    outcomes = from_ready.outcomes
    assert outcomes, "the schedule sent nothing"
    assert all(o.status == OK for o in outcomes), describe(outcomes)


def test_s03_after_a_flood_normal_traffic_is_served_and_nothing_died(
    from_ready: FromReady,
) -> None:
    """Scenario 3: FLOOD_S at FLOOD_RATE_PER_S (several times capacity), then normal traffic.
    The flood is served in part (no collapse to zero) and the rest refused with a status (not
    hung, not crashed): every call ends OK, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED or CANCELLED. From
    RECOVERY_S after the flood, no lockout: at least RECOVERED_OK_SHARE of the normal calls are
    OK, and the rest were refused one by one by the worker as predicted past their SLO (a
    neighbour on the shared cores can make the model that slow; see WORKER_PREDICTION), never by a
    gateway still throttling or a queue still full. Every tier is still the
    process the stack started, the gateway reports SERVING, and what a flood could grow stayed
    bounded: the worker's queue and every tier's memory."""
    stack = from_ready.stack
    flood = arrival_schedule(FLOOD_RATE_PER_S, FLOOD_S, seed=2)
    calm = [FLOOD_S + t for t in arrival_schedule(NORMAL_RATE_PER_S, RECOVERY_S + NORMAL_S, 3)]

    peaks: dict[str, float] = {}
    normal_errors: list[str] = []  # what each failed call after the flood was told
    recovered_errors: list[str] = []  # ...and each from RECOVERY_S after it
    resident_before = resident_bytes(stack)

    async def watch() -> None:
        """The flood's high-water marks, scraped as Prometheus would, every 0.25 s."""
        while True:
            for name, value in (await asyncio.to_thread(bounded_state, stack)).items():
                peaks[name] = max(peaks.get(name, 0.0), value)
            await asyncio.sleep(0.25)

    async def run() -> tuple[list[Outcome], int]:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            flooding = sender(channel, TEXTS, FLOOD_TIMEOUT_S)
            normal = noting_errors(sender(channel, TEXTS, NORMAL_TIMEOUT_S), normal_errors)
            recovered = noting_errors(normal, recovered_errors)
            due = iter(flood + calm)

            async def send() -> None:
                # Sends start in schedule order, so each knows when it was due: the ones due
                # after the flood are normal calls (as the outcomes are sorted below).
                due_s = next(due)
                if due_s < FLOOD_S:
                    await flooding()
                else:
                    await (normal if due_s < FLOOD_S + RECOVERY_S else recovered)()

            watching = asyncio.create_task(watch())
            outcomes = await run_open_loop(send, flood + calm)
            watching.cancel()
        return outcomes, await health_status(stack.gateway.address)

    outcomes, health = asyncio.run(run())
    in_flood = [o for o in outcomes if o.scheduled_s < FLOOD_S]
    recovering = [o for o in outcomes if FLOOD_S <= o.scheduled_s < FLOOD_S + RECOVERY_S]
    recovered = [o for o in outcomes if o.scheduled_s >= FLOOD_S + RECOVERY_S]
    summary = (
        f"flood at {FLOOD_RATE_PER_S:.0f}/s: {describe(in_flood)}; first {RECOVERY_S:.0f} s "
        f"after: {describe(recovering)}; then: {describe(recovered)}; errors after the "
        f"flood: {normal_errors[-5:]}"
    )
    print(summary)
    flood_statuses = Counter(o.status for o in in_flood)
    assert flood_statuses[OK] > 0, summary
    assert flood_statuses["RESOURCE_EXHAUSTED"] > 0, summary
    assert set(flood_statuses) <= OVERLOAD_STATUSES, summary
    assert recovered, summary
    num_failed = sum(o.status != OK for o in recovered)
    assert num_failed <= (1 - RECOVERED_OK_SHARE) * len(recovered), summary
    # Each failure is a gRPC status we read (no client-side timeout), and the worker's
    # prediction, not a throttle or a full queue.
    assert len(recovered_errors) == num_failed, (recovered_errors, summary)
    assert all(WORKER_PREDICTION in e for e in recovered_errors), (recovered_errors, summary)
    assert dead_processes(stack) == [], stack.pids()
    assert health == health_pb2.HealthCheckResponse.SERVING
    # Bounded: the worker's queue within its configured size, and no tier grew by more than
    # RESIDENT_GROWTH_BYTES. (The model binds here, not the gateway: its door stays at rest.)
    assert peaks, "the flood's state was never scraped"
    assert peaks["worker_queue_depth"] <= MAX_QUEUE_SIZE, peaks
    growth = {name: after - resident_before[name] for name, after in resident_bytes(stack).items()}
    assert all(g < RESIDENT_GROWTH_BYTES for g in growth.values()), growth
