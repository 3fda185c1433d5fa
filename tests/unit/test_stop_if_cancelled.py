"""A loop told to stop stops, even when a library swallowed its cancellation or turned it into
an error."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import cast

import grpc
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from services.common.job_policy import FLEET_PATIENCE_S, FLEET_ROUNDS, ItemCounts, RetryPolicy
from services.common.job_records import JobRecord
from services.common.job_store import JobStore
from services.common.lifecycle import cancel_and_wait, sleep_unless_stopped, stop_if_cancelled
from services.common.model_repository import ModelVersion
from services.gpu_worker.hot_swap import ModelSwapper
from services.gpu_worker.loaded_models import LoadedModels
from services.gpu_worker.repository_follower import RepositoryFollower
from services.jobs.chunk_calls import FleetRound
from services.jobs.metrics import RunnerMetrics
from services.jobs.runner import JobRunner
from services.pb.inference.v1 import inference_pb2 as api
from tests.support.models import write_affine_model

pytestmark = pytest.mark.unit


async def test_a_loop_whose_cancellation_a_library_swallowed_still_stops() -> None:
    rounds = 0

    async def library_call() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:  # a library turning a cancel into an error of its own
            raise TimeoutError("timed out") from None

    async def loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            try:
                await library_call()
            except TimeoutError:
                stop_if_cancelled()
            await asyncio.sleep(0.001)

    task = asyncio.get_running_loop().create_task(loop())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert rounds == 1  # stopped where the error was caught, not on a later round


async def test_an_error_in_a_task_not_cancelled_is_left_to_the_loop() -> None:
    """The library's TimeoutError of a task nobody cancelled is the loop's to handle: it goes
    on to its next round."""
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while rounds < 3:
            rounds += 1
            try:
                raise TimeoutError("timed out")
            except TimeoutError:
                stop_if_cancelled()  # nothing asked this task to stop: returns

    await asyncio.wait_for(loop(), timeout=5)
    assert rounds == 3


async def _written_as_the_stop_arrives() -> str:
    """What redis-py's write of a command does on Python 3.11 when a stop arrives just as the
    write completes (it writes through `asyncio.wait_for` when a socket timeout is set): the
    stdlib's wait_for returns the result, and the task's cancellation is lost."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    written: asyncio.Future[str] = loop.create_future()
    loop.call_soon(written.set_result, "written")
    loop.call_soon(task.cancel)
    return await asyncio.wait_for(written, timeout=5)


#: Whether this Python's wait_for loses a cancel that races its result (it did before 3.12).
WAIT_FOR_SWALLOWS = sys.version_info < (3, 12)


async def test_a_round_that_swallowed_the_stop_ends_the_loop_before_it_sleeps() -> None:
    rounds_completed = 0

    async def loop() -> None:
        nonlocal rounds_completed
        while True:
            await _written_as_the_stop_arrives()
            rounds_completed += 1
            await sleep_unless_stopped(60)

    task = asyncio.get_running_loop().create_task(loop())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert rounds_completed == (1 if WAIT_FOR_SWALLOWS else 0)


async def test_sleep_unless_stopped_sleeps_in_a_task_not_cancelled() -> None:
    timers_fired: list[str] = []
    asyncio.get_running_loop().call_later(0.005, timers_fired.append, "earlier timer")
    await sleep_unless_stopped(0.01)
    assert timers_fired == ["earlier timer"]  # it slept: a timer due before its end ran first


class _RedisSwallowingTheFirstStop:
    """The follower's Redis client: its first read completes as the stop arrives."""

    def __init__(self) -> None:
        self.num_reads = 0

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        self.num_reads += 1
        if self.num_reads == 1:
            await _written_as_the_stop_arrives()
        return {}  # no desired state: every model on the volume is wanted


class _RecordingSwapper:
    """Records the loads the follower asks for (none may follow a stop)."""

    def __init__(self) -> None:
        self.loads: list[str] = []

    async def load(self, version: ModelVersion, *, revision: int = 0) -> bool:
        self.loads.append(version.config.name)
        return True


async def test_the_repository_follower_stops_when_a_read_swallowed_its_stop(
    tmp_path: Path,
) -> None:
    """A worker's stop once waited on its follower until the stop bound killed the process
    (exit 1): the stop arrived as a Redis write completed, and the follower slept and read
    again, once a second, never to stop. Nor may the read's round go on to load a model that
    is on the volume but not served (a load can outlast the stop's bound)."""
    write_affine_model(tmp_path)
    client = _RedisSwallowingTheFirstStop()
    swapper = _RecordingSwapper()
    follower = RepositoryFollower(
        client=cast(aioredis.Redis, client),
        registry_prefix="fabric",
        repository_dir=tmp_path,
        pool=(),
        models=LoadedModels(),  # nothing served: the affine model is a load to make
        swapper=cast(ModelSwapper, swapper),
    )
    task = asyncio.get_running_loop().create_task(follower.run())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert client.num_reads == 1
    assert swapper.loads == []


