"""The job runner's rule for a chunk that keeps running past its call's deadline once the
fleet's patience is spent (services.jobs.runner, services.jobs.chunk_calls): its items are run
alone, so one that hangs the model fails alone. The store and the gateway are stand-ins here
(their answers are what the rule reads); tests/integration/test_jobs.py runs the real ones."""

from __future__ import annotations

import time
from typing import cast

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.job_policy import (
    FLEET_PATIENCE_S,
    FLEET_ROUNDS,
    ItemCounts,
    ItemStatus,
    RetryPolicy,
)
from services.common.job_records import JobRecord
from services.common.job_store import JobStore
from services.jobs.chunk_calls import FleetRound
from services.jobs.metrics import RunnerMetrics
from services.jobs.runner import JobRunner
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import worker_pb2 as pb

pytestmark = pytest.mark.unit

HANGS = "hangs"


class _SpentStore:
    """A store whose chunk has waited out the fleet's rounds and patience."""

    async def get(self, job_id: str) -> JobRecord | None:
        return _job()  # not cancelled, not gone: each item split off runs

    async def fleet_round(self, job_id: str, start: int, now_s: float) -> tuple[int, float]:
        return FLEET_ROUNDS, FLEET_PATIENCE_S


def _job() -> JobRecord:
    return JobRecord(
        job_id="j", tenant="t", model_name="m", model_version="", priority="batch",
        num_items=4, counts=ItemCounts(num_ok=0, num_failed=0, num_cancelled=0),
        created_s=time.time(), started_s=0.0, complete_by_s=0.0, idempotency_key="",
        is_cancelled=False,
    )  # fmt: skip


async def test_a_chunk_past_its_deadline_after_the_fleets_patience_is_run_item_by_item() -> None:
    """Before, its every item failed DEADLINE_EXCEEDED, the good ones with the one that hangs
    (review finding)."""
    calls: list[int] = []

    async def predict(request: api.PredictRequest) -> api.PredictResponse:
        calls.append(len(request.inputs))
        if any(i.text == HANGS for i in request.inputs):
            empty = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, empty, empty, "late")
        tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[1], raw_data=b"\0\0\0\0")
        return api.PredictResponse(outputs=[tensor] * len(request.inputs))

    store = cast(JobStore, _SpentStore())
    runner = JobRunner(
        store, predict, RunnerMetrics(CollectorRegistry()), consumer="r",
        retry=RetryPolicy(max_attempts=2, base_delay_s=0.0), max_in_flight_chunks=1,
        claim_timeout_s=30.0,
    )  # fmt: skip
    texts = ["a", HANGS, "b", "c"]
    items = [(i, api.PredictInput(text=t).SerializeToString()) for i, t in enumerate(texts)]
    job = _job()
    outcomes = await runner._run_items(job, items, FleetRound(store, job.job_id, 0, 0.0))
    assert [(o.index, o.status, o.code) for o in outcomes] == [
        (0, ItemStatus.OK, ""), (1, ItemStatus.FAILED, "DEADLINE_EXCEEDED"),
        (2, ItemStatus.OK, ""), (3, ItemStatus.OK, ""),
    ]  # fmt: skip
    assert calls[:2] == [4, 4] and sorted(calls[2:]) == [1, 1, 1, 1, 1]
