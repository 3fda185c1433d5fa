"""A gateway's routing sync (services.gateway.routing_sync) against a real Redis: each model's
stored routing is read on its own, and one that cannot be read leaves the others applied."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.model_repository import load_repository
from services.common.model_routing import ModelRouting, routing_key
from services.common.redis_acl import GATEWAY
from services.common.registry_schema import connect
from services.gateway.catalog import ModelCatalog
from services.gateway.routing_sync import RoutingSync
from tests.support.models import write_versioned_affine_model
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration


async def test_a_field_that_is_no_utf8_fails_its_own_model_alone(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A field name, and another model's value, that are not UTF-8: the model whose routing
    reads is applied, the unreadable one keeps its routing in force. Before, decoding every
    field before the per-model reads raised out of each round: no model's routing moved."""
    repository = tmp_path / "repo"
    write_versioned_affine_model(repository, "affine", versions=(1, 2))
    write_versioned_affine_model(repository, "other", versions=(1, 2))
    catalog = ModelCatalog(load_repository(repository))
    sync = RoutingSync(
        catalog,
        redis_url=redis_server.role_url(GATEWAY),
        password_file=None,
        key_prefix="fabric",
    )
    admin = connect(redis_server.url)
    routing = ModelRouting({"stable": 2}, revision=3)
    try:
        await admin.hset(
            routing_key("fabric"),
            mapping={"affine": routing.dumps(), b"\xff\xfe": b"{}", "other": b'{"\xff": 1}'},
        )
        assert await sync.sync_once() == ["affine"]
        assert catalog.routing("affine") == routing
        assert catalog.routing("other").revision == 0  # the repository's, still in force
    finally:
        await sync.stop()
        await admin.aclose()
