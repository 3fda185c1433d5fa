"""The gateway exports, per model of its repository, the versions a ready live worker serves
(`inference_gateway_model_ready_versions`, read by the FabricModelUnserved alert), set at each
catalog refresh from the router's listing: a real in-process fabric (redis-server, router,
worker, gateway) serving the affine and `stall` models. The count of a model no ready worker
serves (0) is `unit/test_model_routing.py`'s."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest

from services.common import metric_names as names
from services.common.redis_acl import GATEWAY
from services.common.registry_schema import connect
from services.common.repository_state import DesiredState, ModelState, repository_key
from services.gateway.quota_sync import QuotaSyncConfig
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.fabric_load import predict_row_request
from tests.support.in_process import PERIOD_S, affine_and_stall_fabric
from tests.support.metrics import samples
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


async def test_each_served_model_counts_its_ready_versions(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with affine_and_stall_fabric(tmp_path, redis_server) as fabric:
        counts = {
            model: fabric.gateway_metric(names.GATEWAY_MODEL_READY_VERSIONS, model=model)
            for model in ("affine", "stall")
        }
    assert counts == {"affine": 1, "stall": 1}


async def test_a_model_gone_from_the_repository_is_no_longer_exported(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A model the catalog forgot (gone from the repository, no worker serving it) leaves the
    gauge at the next refresh: its last 0 would have fired FabricModelUnserved for good (a
    review finding). The refresh's steps run here in one turn of the loop, the fleet view
    as if the router no longer listed `stall`."""
    async with affine_and_stall_fabric(tmp_path, redis_server) as fabric:
        gateway = fabric.gateway
        gateway.catalog.update_served(gateway.catalog.served_versions("affine"))
        assert gateway.catalog.forget_versions({("affine", "1")}) == ["stall/1"]
        gateway._export_ready_versions()
        text = generate_latest(gateway.metrics.registry).decode()
    assert samples(text, names.GATEWAY_MODEL_READY_VERSIONS) == [({"model": "affine"}, 1.0)]


async def test_a_removed_versions_rows_series_and_statistics_leave_the_gateway(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """What the catalog's retirement removes (the version forgotten RETIRED_SERIES_S ago,
    `unit/test_catalog_hot_load.py`): its rows counter and Triton's statistics of it, which
    every rollout left behind for good (review finding)."""
    async with affine_and_stall_fabric(tmp_path, redis_server) as fabric:
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            await stub.Predict(predict_row_request(np.ones(4, np.float32)), timeout=10)
        gateway = fabric.gateway
        assert fabric.gateway_metric(names.GATEWAY_INPUTS_TOTAL, model="affine", version="1") == 1
        assert gateway.predictor.statistics.versions("affine") == ["1"]
        for remove in gateway.catalog.on_removed:
            remove("affine", "1")
        text = generate_latest(gateway.metrics.registry).decode()
        assert samples(text, names.GATEWAY_INPUTS_TOTAL) == []
        assert gateway.predictor.statistics.versions("affine") == []


async def test_a_model_unloaded_through_the_repository_api_is_not_exported(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A model an operator unloaded (RepositoryModelUnload) is served by no worker on purpose:
    its 0 would fire FabricModelUnserved (a review finding), so it is not exported, whether
    this gateway wrote the unload or another one did (read from the desired state); loaded
    again, it counts its ready versions again."""
    sync = QuotaSyncConfig(redis_url=redis_server.role_url(GATEWAY), period_s=PERIOD_S)
    settings = {"gateway_settings": {"quota_sync": sync}}
    async with affine_and_stall_fabric(tmp_path, redis_server, **settings) as fabric:
        gateway = fabric.gateway
        assert gateway.repository is not None
        await gateway.repository.set_state("stall", ModelState.UNLOADED)
        gateway._export_ready_versions()  # at once, before any worker unloaded it
        exported = samples(
            generate_latest(gateway.metrics.registry).decode(), names.GATEWAY_MODEL_READY_VERSIONS
        )
        assert exported == [({"model": "affine"}, 1.0)]
        admin = connect(redis_server.url)
        try:  # another gateway's load
            entry = DesiredState(ModelState.LOADED, int(time.time() * 1000) + 1)
            await admin.hset(repository_key("fabric"), "stall", entry.to_json())
        finally:
            await admin.aclose()
        await eventually(
            lambda: fabric.gateway_metric(names.GATEWAY_MODEL_READY_VERSIONS, model="stall") == 1,
            timeout_s=30.0,
            message="stall was not exported again once loaded",
        )
