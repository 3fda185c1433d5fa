"""The gateway exports, per model of its repository, the versions a ready live worker serves
(`inference_gateway_model_ready_versions`, read by the FabricModelUnserved alert), set at each
catalog refresh from the router's listing: a real in-process fabric (redis-server, router,
worker, gateway) serving the affine and `stall` models. The count of a model no ready worker
serves (0) is `unit/test_model_routing.py`'s."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from services.common import metric_names as names
from tests.support.in_process import affine_and_stall_fabric
from tests.support.metrics import samples
from tests.support.redis import RedisServer

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
