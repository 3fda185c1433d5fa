"""The router's catalog (services.router.catalog): what ListModels tells gateways of a version
several workers serve, from the registry snapshot."""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, cast

import grpc
import pytest

from services.common.registry_schema import FailedVersion, WorkerRecord
from services.pb.inference.v1 import worker_pb2 as pb
from services.router.catalog import Catalog
from services.router.routing import RouteTable
from services.router.routing_config import RoutingConfig
from tests.support.records import model_record

pytestmark = pytest.mark.unit


def worker(worker_id: str, *, draining: bool = False, **model: Any) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        address=f"{worker_id}:50051",
        is_draining=draining,
        sent_at_ms=0,
        models=(model_record(**model),),
    )


async def listing(*workers: WorkerRecord) -> pb.ListWorkerModelsResponse:
    table = RouteTable(RoutingConfig(), random.Random(0))
    now_s = time.monotonic()
    table.update([(w, now_s) for w in workers], now_s)
    context = cast(grpc.aio.ServicerContext[Any, Any], None)
    return await Catalog(table).list_models(pb.ListWorkerModelsRequest(), context)


async def listed(*workers: WorkerRecord) -> list[pb.ModelVersionInfo]:
    return list((await listing(*workers)).versions)


async def test_a_load_failure_is_told_with_the_revision_it_followed() -> None:
    """A gateway's load answers only failures at its own revision at once
    (repository_control.load_failures_to_answer): the revision must reach it."""
    failed = dataclasses.replace(worker("w0"), failed=(FailedVersion("m", "2", "boom", 41),))
    (failure,) = (await listing(failed)).load_failures
    assert (failure.model_name, failure.model_version, failure.worker_id) == ("m", "2", "w0")
    assert (failure.error, failure.revision) == ("boom", 41)


async def test_a_versions_fingerprints_are_a_serving_workers() -> None:
    """Workers disagree during a rolling update that re-staged a version's files: the first by
    id (draining, or not ready) held the old ones. Before, its fingerprint was told, and every
    call the gateway stamped with it was refused FAILED_PRECONDITION by the serving workers
    (review finding)."""
    old = {"fingerprint": "old", "tokenizer_fingerprint": "old-t"}
    new = {"fingerprint": "new", "tokenizer_fingerprint": "new-t"}
    for stale in (worker("w0", draining=True, **old), worker("w0", is_ready=False, **old)):
        (version,) = await listed(stale, worker("w1", **new))
        assert (version.fingerprint, version.tokenizer_fingerprint) == ("new", "new-t")
        assert version.is_ready
    # None serving: the version is told, not ready, with the first's facts.
    (version,) = await listed(worker("w0", draining=True, **old))
    assert (version.fingerprint, version.is_ready) == ("old", False)


async def test_a_versions_revision_is_the_highest_a_ready_worker_applied_or_none() -> None:
    """A load of a model unloaded before waits for a worker that applied it
    (repository_control.load): the router tells the highest revision a ready worker serving
    the version applied; none where only workers of a build before (-1) serve it."""
    (info,) = await listed(
        worker("w0", revision=41), worker("w1", revision=45),
        worker("w2", revision=99, is_ready=False), worker("w3", revision=98, draining=True),
    )  # fmt: skip
    assert info.HasField("revision") and info.revision == 45
    (info,) = await listed(worker("w0"), worker("w1", revision=-1))  # records without one
    assert not info.HasField("revision")
    (info,) = await listed(worker("w0", revision=0), worker("w1"))
    assert info.HasField("revision") and info.revision == 0
