"""Scenario 22 for generation: a wedged model step stops the worker within the watchdog.

A real in-process worker on port 0 serves tiny-llama. Once the test's streams are decoding, the
next step's forward really blocks on the executor thread (on a `threading.Event` the test sets
at the end), the way a hung kernel or device would.

No figure here depends on how busy the machine is: the streams end no earlier than the bound,
by the watchdog (their message says so), and the stop is bounded by half the drain grace it
would otherwise wait out; the wait for health to flip is a generous condition bound."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from prometheus_client import generate_latest

from services.common import metric_names as names
from services.common.model_repository import ModelVersion
from services.gpu_worker.batching.watchdog import watchdog_bound_s
from services.gpu_worker.generation.model_runner import ModelRunner
from services.gpu_worker.generation.step_inputs import StepItem
from services.gpu_worker.server import SERVICE_NAME, Worker
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.in_process import start_lone_worker, swapper_for
from tests.support.metrics import total
from tests.support.models import tiny_llama_version
from tests.support.processes import REPO_ROOT, health_status
from tests.support.waiting import eventually, thread_ends

pytestmark = pytest.mark.integration

#: Long beside a tiny-llama step (milliseconds), so that a step slowed by a busy machine is
#: never taken for a wedged one before the test wedges one.
WATCHDOG_S = 2.0
#: How much earlier than the arm a wedged step's bound may have started counting: one of the
#: tiny model's steps (milliseconds), with room for a loaded machine.
STEP_SLACK_S = 0.05
#: Bound on the wait for the health flip after the answer (a condition wait: generous, it
#: costs nothing when health flips at once).
FLIP_TIMEOUT_S = 30.0


class WedgingRunner:
    """Wraps the live runner's `execute`: once `arm` is called, the next step's forward blocks
    on the executor thread until `release`; every other step runs the real forward."""

    def __init__(self, runner: ModelRunner) -> None:
        self._execute = runner.execute
        self._is_armed = threading.Event()
        self._released = threading.Event()
        self.wedged = threading.Event()

    def arm(self) -> None:
        self._is_armed.set()

    def release(self) -> None:
        self._released.set()

    def execute(self, items: Sequence[StepItem]) -> torch.Tensor:
        if self._is_armed.is_set() and not self.wedged.is_set():
            self.wedged.set()
            self._released.wait()
        return self._execute(items)


def generate_request(prompt: str) -> pb.WorkerGenerateRequest:
    return pb.WorkerGenerateRequest(
        model_name="tiny-llama",
        text=prompt,
        sampling=pb.SamplingParameters(max_tokens=200, ignore_eos=True),
    )


async def drain_stream(call: grpc.aio.UnaryStreamCall) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        while await call.read() != grpc.aio.EOF:
            pass
    return ended.value


async def not_serving(address: str) -> bool:
    statuses = [await health_status(address, service) for service in ("", SERVICE_NAME)]
    return statuses == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2


async def test_s22_a_wedged_generation_step_ends_its_streams_unavailable_and_stops_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(REPO_ROOT / "models" / "tiny-llama", tmp_path / "repo" / "tiny-llama")
    worker = await start_lone_worker(tmp_path / "repo", WATCHDOG_S)
    assert worker.models is not None
    (backend,) = worker.models.generation
    steps = backend.engine.steps
    # The worker's setting reached the engine, raised only for a slow warm-up as for batches.
    bound_s = steps.watchdog_s
    assert bound_s == watchdog_bound_s(WATCHDOG_S, steps.slowest_warmup_s) >= WATCHDOG_S
    wedging = WedgingRunner(backend.runner)
    monkeypatch.setattr(backend.runner, "execute", wedging.execute)
    address = f"127.0.0.1:{worker.port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            calls = [stub.Generate(generate_request(p), timeout=60) for p in ("one", "two")]
            for call in calls:
                assert (await call.read()).token_ids  # both decoding normally
            armed_at = time.monotonic()
            wedging.arm()
            errors = await asyncio.gather(*(drain_stream(call) for call in calls))
            answered_s = time.monotonic() - armed_at
            await eventually(
                lambda: not_serving(address),
                timeout_s=FLIP_TIMEOUT_S,
                interval_s=0.02,
                message="NOT_SERVING (overall and the worker service) after the watchdog",
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anext(aiter(stub.Generate(generate_request("three"), timeout=10)))
        assert wedging.wedged.is_set(), "the thread is still held: the step never returned"
    finally:
        stop_s = await timed_stop(worker)  # while the step is still held
        wedging.release()  # the wedged forward returns and its daemon thread ends
    for error in errors:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "executor watchdog" in (error.details() or "")
    # Not ended before the bound expired (and by the watchdog, not the 60 s deadline: above).
    # The wedged step may have started, and its bound with it, just before the arm (the loop
    # steps on while it is armed), and uvloop's timers count whole milliseconds: once, in make
    # test, the streams ended 0.4 ms short of the bound.
    assert answered_s >= bound_s - STEP_SLACK_S
    assert "executor watchdog" in str(worker.fatal_error)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "executor watchdog" in (refused.value.details() or "")
    # Drain leaves the wedged thread behind instead of waiting for it: a stop that waited would
    # take the whole drain grace (30 s), the thread being released only after the stop.
    assert stop_s < worker.config.drain_grace_s / 2, stop_s
    exported = generate_latest(worker.metrics.registry).decode()
    count = total(exported, names.WORKER_WATCHDOG_EXPIRED_TOTAL, model="tiny-llama", version="1")
    assert count == 1


#: The hot-load test's watchdog: each warm-up step of a version loaded while serving is bounded
#: at WARMUP_MULTIPLE x this (5 s), far past a tiny-llama warm-up step.
HOT_LOAD_WATCHDOG_S = 0.5
#: The thread a second tiny-llama version's steps run on.
NEW_VERSION_THREAD = "generation-tiny-llama/2"


@dataclass
class WedgingLoad:
    """A worker serving tiny-llama/1 and a tiny-llama/2 to load while it serves, whose steps
    block on the thread that runs them until `released` (set at the end)."""

    worker: Worker
    version: ModelVersion
    released: threading.Event
    wedged: threading.Event


async def wedging_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watchdog_s: float
) -> WedgingLoad:
    shutil.copytree(REPO_ROOT / "models" / "tiny-llama", tmp_path / "repo" / "tiny-llama")
    version = tiny_llama_version(tmp_path / "more", "2")
    worker = await start_lone_worker(tmp_path / "repo", watchdog_s)
    assert worker.models is not None
    (serving,) = worker.models.generation
    released, wedged = threading.Event(), threading.Event()
    execute = ModelRunner.execute

    def wedging_execute(runner: ModelRunner, items: Sequence[StepItem]) -> torch.Tensor:
        if runner is not serving.runner and not released.is_set():  # the new version's steps
            wedged.set()
            released.wait()
        return execute(runner, items)

    monkeypatch.setattr(ModelRunner, "execute", wedging_execute)
    return WedgingLoad(worker, version, released, wedged)


async def timed_stop(worker: Worker) -> float:
    """Stops `worker`; the seconds it took."""
    started = time.monotonic()
    await worker.stop()
    return time.monotonic() - started


async def test_s22_a_hot_loaded_generation_version_whose_warm_up_wedges_stops_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation version loaded while serving warms up on its own step thread before its
    engine starts. A warm-up step that never returns (a hung device) is bounded at
    WARMUP_MULTIPLE x the watchdog: the load fails, counted, and the worker stops serving as for
    a serving step past the watchdog (before, the load never ended: the repository follower
    waited for good, applying no later change, while the worker said SERVING)."""
    load = await wedging_load(tmp_path, monkeypatch, HOT_LOAD_WATCHDOG_S)
    worker, version, released, wedged = load.worker, load.version, load.released, load.wedged
    assert worker.models is not None
    address = f"127.0.0.1:{worker.port}"
    swapper = swapper_for(worker, HOT_LOAD_WATCHDOG_S)
    try:
        # Only the watchdog can end the load (the bound is a condition wait's, far past it).
        is_loaded = await asyncio.wait_for(swapper.load(version), timeout=FLIP_TIMEOUT_S)
        await eventually(
            lambda: not_serving(address),
            timeout_s=FLIP_TIMEOUT_S,
            interval_s=0.02,
            message="NOT_SERVING (overall and the worker service) after the warm-up's watchdog",
        )
        assert wedged.is_set(), "the new version's warm-up never ran a step"
    finally:
        stop_s = await timed_stop(worker)  # while the step is still held
        released.set()  # the wedged warm-up step returns and its daemon threads end
    # The given-up warm-up let its step thread go: once its held step returns, the thread ends.
    await thread_ends(NEW_VERSION_THREAD, timeout_s=FLIP_TIMEOUT_S)
    assert is_loaded is False
    assert [(b.config.name, b.version.version) for b in worker.models.generation] == [
        ("tiny-llama", "1")
    ]
    failed = {(f.model, f.version): f.error for f in worker.models.failed}
    assert list(failed) == [("tiny-llama", "2")]
    assert (
        "a warm-up step of tiny-llama/2 ran past the executor watchdog"
        in failed[("tiny-llama", "2")]
    )
    assert "executor watchdog" in str(worker.fatal_error)
    # The stop leaves the wedged threads behind (a stop that joined them would wait for good).
    assert stop_s < worker.config.drain_grace_s / 2, stop_s
    exported = generate_latest(worker.metrics.registry).decode()
    expired = names.WORKER_WATCHDOG_EXPIRED_TOTAL
    assert total(exported, expired, model="tiny-llama", version="2") == 1
    assert total(exported, expired, model="tiny-llama", version="1") == 0