async def test_the_repository_follower_loads_what_is_wanted_when_not_stopped(
    tmp_path: Path,
) -> None:
    """The same follower and volume, with no stop: its round loads the model (so the test
    above would see a load were the stop not honoured mid-round)."""
    write_affine_model(tmp_path)
    swapper = _RecordingSwapper()
    client = _RedisSwallowingTheFirstStop()
    client.num_reads = 1  # its reads complete normally
    follower = RepositoryFollower(
        client=cast(aioredis.Redis, client),
        registry_prefix="fabric",
        repository_dir=tmp_path,
        pool=(),
        models=LoadedModels(),
        swapper=cast(ModelSwapper, swapper),
    )
    await follower.follow_once()
    assert swapper.loads == ["affine"]


class _JobStoreSwallowingTheStop:
    """The job store: its re-read of the job before a retry completes as a drain's cancel
    arrives."""

    def __init__(self, job: JobRecord) -> None:
        self.job = job
        self.num_reads = 0

    async def get(self, job_id: str) -> JobRecord:
        self.num_reads += 1
        await _written_as_the_stop_arrives()
        return self.job

    async def fleet_round(self, job_id: str, start: int, now_s: float) -> tuple[int, float]:
        # The fleet's patience is spent: the items fail, not the chunk.
        return FLEET_ROUNDS, FLEET_PATIENCE_S


async def test_a_job_chunk_retrying_stops_when_the_job_read_swallowed_the_drain() -> None:
    """A runner's drain cancels the chunks still running past its grace and waits for them:
    a chunk whose re-read of its job swallowed the cancel must not send its call again (each
    attempt may take the call's whole timeout, past the stop's bound)."""
    job = JobRecord(
        job_id="j",
        tenant="t",
        model_name="m",
        model_version="",
        priority="batch",
        num_items=1,
        counts=ItemCounts(num_ok=0, num_failed=0, num_cancelled=0),
        created_s=time.time(),
        started_s=0.0,
        complete_by_s=0.0,
        idempotency_key="",
        is_cancelled=False,
    )
    store = _JobStoreSwallowingTheStop(job)
    num_calls = 0

    async def predict(request: api.PredictRequest) -> api.PredictResponse:
        nonlocal num_calls
        num_calls += 1
        empty = grpc.aio.Metadata()
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, empty, empty, "no worker")

    runner = JobRunner(
        cast(JobStore, store),
        predict,
        RunnerMetrics(CollectorRegistry()),
        consumer="runner-0",
        retry=RetryPolicy(max_attempts=5, base_delay_s=0.0),
        max_in_flight_chunks=1,
        claim_timeout_s=30.0,
    )
    items = [(0, api.PredictInput(text="hello").SerializeToString())]
    fleet_round = FleetRound(cast(JobStore, store), job.job_id, 0, FLEET_PATIENCE_S)
    task = asyncio.get_running_loop().create_task(runner._run_items(job, items, fleet_round))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert (num_calls, store.num_reads) == (1, 1)


async def test_cancel_and_wait_returns_once_the_task_has_ended() -> None:
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(loop())
    await asyncio.sleep(0)
    await cancel_and_wait(task, "the loop")
    assert task.cancelled()
    ended_at = rounds
    await asyncio.sleep(0)
    assert rounds == ended_at
    await cancel_and_wait(None, "nothing started")  # a task never started: nothing to do


async def test_cancel_and_wait_logs_the_error_a_task_died_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def dies() -> None:
        raise ValueError("a bug")

    task = asyncio.get_running_loop().create_task(dies())
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR):
        await cancel_and_wait(task, "the sync")  # returns: its owner's stop goes on
    assert "the sync had stopped on an error" in caplog.text
    assert "ValueError: a bug" in caplog.text


async def test_cancel_and_wait_raises_a_cancel_of_its_caller() -> None:
    """A stop cancelled while it waits (its own bound ran out) stops too, rather than take
    the cancel for the task's and go on."""

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            raise

    task = asyncio.get_running_loop().create_task(slow_to_stop())
    await asyncio.sleep(0)
    stop = asyncio.get_running_loop().create_task(cancel_and_wait(task, "the task"))
    await asyncio.sleep(0)  # the stop is waiting on the task now
    stop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(stop, timeout=5)
    assert task.done()


async def test_cancel_and_wait_in_a_cancelled_stops_cleanup_goes_on() -> None:
    """A stop cancelled earlier (its `finally` closing what it owns) is not cancelled again by
    the task's own cancel: the cleanup after it runs."""
    cleaned_up = False
    task = asyncio.get_running_loop().create_task(asyncio.sleep(60))

    async def stop() -> None:
        nonlocal cleaned_up
        try:
            await asyncio.sleep(60)  # the drain, cut by a cancel
        finally:
            await cancel_and_wait(task, "the task")
            cleaned_up = True

    stopping = asyncio.get_running_loop().create_task(stop())
    await asyncio.sleep(0)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(stopping, timeout=5)
    assert cleaned_up
    assert task.cancelled()


async def test_cancel_and_wait_raises_its_callers_cancel_that_the_task_swallowed() -> None:
    async def swallows_a_cancel() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:  # its own stop: it winds down
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)  # the caller's cancel ends it here, and is lost

    task = asyncio.get_running_loop().create_task(swallows_a_cancel())
    await asyncio.sleep(0)
    stop = asyncio.get_running_loop().create_task(cancel_and_wait(task, "the task"))
    await asyncio.sleep(0.01)  # the task is winding down, the stop waiting on it
    stop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(stop, timeout=5)
    assert task.done() and not task.cancelled()  # it did swallow the caller's cancel
