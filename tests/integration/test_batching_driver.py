"""The batching driver over a real TorchScript backend: on a fake clock (what it measures and
decides follows its clock, not the wall's, so stage times can be checked exactly), and when its
loop dies."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from services.common import metric_names as names
from services.common.errors import (
    DeadlineExceeded,
    ExecutionFailed,
    InvalidInput,
    NotFound,
    Overloaded,
    Unavailable,
)
from services.common.model_repository import load_repository
from services.common.priority import PriorityClass
from services.gpu_worker.backends import load_backend
from services.gpu_worker.backends.base import Backend, PreparedRow
from services.gpu_worker.batching import driver as driver_module
from services.gpu_worker.batching.driver import BatchingDriver, DriverConfig
from services.gpu_worker.batching.lane import GAUGE_PERIOD_S
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.slice_admission import SliceAsk, lane_key
from services.gpu_worker.metrics import WorkerMetrics
from tests.support.clock import FakeClock
from tests.support.metrics import total
from tests.support.models import (
    write_affine_model,
    write_small_minilm_repository,
    write_versioned_affine_model,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

#: Fake seconds one batch takes, whatever its size.
BATCH_S = 0.040


@dataclass
class Harness:
    driver: BatchingDriver
    backend: Backend
    clock: FakeClock
    registry: CollectorRegistry

    def metric(self, name: str) -> float:
        return total(generate_latest(self.registry).decode(), name)

    def rows(self, count: int) -> Sequence[PreparedRow]:
        return self.backend.prepare_many([np.full(4, i, dtype=np.float32) for i in range(count)])

    async def submit(self, count: int, timeout_s: float | None = None) -> list[np.ndarray]:
        return await self.settle(
            self.driver.submit(self.backend, self.rows(count), timeout_s=timeout_s, tenant="t")
        )

    def hold_executor(self) -> threading.Event:
        """From now on each batch waits, on the executor, for the gate returned (10 s at most)."""
        gate = threading.Event()
        run = self.backend.run

        def gated_run(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
            gate.wait(timeout=10.0)
            return run(rows)

        self.backend.run = gated_run  # type: ignore[method-assign]
        return gate

    async def settle(self, call: Awaitable[list[np.ndarray]]) -> list[np.ndarray]:
        """Awaits `call` while time passes on the fake clock, 1 ms per real ms: the driver
        lingers on its clock, so without time passing a lingering batch would never close.
        Time stands still while a batch is on the executor: the batch itself moves the clock by
        exactly BATCH_S, however long the real run takes on a busy machine."""
        task = asyncio.ensure_future(call)
        while not task.done():
            if not self.driver.is_executing:
                self.clock.now_s += 0.001
            await asyncio.sleep(0.001)
        return task.result()


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    write_affine_model(tmp_path / "repo", slo_p99_ms=30_000)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    clock = FakeClock()
    run = backend.run

    def run_for_batch_s(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        clock.now_s += BATCH_S  # the batch "takes" BATCH_S on the driver's clock
        return run(rows)

    backend.run = run_for_batch_s  # type: ignore[method-assign]
    registry = CollectorRegistry()
    driver = BatchingDriver([backend], DriverConfig(), WorkerMetrics(registry), clock=clock)
    driver.warm_up()
    driver.start()
    yield Harness(driver, backend, clock, registry)
    await driver.drain()


def thread_recording_backend(
    tmp_path: Path, clock: FakeClock, seconds_on: Callable[[int], float] = lambda _: BATCH_S
) -> tuple[Backend, list[int]]:
    """The affine model on a CPU whose every call records the torch threads it ran on and
    moves `clock` by `seconds_on(threads)`; returns it and the threads seen."""
    write_affine_model(tmp_path / "repo", slo_p99_ms=30_000)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    run = backend.run
    threads_seen: list[int] = []

    def run_recording_threads(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        threads_seen.append(torch.get_num_threads())
        clock.now_s += seconds_on(threads_seen[-1])
        return run(rows)

    backend.run = run_recording_threads  # type: ignore[method-assign]
    return backend, threads_seen


async def test_a_rows_stages_add_up_to_its_latency_exactly(harness: Harness) -> None:
    """Three rows queued behind a running batch: on the driver's clock each row computed
    exactly BATCH_S, and its latency is its queue wait plus that, to the last bit of the
    clock. (Queued behind a batch, not left to linger: whether an idle executor lingers for
    more rows depends on the warm-up's real timings of this tiny model, which a loaded machine
    bends.)"""
    driver, backend = harness.driver, harness.backend
    gate = harness.hold_executor()
    running = driver.submit(backend, harness.rows(1), timeout_s=30, tenant="t")
    first = asyncio.ensure_future(running)
    await eventually(lambda: driver.is_executing, interval_s=0.001)
    queued = asyncio.ensure_future(
        driver.submit(backend, harness.rows(3), timeout_s=30, tenant="t")
    )
    await eventually(lambda: driver.num_in_flight == 4, interval_s=0.001)
    harness.clock.now_s += 0.01  # the three wait while the first batch runs
    gate.set()
    assert len(await harness.settle(first)) == 1
    assert len(await harness.settle(queued)) == 3

    assert harness.metric(names.WORKER_BATCHES_TOTAL) == 2
    compute_s = harness.metric(f"{names.WORKER_ROW_COMPUTE_SECONDS}_sum")
    wait_s = harness.metric(f"{names.WORKER_QUEUE_WAIT_SECONDS}_sum")
    assert compute_s == pytest.approx(4 * BATCH_S + 0.01)  # the first ran while the clock moved
    assert wait_s >= 3 * (0.01 + BATCH_S) - 1e-9
    latency_s = harness.metric(f"{names.WORKER_ROW_LATENCY_SECONDS}_sum")
    assert latency_s == pytest.approx(wait_s + compute_s, abs=1e-9)


async def test_a_slice_answered_whole_is_forgotten_as_its_rows_are_answered(
    harness: Harness,
) -> None:
    """Each row is forgotten as it is answered, so a slice answered whole has nothing left
    for its caller's withdraw to walk (a bundle's end withdrew every row of every slice)."""
    driver, backend = harness.driver, harness.backend
    lane = driver.open_lane(backend)
    admission = driver.admit(backend, harness.rows(3), timeout_s=30, tenant="t")
    assert len(lane.pending) == 3

    assert len(await harness.settle(admission.future)) == 3
    assert not lane.pending and driver.num_in_flight == 0
    driver.withdraw(admission)  # nothing to do, and nothing counted as dropped
    assert harness.metric(names.WORKER_DROPPED_TOTAL) == 0


async def test_the_latency_model_learns_from_the_drivers_clock(harness: Harness) -> None:
    # Warm-up timed real runs (microseconds for this model); serving batches on the fake clock
    # take BATCH_S each, and the learned scale follows them up, bounded per batch.
    slowdowns = []
    spreads = []
    for _ in range(4):
        await harness.submit(1)
        slowdowns.append(harness.metric(names.WORKER_LATENCY_SLOWDOWN))
        spreads.append(harness.metric(names.WORKER_LATENCY_SPREAD))
    assert slowdowns == sorted(slowdowns) and slowdowns[0] > 1.0
    # Each batch ran slower than the scale so far: the spread it exports grew from none.
    assert spreads == sorted(spreads) and spreads[0] > 0.0


async def test_the_latency_model_learns_the_executors_time_not_the_loops_delay(
    harness: Harness,
) -> None:
    """A loop busy with other work (intake refusing a flood) reads a batch's end late: its
    rows waited that long, but the model took BATCH_S, and only that teaches the latency
    model (else a flood's loop lag would be learned as a slow model, and every row refused
    as predicted late, which keeps the loop busy refusing)."""
    driver, loop = harness.driver, asyncio.get_running_loop()
    executor = driver._executor
    submit = executor.submit

    def busy_loop() -> None:  # ahead of the batch's end in the loop's queue
        harness.clock.now_s += 1.0

    def submit_then_busy_loop(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        # Queued on the loop once the executor's call returned (its time read), ahead of the
        # batch's end: a callback of the call's future added before the loop's own. (Queued
        # from inside the model's call, the loop could run it before the executor thread read
        # the call's end, on a loaded machine: the model would then seem to take 1 s more.)
        future = submit(fn, *args, **kwargs)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(busy_loop))
        return future

    executor.submit = submit_then_busy_loop  # type: ignore[method-assign]
    latency = driver.open_lane(harness.backend).latency
    observe = latency.observe
    taught: list[float] = []

    def recording_observe(key: object, batch_size: int, seconds: float) -> None:
        taught.append(seconds)
        observe(key, batch_size, seconds)  # type: ignore[arg-type]

    latency.observe = recording_observe  # type: ignore[method-assign]
    await harness.submit(1)
    waited_s = harness.metric(f"{names.WORKER_ROW_COMPUTE_SECONDS}_sum")
    assert waited_s == pytest.approx(1.0 + BATCH_S)  # what the row waited
    assert taught == [pytest.approx(BATCH_S)]


async def test_s29_draining_refuses_new_rows_and_finishes_queued_ones(harness: Harness) -> None:
    queued = asyncio.ensure_future(harness.submit(2, timeout_s=5))
    await eventually(lambda: harness.driver.num_in_flight == 2, interval_s=0.001)
    harness.driver.begin_drain()
    with pytest.raises(Unavailable, match="draining"):
        await harness.submit(1, timeout_s=5)
    assert len(await queued) == 2


async def test_rows_of_a_version_unloading_or_unloaded_are_refused_not_found(
    harness: Harness,
) -> None:
    """NOT_FOUND, as for a version never loaded here: a router tries another worker and keeps
    this one for its other models. UNAVAILABLE made it eject the worker for every model it
    serves (review finding)."""
    gate = harness.hold_executor()
    running = asyncio.ensure_future(harness.submit(1, timeout_s=30))
    await eventually(lambda: harness.driver.is_executing, message="a batch running")
    removing = asyncio.ensure_future(harness.driver.remove_backend(harness.backend))
    await asyncio.sleep(0)
    with pytest.raises(NotFound, match="is unloading"):
        harness.driver.admit(harness.backend, harness.rows(1), timeout_s=30, tenant="t")
    gate.set()
    assert len(await running) == 1  # the rows it had admitted are served
    await removing
    with pytest.raises(NotFound, match="was unloaded"):
        harness.driver.admit(harness.backend, harness.rows(1), timeout_s=30, tenant="t")


async def test_batch_rows_are_reported_apart_and_charged_to_their_tenant(
    harness: Harness,
) -> None:
    driver, backend = harness.driver, harness.backend
    # A first row holds the executor (batch rows alone would run at once, as a backfill), so
    # the rows after it stay queued.
    gate = harness.hold_executor()
    blocker = asyncio.ensure_future(
        driver.submit(backend, harness.rows(1), timeout_s=5, tenant="t")
    )
    await eventually(lambda: driver.is_executing, interval_s=0.001)
    batch = asyncio.ensure_future(
        driver.submit(
            backend, harness.rows(3), timeout_s=5, tenant="jobs", priority=PriorityClass.BATCH
        )
    )
    online = asyncio.ensure_future(driver.submit(backend, harness.rows(2), timeout_s=5, tenant="t"))
    await eventually(lambda: driver.num_in_flight == 6, interval_s=0.001)

    report = driver.load_report(backend)
    assert (report.queued_rows, report.queued_batch_rows) == (2, 3)
    gate.set()
    await harness.settle(asyncio.gather(blocker, batch, online))
    metrics = generate_latest(harness.registry).decode()
    for tenant in ("jobs", "t"):
        served_s = total(metrics, names.WORKER_TENANT_COMPUTE_SECONDS_TOTAL, tenant=tenant)
        assert served_s > 0, tenant


async def test_backfill_neither_counts_as_online_device_time_nor_as_queue_wait(
    harness: Harness,
) -> None:
    """The autoscaling signals (the online duty cycle, the queue wait) leave batch-class work
    out: a job filling idle time must not scale workers up. Before, a backfill's device time and
    batch rows' waits counted as online traffic's."""
    driver, backend = harness.driver, harness.backend
    await harness.settle(
        driver.submit(
            backend, harness.rows(3), timeout_s=5, tenant="jobs", priority=PriorityClass.BATCH
        )
    )  # alone on an idle worker: a backfill
    metrics = generate_latest(harness.registry).decode()
    busy = names.WORKER_DEVICE_BUSY_SECONDS_TOTAL
    backfill_s = total(metrics, busy, work="backfill")  # the call's wall time, on a CPU
    assert backfill_s > 0 and total(metrics, busy, work="online") == 0
    assert total(metrics, f"{names.WORKER_QUEUE_WAIT_SECONDS}_count") == 0
    await harness.submit(2, timeout_s=5)
    metrics = generate_latest(harness.registry).decode()
    assert total(metrics, busy, work="online") > 0
    assert total(metrics, busy, work="backfill") == backfill_s
    assert total(metrics, f"{names.WORKER_QUEUE_WAIT_SECONDS}_count") == 2


async def test_a_drain_cut_short_answers_every_waiting_row_unavailable(harness: Harness) -> None:
    """A drain that outlasts its grace (cancelled, as the worker's stop does) answers the rows
    still waiting, the running batch's and the queued ones, UNAVAILABLE at once: their callers
    retry elsewhere, not when the server closes their calls."""
    driver, backend = harness.driver, harness.backend
    gate = harness.hold_executor()
    try:
        running = asyncio.ensure_future(
            driver.submit(backend, harness.rows(1), timeout_s=30, tenant="t")
        )
        await eventually(lambda: driver.is_executing, interval_s=0.001)
        queued = asyncio.ensure_future(
            driver.submit(backend, harness.rows(2), timeout_s=30, tenant="t")
        )
        await eventually(lambda: driver.num_in_flight == 3, interval_s=0.001)
        other = asyncio.ensure_future(driver.drain())  # a second drain, not cut short
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(driver.drain(), 0.2)
        await other  # returns: the loop it waited for is stopped
        for call in (running, queued):
            with pytest.raises(Unavailable, match="stopping") as refused:
                await call
            # Marked for its gateway to send again (a bundle's slice answered so beside
            # served bundle-mates was not retried at all: review finding).
            assert refused.value.is_not_started
        assert driver.num_in_flight == 0
    finally:
        gate.set()


async def warming_up_behind(harness: Harness, gate: threading.Event) -> asyncio.Future[None]:
    """A second version of the model added while serving, whose warm-up holds the executor
    until `gate` is set; returns once the warm-up runs (the future of its `add_backend`)."""
    second = load_backend(harness.backend.version, torch.device("cpu"))
    started = threading.Event()
    warm_up = second.warm_up

    def slow_warm_up() -> None:
        started.set()
        gate.wait(timeout=10.0)
        warm_up()

    second.warm_up = slow_warm_up  # type: ignore[method-assign]
    adding = asyncio.ensure_future(harness.driver.add_backend(second))
    await eventually(started.is_set, interval_s=0.001, message="warm-up started")
    return adding


async def test_a_version_warming_up_holds_batches_back_instead_of_timing_them(
    harness: Harness,
) -> None:
    """A version loaded while serving warms up on the executor thread between batches: a row
    of the serving version waits until the warm-up is done, then runs. Before, it was
    dispatched behind the warm-up and timed from its dispatch, so a warm-up longer than the
    watchdog took it for a wedged model call: the row failed UNAVAILABLE and the worker
    stopped serving."""
    driver = harness.driver
    # Real seconds, as the watchdog counts them: long enough that the row's own batch, once
    # the warm-up is done, never trips it on a loaded machine.
    driver.watchdog_s = 1.0
    gate = threading.Event()
    adding = await warming_up_behind(harness, gate)
    try:
        row = asyncio.ensure_future(harness.submit(1, timeout_s=30))
        await asyncio.sleep(2 * driver.watchdog_s)
        assert not row.done()
    finally:
        gate.set()
    await adding
    assert len(await row) == 1
    assert harness.metric(names.WORKER_WATCHDOG_EXPIRED_TOTAL) == 0


async def test_a_row_that_cannot_finish_behind_a_long_warm_up_is_refused_at_once(
    harness: Harness,
) -> None:
    """A hot-loaded version's warm-up holds the executor between batches: admission took the
    executor for idle (no batch runs), queued every row, and each waited out its deadline
    (review finding). The warm-up is predicted to run as long again as it has: a row whose
    deadline that would pass is refused at once, with a retry hint (sent elsewhere); one with
    time to wait still queues and runs once the warm-up is done."""
    driver = harness.driver
    driver.watchdog_s = 5.0
    gate = threading.Event()
    adding = await warming_up_behind(harness, gate)
    try:
        harness.clock.now_s += 0.5  # the warm-up ran 0.5 s: predicted free in 0.5 s more
        with pytest.raises(Overloaded) as refused:  # at once: nothing queued to wait
            harness.driver.admit(harness.backend, harness.rows(1), timeout_s=0.2, tenant="t")
        assert refused.value.retry_after_s > 0
        waits = asyncio.ensure_future(harness.submit(1, timeout_s=30))
        await asyncio.sleep(0.05)
        assert not waits.done()
    finally:
        gate.set()
    await adding
    assert len(await waits) == 1


async def test_a_row_refused_while_a_batch_overruns_its_prediction_gets_a_retry_hint(
    harness: Harness,
) -> None:
    """The running batch is past its predicted end: a refusal's hint counts from now, not from
    that end (before, it was negative, and the refusal carried no retry-after-ms at all)."""
    driver, backend = harness.driver, harness.backend
    gate = harness.hold_executor()
    running = asyncio.ensure_future(
        driver.submit(backend, harness.rows(1), timeout_s=30, tenant="t")
    )
    try:
        await eventually(lambda: driver.is_executing, interval_s=0.001)
        harness.clock.now_s += 5.0  # far past the batch's predicted end
        with pytest.raises(Overloaded, match="past the request's deadline") as refused:
            await driver.submit(backend, harness.rows(1), timeout_s=0.0001, tenant="t")
        assert refused.value.retry_after_s > 0
        assert refused.value.trailers()
    finally:
        gate.set()
    await harness.settle(running)


async def test_a_refused_online_rows_hint_counts_only_the_rows_that_run_before_it(
    harness: Harness,
) -> None:
    """A refusal's retry hint priced the whole queue, batch-class rows included, which run
    after an online row: behind a job's backlog, an online caller was told to come back as
    late as the backlog's end, and the lane's SLO shedding was told that finish too (review
    finding). The hint is the refused row's own predicted finish, as its refusal priced it."""
    driver, backend = harness.driver, harness.backend
    gate = harness.hold_executor()
    running = asyncio.ensure_future(
        driver.submit(backend, harness.rows(1), timeout_s=30, tenant="t")
    )
    backlog: list[asyncio.Future[list[np.ndarray]]] = []

    async def refused_hint_s() -> float:
        with pytest.raises(Overloaded, match="past the request's deadline") as refused:
            await driver.submit(backend, harness.rows(1), timeout_s=0.0001, tenant="t")
        return refused.value.retry_after_s

    try:
        await eventually(lambda: driver.is_executing, interval_s=0.001)
        alone_s = await refused_hint_s()
        # 32 batch rows: as many as batch rows may fill of the model's queue.
        backlog = [
            asyncio.ensure_future(
                driver.submit(backend, harness.rows(8), timeout_s=300, tenant="job",
                              priority=PriorityClass.BATCH)
            )
            for _ in range(4)
        ]  # fmt: skip
        await eventually(lambda: driver.num_in_flight >= 33, interval_s=0.001)
        behind_job_s = await refused_hint_s()
    finally:
        gate.set()
    await harness.settle(running)
    for waiting in backlog:
        await harness.settle(waiting)
    assert alone_s > 0
    assert behind_job_s == pytest.approx(alone_s)  # not 32 batch rows later


async def test_a_failing_batch_bisected_past_the_watchdog_is_no_wedged_call(
    harness: Harness,
) -> None:
    """Every row of a batch fails: the batch is bisected, 2n - 1 model calls that together
    take longer than the watchdog, though each is far inside it. The rows fail alone and the
    worker serves on (before, the bound covered the whole batch: the worker took itself for
    wedged and stopped serving)."""
    driver, backend = harness.driver, harness.backend
    driver.watchdog_s = 3.0  # real seconds: 12x each call, less than the 15 calls' 3.75 s
    run = backend.run

    def failing_run(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        time.sleep(0.25)
        raise RuntimeError("this model fails on every row")

    backend.run = failing_run  # type: ignore[method-assign]
    # Eight callers of a row each, queued together: one batch of eight.
    admissions = [driver.admit(backend, harness.rows(1), timeout_s=60, tenant="t")
                  for _ in range(8)]  # fmt: skip
    try:
        outcomes = await harness.settle(
            asyncio.gather(*(a.future for a in admissions), return_exceptions=True)
        )
    finally:
        for admission in admissions:
            driver.withdraw(admission)
        backend.run = run  # type: ignore[method-assign]
    assert [type(o) for o in outcomes] == [ExecutionFailed] * 8
    assert harness.metric(names.WORKER_WATCHDOG_EXPIRED_TOTAL) == 0
    assert len(await harness.submit(1)) == 1  # still serving


async def test_a_callers_failed_row_fails_it_and_its_rows_still_queued_leave_unrun(
    harness: Harness,
) -> None:
    """24 rows of one caller, three batches of 8; the model fails on row 0. The caller is
    answered the failure at once, and its 16 rows still queued leave the queue unrun, without
    its withdrawing them (before, they ran, or waited for the caller to withdraw them, and were
    then counted as cancelled drops)."""
    driver, backend = harness.driver, harness.backend
    run, values_run = backend.run, []

    def failing_on_row_0(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        values = [float(r.data[0]) for r in rows]
        if 0.0 in values:
            raise RuntimeError("this model fails on row 0")
        values_run.extend(values)
        return run(rows)

    backend.run = failing_on_row_0  # type: ignore[method-assign]
    admission = driver.admit(backend, harness.rows(24), timeout_s=60, tenant="t")
    try:
        await harness.settle(asyncio.gather(admission.future, return_exceptions=True))
        assert isinstance(admission.future.exception(), ExecutionFailed)
        assert harness.metric(names.WORKER_QUEUE_DEPTH) == 0
        assert driver.num_in_flight == 0
        assert max(values_run) < 8  # only the first batch's other rows ran
        assert harness.metric(names.WORKER_DROPPED_TOTAL) == 0
    finally:
        driver.withdraw(admission)
        backend.run = run  # type: ignore[method-assign]
    assert len(await harness.submit(3)) == 3  # still serving
    assert await harness.submit(0) == []  # no rows: answered at once, not waited on forever


async def test_a_tenant_turned_away_by_a_full_queue_gets_room_as_the_floods_rows_leave(
    harness: Harness,
) -> None:
    """Through the driver's admission (room first, then each row): tenant a alone fills the
    queue (64 rows, the executor held), tenant b is refused for a full queue; once two of a's
    rows leave, a's next row is refused past its share and b's retry gets in. Before, the
    refusal for room never reached the shares, and a took every freed place."""
    driver, backend = harness.driver, harness.backend
    gate = harness.hold_executor()
    admitted = []
    try:
        admitted.append(driver.admit(backend, harness.rows(1), timeout_s=30, tenant="a"))
        await eventually(lambda: driver.is_executing, interval_s=0.001)
        for _ in range(backend.config.max_queue_size):
            admitted.append(driver.admit(backend, harness.rows(1), timeout_s=30, tenant="a"))
        with pytest.raises(Overloaded, match="queue is full"):
            driver.admit(backend, harness.rows(1), timeout_s=30, tenant="b")
        for admission in admitted[1:3]:
            driver.withdraw(admission)
        with pytest.raises(Overloaded, match="fair share"):
            driver.admit(backend, harness.rows(1), timeout_s=30, tenant="a")
        admitted.append(driver.admit(backend, harness.rows(1), timeout_s=30, tenant="b"))
    finally:
        gate.set()
        for admission in admitted:
            driver.withdraw(admission)


async def test_a_weight_that_is_not_finite_is_invalid(harness: Harness) -> None:
    rows = harness.rows(1)
    with pytest.raises(InvalidInput, match="tenant weight"):
        await harness.driver.submit(
            harness.backend, rows, timeout_s=5, tenant="t", weight=float("nan")
        )


async def test_a_bundles_slices_are_admitted_in_one_pass_each_refused_alone(
    harness: Harness,
) -> None:
    asks = [
        SliceAsk(harness.rows(2), 5.0, "t"),
        SliceAsk(harness.rows(1), 5.0, "t", weight=float("nan")),
        SliceAsk(harness.rows(1), 5.0, "u"),
    ]
    arrival_s = harness.clock.now_s
    first, refused, last = harness.driver.admit_slices(harness.backend, asks, arrival_s=arrival_s)
    assert isinstance(refused, InvalidInput) and "tenant weight" in str(refused)
    assert not isinstance(first, Exception) and not isinstance(last, Exception)
    # The queue's gauge is read when scraped: the three admitted rows, then none.
    assert harness.metric(names.WORKER_QUEUE_DEPTH) == 3
    outputs = await harness.settle(asyncio.gather(first.future, last.future))
    assert [len(o) for o in outputs] == [2, 1]
    for admission in (first, last):
        harness.driver.withdraw(admission)
    assert harness.metric(names.WORKER_QUEUE_DEPTH) == 0
    # The rows arrived together: each row's wait is observed, all alike.
    assert harness.metric(f"{names.WORKER_QUEUE_WAIT_SECONDS}_count") == 3
    wait_s = harness.metric(f"{names.WORKER_QUEUE_WAIT_SECONDS}_sum") / 3
    assert wait_s > 0
    assert harness.metric(f"{names.WORKER_ROW_LATENCY_SECONDS}_sum") == pytest.approx(
        3 * (wait_s + BATCH_S), abs=1e-9
    )


async def test_a_refused_slices_like_in_one_pass_are_refused_without_a_forecast_each(
    harness: Harness,
) -> None:
    """A flood's bundle of like slices: the first one refused as predicted late refuses those
    like it with no more time (each its own error and jittered hint, every row counted), at
    the cost of one forecast; a slice with more time, or of another tenant, is still judged
    on its own and admitted."""
    driver, backend = harness.driver, harness.backend
    gate = harness.hold_executor()
    running = asyncio.ensure_future(
        driver.submit(backend, harness.rows(1), timeout_s=30, tenant="t")
    )
    await eventually(lambda: driver.is_executing, interval_s=0.001)
    batcher = driver.open_lane(backend).batcher
    add = batcher.add
    added: list[int] = []

    def counting_add(item: Any, *args: Any, **kwargs: Any) -> Any:
        added.append(item.item_id)
        return add(item, *args, **kwargs)

    batcher.add = counting_add  # type: ignore[method-assign]
    late = [SliceAsk(harness.rows(1), 0.001, "t") for _ in range(5)]
    asks = [*late, SliceAsk(harness.rows(1), 0.0005, "t"), SliceAsk(harness.rows(1), 30.0, "t"),
            SliceAsk(harness.rows(1), 0.001, "u")]  # fmt: skip
    outcomes = driver.admit_slices(backend, asks)
    refused = outcomes[:6]
    assert all(isinstance(o, Overloaded) for o in refused), outcomes
    assert len({id(o) for o in refused}) == 6  # one error each: each caller's own hint
    assert len({str(o) for o in refused}) == 1
    # The first like slice was forecast; its five like ones (the one with less time too) not.
    assert len(added) == 1 + 2 and added == sorted(added)
    admitted = outcomes[6]
    assert not isinstance(admitted, Exception)
    assert isinstance(outcomes[7], Overloaded)  # its own forecast, its own refusal
    assert harness.metric(names.WORKER_REJECTED_TOTAL) == 7
    gate.set()
    assert len(await harness.settle(admitted.future)) == 1
    driver.withdraw(admitted)
    assert len(await harness.settle(running)) == 1


async def test_a_dead_loop_fails_queued_rows_refuses_new_ones_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 16: a batching loop that died left the worker SERVING with every request hanging.
    write_affine_model(tmp_path / "repo", slo_p99_ms=30_000)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    driver = BatchingDriver([backend], DriverConfig(), WorkerMetrics(CollectorRegistry()))
    driver.warm_up()

    def broken_poll(*args: object, **kwargs: object) -> None:
        raise RuntimeError("batcher invariant broken")

    monkeypatch.setattr(Batcher, "poll", broken_poll)
    fatal: list[Exception] = []
    driver.start(on_fatal=fatal.append)
    rows = backend.prepare_many([np.ones(4, dtype=np.float32)])
    with pytest.raises(Unavailable, match="batching stopped here") as refused:
        await asyncio.wait_for(driver.submit(backend, rows, timeout_s=5, tenant="t"), 10)
    assert refused.value.is_not_started  # never run here: its gateway may send it again
    assert [str(e) for e in fatal] == ["batcher invariant broken"]
    with pytest.raises(Unavailable):
        await driver.submit(backend, rows, timeout_s=5, tenant="t")
    await driver.drain()


async def test_a_short_backfill_beside_online_traffic_runs_on_the_backfill_threads(
    tmp_path: Path,
) -> None:
    """On a CPU the model's threads take every core; a backfill of `batch` rows held short
    beside recent online rows runs on `backfill_threads` (leaving the rest to the online
    path) and teaches the latency model nothing; after a quiet second it runs on all."""
    clock = FakeClock()
    backend, threads_seen = thread_recording_backend(tmp_path, clock)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    registry = CollectorRegistry()
    driver = BatchingDriver(
        [backend], DriverConfig(backfill_threads=1), WorkerMetrics(registry), clock=clock
    )
    driver.open_lane(backend).threads = None  # the other batches on the model's own count
    driver.warm_up()
    driver.start()
    harness = Harness(driver, backend, clock, registry)
    try:
        threads_seen.clear()
        await harness.submit(1)  # online: an urgent row, on every thread
        # Each batch the latency model learns from moves its slowdown (40 fake ms a batch).
        taught = harness.metric(names.WORKER_LATENCY_SLOWDOWN)
        batch_rows = harness.rows(2)
        await harness.settle(
            driver.submit(
                backend, batch_rows, timeout_s=5, tenant="jobs", priority=PriorityClass.BATCH
            )
        )
        assert harness.metric(names.WORKER_LATENCY_SLOWDOWN) == taught  # taught nothing
        clock.now_s += 2.0  # a quiet spell: the next backfill is full width, on every thread
        await harness.settle(
            driver.submit(
                backend, batch_rows, timeout_s=5, tenant="jobs", priority=PriorityClass.BATCH
            )
        )
        assert harness.metric(names.WORKER_LATENCY_SLOWDOWN) != taught
        # The online row on every thread, the held-short backfill on the backfill thread, then
        # the full backfill on every thread; each backfill in one batch or one a row (as the
        # driver's loop happened to run between its rows).
        online, rest = threads_seen[0], threads_seen[1:]
        held_short = list(itertools.takewhile(lambda n: n == 1, rest))
        full = rest[len(held_short) :]
        assert online == 2 and held_short and full and set(full) == {2}, threads_seen
        assert torch.get_num_threads() == 2  # restored after the short backfill
    finally:
        await driver.drain()
        torch.set_num_threads(previous)


async def test_batches_run_on_the_thread_count_measured_cheapest(tmp_path: Path) -> None:
    """On a CPU a lane times its batches per padded token on one thread and on all, and runs
    them on the cheaper count: here one, as the fake clock makes two threads three times
    slower (a 2-core host flooded at 10x served 12-70 rows/s on two, 120-190 on one). One
    thread is sampled first, three times; two threads once, as that costs past the rule-out
    ratio, which also holds any try back for 16 batches: the 16th batch's exploring turn is
    taken by the 20th. An exploring batch teaches the latency model nothing."""
    clock = FakeClock()
    backend, threads_seen = thread_recording_backend(
        tmp_path, clock, lambda threads: BATCH_S * (3 if threads == 2 else 1)
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    registry = CollectorRegistry()
    driver = BatchingDriver([backend], DriverConfig(), WorkerMetrics(registry), clock=clock)
    driver.warm_up()
    driver.start()
    harness = Harness(driver, backend, clock, registry)
    try:
        threads_seen.clear()
        for _ in range(15):
            await harness.submit(1)
        # Three samples of one thread, one of two (three times dearer), then the cheaper.
        assert threads_seen == [1, 1, 1, 2] + [1] * 11
        for _ in range(4):
            await harness.submit(1)  # the 16th's turn, held back to the 20th
        assert threads_seen[-4:] == [1] * 4
        taught = harness.metric(names.WORKER_LATENCY_SLOWDOWN)
        await harness.submit(1)  # the 20th: it explores
        assert threads_seen[-1] == 2
        assert harness.metric(names.WORKER_LATENCY_SLOWDOWN) == taught
        await harness.submit(1)
        assert threads_seen[-1] == 1
        assert harness.metric(names.WORKER_LATENCY_SLOWDOWN) != taught  # back on the best
        assert torch.get_num_threads() == 2  # restored after each batch
    finally:
        await driver.drain()
        torch.set_num_threads(previous)


@contextlib.asynccontextmanager
async def failing_driver(
    tmp_path: Path, fails: Callable[[Sequence[PreparedRow]], bool]
) -> AsyncIterator[tuple[BatchingDriver, Backend, list[int]]]:
    """A started driver on 2 torch threads (restored after) over a backend recording the
    threads of each call, whose calls raise once warmed up wherever `fails(rows)` says; and
    the threads recorded since the start."""
    backend, threads_seen = thread_recording_backend(tmp_path, FakeClock())
    run = backend.run
    is_warm = [False]

    def run_failing(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        outputs = run(rows)  # its threads recorded
        if is_warm[0] and fails(rows):
            raise RuntimeError("this batch fails")
        return outputs

    backend.run = run_failing  # type: ignore[method-assign]
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    driver = BatchingDriver([backend], DriverConfig(), WorkerMetrics(CollectorRegistry()))
    try:
        driver.warm_up()
        is_warm[0] = True
        driver.start()
        threads_seen.clear()
        yield driver, backend, threads_seen
    finally:
        await driver.drain()
        torch.set_num_threads(previous)


async def test_a_failed_batch_teaches_the_thread_choice_nothing(tmp_path: Path) -> None:
    """A batch that failed (bisected, or failing at once) says nothing of what a count costs:
    the next batch still samples the count it ran on."""
    fail = [True]
    async with failing_driver(tmp_path, lambda _: fail[0]) as (driver, backend, threads_seen):
        with pytest.raises(ExecutionFailed):
            await driver.submit(
                backend, backend.prepare_many([np.ones(4, np.float32)]), timeout_s=30, tenant="t"
            )
        fail[0] = False
        await driver.submit(
            backend, backend.prepare_many([np.ones(4, np.float32)]), timeout_s=30, tenant="t"
        )
        assert threads_seen == [1, 1]
        # Only the second taught the choice: one thread is known, from one sample (the
        # failed batch's would have made it two, and a cost of a whole bisection).
        choice = driver.open_lane(backend).threads
        assert choice is not None and choice.samples(1) == {1: 1}


async def test_a_bisected_batch_whose_rows_all_succeed_teaches_the_thread_choice_nothing(
    tmp_path: Path,
) -> None:
    """A batch failing at its size (out of memory at full width) is bisected and its rows then
    succeed alone: its time, that of three calls, is no batch's cost. It taught the thread
    choice and the latency model as one batch of two rows."""

    def is_wide(rows: Sequence[PreparedRow]) -> bool:  # out of memory past one row
        return len(rows) > 1

    async with failing_driver(tmp_path, is_wide) as (driver, backend, threads_seen):
        rows = backend.prepare_many([np.ones(4, np.float32), np.zeros(4, np.float32)])
        outputs = await driver.submit(backend, rows, timeout_s=30, tenant="t")
        assert len(outputs) == 2 and len(threads_seen) == 3  # the batch, then each row
        choice = driver.open_lane(backend).threads
        assert choice is not None and choice.samples(2) == {}


async def test_a_batch_that_fails_whole_on_a_device_that_no_longer_runs_work_stops_batching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every call fails and the device's check fails too (on a GPU, a CUDA error that poisons
    the context; here the check is made to fail, a CPU's never does): the rows fail
    UNAVAILABLE (retry elsewhere), batching stops and the worker is told, as for a call past
    the watchdog. Before, every row was bisected alone and answered INTERNAL while the worker
    stayed SERVING, drawing traffic it failed whole."""
    write_affine_model(tmp_path / "repo")
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    driver = BatchingDriver([backend], DriverConfig(), WorkerMetrics(CollectorRegistry()))
    driver.warm_up()

    def poisoned(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def lost(device: torch.device) -> None:
        raise RuntimeError(f"{device} computed a wrong sum: it is not fit to serve")

    backend.run = poisoned  # type: ignore[method-assign]
    monkeypatch.setattr("services.gpu_worker.execution.check_device", lost)
    fatal: list[Exception] = []
    driver.start(on_fatal=fatal.append)
    registry = driver._metrics.registry
    rows = backend.prepare_many([np.ones(4, np.float32), np.zeros(4, np.float32)])
    try:
        with pytest.raises(Unavailable, match="no longer runs work"):
            await driver.submit(backend, rows, timeout_s=30, tenant="t")
        await eventually(lambda: bool(fatal), message="the worker told")
        with pytest.raises(Unavailable):
            await driver.submit(backend, rows[:1], timeout_s=30, tenant="t")
    finally:
        await driver.drain()
    assert "no longer runs work" in str(fatal[0])
    labels = {"model": "affine", "version": "1"}
    text = generate_latest(registry).decode()
    assert total(text, names.WORKER_DEVICE_LOST_TOTAL, **labels) == 1  # FabricWorkerWedged
    assert total(text, names.WORKER_WATCHDOG_EXPIRED_TOTAL, **labels) == 0


async def test_a_standing_queue_refuses_online_rows_past_the_slo_while_batch_rows_queue(
    tmp_path: Path,
) -> None:
    """Issue 33's rule at the batcher (CoDel on the rows' queue wait, target a tenth of the SLO,
    interval the SLO), on the real clock with batches that take BATCH_S: a flood of patient
    callers (30 s deadlines, SLO 200 ms) is absorbed at first, then, once every row has waited
    above 20 ms for 200 ms, a new online row predicted to miss the SLO is refused with a retry
    hint although its deadline would allow it, and a `batch` row still queues. Every row
    admitted is served, and once the queue has drained an online row is admitted again."""
    write_affine_model(tmp_path / "repo", slo_p99_ms=200, max_queue_size=1024)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    run = backend.run

    def run_for_batch_s(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        time.sleep(BATCH_S)  # warm-up too: the latency model learns BATCH_S per batch
        return run(rows)

    backend.run = run_for_batch_s  # type: ignore[method-assign]
    registry = CollectorRegistry()
    driver = BatchingDriver(
        [backend], DriverConfig(), WorkerMetrics(registry), clock=time.monotonic
    )
    driver.warm_up()
    driver.start()

    def rows(count: int) -> Sequence[PreparedRow]:
        return backend.prepare_many([np.full(4, i, dtype=np.float32) for i in range(count)])

    def is_standing() -> bool:
        return total(generate_latest(registry).decode(), names.WORKER_QUEUE_STANDING) == 1

    try:
        # 25 batches of 8: about 1 s, standing from about 0.24 s on.
        flood = asyncio.gather(
            *(driver.submit(backend, rows(1), timeout_s=30, tenant="t") for _ in range(200))
        )
        await eventually(is_standing, interval_s=0.001)
        refused_s = time.monotonic()  # no dispatch is observed before the admission returns
        with pytest.raises(Overloaded, match="past its SLO") as refused:
            driver.admit(backend, rows(1), timeout_s=30, tenant="t")
        assert refused.value.retry_after_s > 0
        # Refused behind the flood's queue: the refusal holds the standing queue.
        assert driver.open_lane(backend).shedding.queue.last_above_s >= refused_s
        batch = driver.submit(
            backend, rows(1), timeout_s=30, tenant="jobs", priority=PriorityClass.BATCH
        )
        assert len(await batch) == 1
        assert len(await flood) == 200

        assert len(await driver.submit(backend, rows(1), timeout_s=30, tenant="t")) == 1
    finally:
        await driver.drain()


async def test_a_caller_whose_long_row_expires_as_its_short_row_leaves_fails_alone(
    tmp_path: Path,
) -> None:
    """One caller's two rows of two buckets share a deadline, but each expires by its own
    compute: at a turn where the long row can no longer end in time, the short one can, and
    the same poll drops the one and dispatches the other. The caller is answered
    DEADLINE_EXCEEDED and the loop goes on (before, failing the caller withdrew the row being
    dispatched, and the dispatch's KeyError stopped the worker's batching for good)."""
    (version,) = load_repository(write_small_minilm_repository(tmp_path / "repo"))
    backend = load_backend(version, torch.device("cpu"))
    clock = FakeClock()
    driver = BatchingDriver(
        [backend], DriverConfig(), WorkerMetrics(CollectorRegistry()), clock=clock
    )
    # Neither warmed up nor started: the curves are the ones written here, and the test takes
    # the loop's turns itself.
    lane = driver.open_lane(backend)
    short, long = backend.buckets
    for size in range(1, 9):
        lane.latency.observe(lane_key(lane, short), size, 0.01)
        lane.latency.observe(lane_key(lane, long), size, 0.5)
    rows = [backend.warmup_rows(short, 1)[0], backend.warmup_rows(long, 1)[0]]
    admission = driver.admit(backend, rows, timeout_s=1.0, tenant="t")

    clock.now_s += 0.7  # the long row (0.5 s) can no longer end within the second, the short can
    driver._take_turns(0, clock(), is_idle=True)
    assert driver.is_executing  # the short row's batch
    with pytest.raises(DeadlineExceeded):
        await admission.future
    driver.withdraw(admission)
    await driver.drain()
    assert not lane.pending


async def test_a_row_refused_for_its_batch_mates_limit_is_told_so(tmp_path: Path) -> None:
    """A row whose own deadline allows minutes, refused because joining the batch queued
    ahead would push that batch past its first row's deadline, is told it was that row's limit,
    not its own deadline (the message a caller and an operator read), and by queue-full
    refusals how many rows it asked for."""
    write_affine_model(tmp_path / "repo", max_batch_size=8, max_queue_size=2)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    driver = BatchingDriver(
        [backend], DriverConfig(), WorkerMetrics(CollectorRegistry()), clock=FakeClock()
    )
    # Neither warmed up nor started: the curve is the one written here, nothing dispatches,
    # and the clock stands.
    lane = driver.open_lane(backend)
    key = lane_key(lane, backend.buckets[0])
    for size in range(1, 9):  # one row takes 10 ms, two or more 200 ms
        lane.latency.observe(key, size, 0.01 if size == 1 else 0.2)
    rows = backend.prepare_many([np.zeros(4, dtype=np.float32)])

    driver.admit(backend, rows, timeout_s=0.1, tenant="t")  # alone, it ends in time
    with pytest.raises(Overloaded) as refused:
        driver.admit(backend, rows, timeout_s=600, tenant="t")
    message = str(refused.value)
    assert "past the limit of a row already queued in its batch" in message, message
    assert "deadline" not in message, message
    assert refused.value.retry_after_s > 0

    with pytest.raises(Overloaded) as full:
        driver.admit(
            backend, backend.prepare_many([np.zeros(4, np.float32)] * 3), timeout_s=600, tenant="t"
        )
    assert "queue is full (1 rows): 3 rows, room for 1" in str(full.value), full.value


async def test_rows_bound_by_the_slo_are_admitted_by_the_slo_spreads(tmp_path: Path) -> None:
    """The worker's admission bounds a row of a model that sheds past its SLO by
    `slo_prediction_spreads` of its lane's spread (SloShedding.slo_share,
    QueuedItem.admission_limit_s): with batches that
    spread (10 ms on average, 5 ms from it), a lane at four admits fewer rows behind a queue
    than one at two, its refusals saying the SLO."""
    repo = tmp_path / "repo"
    write_affine_model(repo, slo_p99_ms=200, max_queue_size=1024)
    config = repo / "affine" / "config.toml"
    text = config.read_text().replace(
        'kind = "torchscript"', 'kind = "torchscript"\nshed_past_slo = true', 1
    )
    config.write_text(text)
    (version,) = load_repository(repo)
    backend = load_backend(version, torch.device("cpu"))

    def admitted_behind_a_queue(slo_spreads: float) -> int:
        config = DriverConfig(slo_prediction_spreads=slo_spreads)
        driver = BatchingDriver(
            [backend], config, WorkerMetrics(CollectorRegistry()), clock=FakeClock()
        )
        driver.warm_up()  # never started: nothing dispatches, the clock stands
        lane = driver.open_lane(backend)
        for seconds in [0.005, 0.015] * 40:
            lane.latency.observe(lane_key(lane, backend.buckets[0]), 8, seconds)
        rows = backend.prepare_many([np.zeros(4, dtype=np.float32)])
        for admitted in itertools.count():
            try:
                driver.admit(backend, rows, timeout_s=30, tenant="t")
            except Overloaded as refused:
                assert "SLO" in str(refused)
                return admitted
        raise AssertionError("unreachable")

    at_two, at_four = admitted_behind_a_queue(2.0), admitted_behind_a_queue(4.0)
    assert 0 < at_four < at_two


def test_a_keys_linger_and_batch_size_gauges_refresh_at_most_every_period(
    tmp_path: Path,
) -> None:
    """After a batch the lane refreshes its key's linger and batch-size gauges, but at most
    every GAUGE_PERIOD_S on the driver's clock: a worker running many small batches no longer
    pays two predictions a batch for figures a scrape reads every few seconds. A refresh a
    batch skipped is made once due even when no batch of the key follows."""
    write_affine_model(tmp_path / "repo", slo_p99_ms=200)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    driver = BatchingDriver([backend], DriverConfig(), metrics, clock=FakeClock())
    lane = driver.open_lane(backend)
    key = lane_key(lane, backend.buckets[0])

    def gauge() -> float:
        return total(generate_latest(registry).decode(), names.WORKER_MAX_BATCH_SIZE)

    most = lane.batcher.shape_limit(key)
    lane.latency.observe(key, 1, 0.001)
    lane.latency.observe(key, most, 0.010)  # every batch fits the budget: the shape's limit
    lane.export_gauges_due(metrics, key, now_s=10.0)
    assert gauge() == most
    for _ in range(20):  # much slower now: the budget holds fewer rows
        lane.latency.observe(key, most, 1.0)
    assert lane.batcher.max_batch_size_for(key) < most
    lane.export_gauges_due(metrics, key, now_s=10.0 + GAUGE_PERIOD_S / 2)
    assert gauge() == most  # not yet due
    # No batch of the key follows (a burst's last): the driver's pass refreshes it once due,
    # and says when that is, to wake then.
    assert lane.refresh_gauges(metrics, 10.0 + GAUGE_PERIOD_S / 2) == 10.0 + GAUGE_PERIOD_S
    assert gauge() == most
    assert lane.refresh_gauges(metrics, 10.0 + GAUGE_PERIOD_S) is None
    assert gauge() == lane.batcher.max_batch_size_for(key) < most
    assert lane.refresh_gauges(metrics, 20.0) is None  # nothing stale


async def assert_loop_runs_until_done(drain: asyncio.Task[None], gate: threading.Event) -> None:
    """Checks that `drain` waits for the work `gate` holds without blocking the event loop:
    this test opens the gate itself once the drain waits, which a drain blocking the loop
    (joining the work's thread) would leave to a safety timer 10 s on. An order, not a time."""
    opened_by: list[str] = []

    def open_gate(by: str) -> None:
        if not gate.is_set():
            opened_by.append(by)
            gate.set()

    safety = threading.Timer(10.0, open_gate, ("timer",))
    safety.start()
    try:
        await asyncio.sleep(0.05)  # the drain runs into its wait
        assert not drain.done(), "the drain waits for the work"
        open_gate("test")
        await drain
    finally:
        safety.cancel()
    assert opened_by == ["test"], "the event loop ran while the drain waited"


async def test_a_stop_during_work_between_batches_waits_for_it_without_blocking_the_loop(
    tmp_path: Path,
) -> None:
    """A hot load's warm-up runs on the executor between batches; a stop cancels the load's
    task, but not the warm-up. The driver took the executor for idle: its drain joined the
    executor's thread from the event loop, which then answered nothing (health, fronts,
    generation) until the warm-up ended, and a row queued meanwhile was dispatched behind it,
    timed by the watchdog with it. Now the work counts until it ends, the row waits for it,
    and the drain waits for both without blocking the loop."""
    write_affine_model(tmp_path / "repo", slo_p99_ms=30_000)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    driver = BatchingDriver([backend], DriverConfig(), WorkerMetrics(CollectorRegistry()))
    driver.warm_up()
    driver.start()
    gate, entered = threading.Event(), threading.Event()

    def warm_up() -> None:  # stands for a new version's warm-up: held until the gate opens
        entered.set()
        gate.wait(timeout=30)

    load = asyncio.create_task(driver.between_batches(warm_up))
    await asyncio.to_thread(entered.wait, 10)
    load.cancel()  # the stop
    rows = backend.prepare_many([np.ones(4, dtype=np.float32)])
    answer = asyncio.create_task(driver.submit(backend, rows, timeout_s=20, tenant="t"))
    await asyncio.sleep(0.2)
    assert not driver.is_executing, "the row waits for the work between batches"
    drain = asyncio.create_task(driver.drain())
    await assert_loop_runs_until_done(drain, gate)
    (output,) = await answer  # served once the work ended: affine, FP32 [4] -> FP32 [2]
    assert output.shape == (2,) and np.isfinite(output).all()
    with pytest.raises(asyncio.CancelledError):
        await load


async def test_a_drain_after_the_loop_died_waits_for_work_between_batches_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batching loop died of a bug while a hot load's warm-up ran between batches: the
    drain found the loop done and joined the executor's thread from the event loop."""
    write_affine_model(tmp_path / "repo", slo_p99_ms=30_000)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    driver = BatchingDriver([backend], DriverConfig(), WorkerMetrics(CollectorRegistry()))
    driver.warm_up()
    fatal: list[Exception] = []
    driver.start(on_fatal=fatal.append)
    gate, entered = threading.Event(), threading.Event()

    def warm_up() -> None:
        entered.set()
        gate.wait(timeout=30)

    load = asyncio.create_task(driver.between_batches(warm_up))
    await asyncio.to_thread(entered.wait, 10)

    def broken_poll(*args: object, **kwargs: object) -> None:
        raise RuntimeError("batcher invariant broken")

    monkeypatch.setattr(Batcher, "poll", broken_poll)
    rows = backend.prepare_many([np.ones(4, dtype=np.float32)])
    with pytest.raises(Unavailable, match="batching stopped here"):
        await driver.submit(backend, rows, timeout_s=20, tenant="t")
    assert [str(e) for e in fatal] == ["batcher invariant broken"]
    load.cancel()
    drain = asyncio.create_task(driver.drain())
    await assert_loop_runs_until_done(drain, gate)
    await drain


def test_a_model_whose_slo_is_within_the_upstream_budget_is_refused(tmp_path: Path) -> None:
    # Its rows would all be admitted already past their SLO bound: every row refused while
    # another ran. Refused with both figures named, not served one row at a time.
    write_affine_model(tmp_path / "repo", slo_p99_ms=30)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"SLO \(30 ms\) must exceed the worker's upstream budget"):
        BatchingDriver(
            [backend], DriverConfig(upstream_budget_s=0.04), WorkerMetrics(CollectorRegistry())
        )


def fast_and_slow_versions(tmp_path: Path) -> tuple[Backend, Backend]:
    """Two versions of the affine model, the second's every call 50 ms longer."""
    write_versioned_affine_model(tmp_path / "repo", "affine", versions=(1, 2))
    fast, slow = (load_backend(v, torch.device("cpu")) for v in load_repository(tmp_path / "repo"))
    run = slow.run

    def slow_run(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        time.sleep(0.05)
        return run(rows)

    slow.run = slow_run  # type: ignore[method-assign]
    return fast, slow


async def test_the_watchdog_bound_is_lowered_again_once_a_slow_version_is_unloaded(
    tmp_path: Path,
) -> None:
    """The bound on one model call is raised to 10x the slowest warm-up batch; it only grew,
    so a slow version unloaded left every later call of a fast one watched as loosely, a
    wedged call noticed that much later (review finding)."""
    fast, slow = fast_and_slow_versions(tmp_path)
    config = DriverConfig(watchdog_s=0.05)
    driver = BatchingDriver([fast, slow], config, WorkerMetrics(CollectorRegistry()))
    assert driver.warm_up() == []
    driver.start()
    try:
        raised_s = driver.watchdog_s
        fast_warmup_s = driver._lanes[id(fast)].slowest_warmup_s
        await driver.remove_backend(slow)
        lowered_s = driver.watchdog_s
    finally:
        await driver.drain()
    assert raised_s >= 10 * 0.05  # WARMUP_MULTIPLE x the slow version's batches
    # The fast version's own bound, whatever its warm-up measured on this machine.
    assert lowered_s == pytest.approx(max(config.watchdog_s, 10 * fast_warmup_s))
    assert lowered_s < raised_s


async def test_a_version_unloaded_while_a_slow_one_is_added_leaves_the_slow_ones_bound(
    tmp_path: Path,
) -> None:
    """A slow version's warm-up raises the bound, on the executor; its lane joins the lanes
    batching once the loop resumes the load. An unload finishing on the loop in between
    computed the bound from the lanes without it: the slow version's calls then ran past the
    bound, and the worker took itself for wedged (review finding). The interleaving is made
    here by ending the fast version's unload right after the slow one's warm-up."""
    fast, slow = fast_and_slow_versions(tmp_path)
    config = DriverConfig(watchdog_s=0.05)
    driver = BatchingDriver([fast], config, WorkerMetrics(CollectorRegistry()))
    assert driver.warm_up() == []
    driver.start()
    between = driver.between_batches

    async def warm_up_then_unload(*args: Any, **kwargs: Any) -> None:
        await between(*args, **kwargs)
        driver._forget(driver._lanes[id(fast)])  # the unload, ending in between

    try:
        driver.between_batches = warm_up_then_unload  # type: ignore[method-assign]
        await driver.add_backend(slow)
        bound_s = driver.watchdog_s
    finally:
        await driver.drain()
    assert bound_s >= 10 * 0.05  # the slow version's own: WARMUP_MULTIPLE x its batches


async def test_a_thread_choice_that_fails_fails_its_batch_and_the_next_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's threads are chosen after its rows left the queue, with the executor marked
    busy: a choice that raised (a bug in it) left it marked so for good, the worker SERVING
    while no batch ever ran again and every caller waited out its deadline. Now that batch's
    rows fail UNAVAILABLE, the executor is freed and the next batch runs."""
    write_affine_model(tmp_path / "repo", slo_p99_ms=30_000)
    (version,) = load_repository(tmp_path / "repo")
    backend = load_backend(version, torch.device("cpu"))
    driver = BatchingDriver([backend], DriverConfig(), WorkerMetrics(CollectorRegistry()))
    driver.warm_up()
    choose = driver_module.batch_threads
    choices: list[int] = []

    def failing_first(*args: Any, **kwargs: Any) -> Any:
        choices.append(len(choices))
        if len(choices) == 1:
            raise RuntimeError("thread choice invariant broken")
        return choose(*args, **kwargs)

    monkeypatch.setattr(driver_module, "batch_threads", failing_first)
    fatal: list[Exception] = []
    driver.start(on_fatal=fatal.append)
    rows = backend.prepare_many([np.ones(4, dtype=np.float32)])
    try:
        with pytest.raises(Unavailable, match="could not run here"):
            await asyncio.wait_for(driver.submit(backend, rows, timeout_s=5, tenant="t"), 10)
        outputs = await asyncio.wait_for(driver.submit(backend, rows, timeout_s=5, tenant="t"), 10)
        assert len(outputs) == 1 and len(choices) == 2
        assert fatal == [] and not driver.is_executing
    finally:
        await asyncio.wait_for(driver.drain(), 10)  # a driver stuck on the batch never drains