async def test_a_hot_load_cancelled_during_its_warm_up_lets_its_step_thread_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load cancelled while a generation version warms up, well within the bound (as a
    worker's stop cancels its repository follower's): the version's step thread is let go (it
    ends once its held step returns), not left waiting for steps for good, and nothing counts
    as wedged."""
    load = await wedging_load(tmp_path, monkeypatch, watchdog_s=30.0)  # bound: 300 s
    worker = load.worker
    assert worker.models is not None
    loading = asyncio.ensure_future(swapper_for(worker, 30.0).load(load.version))
    try:
        await eventually(load.wedged.is_set, timeout_s=FLIP_TIMEOUT_S, interval_s=0.02)
        loading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loading
        assert NEW_VERSION_THREAD in {t.name for t in threading.enumerate()}  # still held
        load.released.set()
        await thread_ends(NEW_VERSION_THREAD, timeout_s=FLIP_TIMEOUT_S)
    finally:
        loading.cancel()
        load.released.set()
        await worker.stop()
    assert worker.fatal_error is None
    assert [(b.config.name, b.version.version) for b in worker.models.generation] == [
        ("tiny-llama", "1")
    ]
    exported = generate_latest(worker.metrics.registry).decode()
    assert total(exported, names.WORKER_WATCHDOG_EXPIRED_TOTAL, model="tiny-llama") == 0
