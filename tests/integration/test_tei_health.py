"""TEI's `/health` on the gateway's HTTP port, while no worker serves its model (real gateway
and router in-process, a real Redis): 503, TEI's `Unhealthy`, open to callers without a key
as the gateway's own probes are. `e2e/test_embedding_apis.py` reads its 200 from a stack
that serves."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.server import create_gateway
from services.router.config import RouterConfig
from services.router.server import create_router
from tests.support.keys import write_keys_with_tight_tenant
from tests.support.models import write_small_minilm_repository
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration


def get(port: int, path: str) -> tuple[int, dict[str, object]]:
    """The status and JSON body (empty when none) of GET `path`, sent without a key."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            body = answer.read()
            return answer.status, json.loads(body) if body else {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


async def test_tei_health_is_503_while_no_ready_worker_serves_the_model(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    repository = write_small_minilm_repository(tmp_path / "repo")
    keys = write_keys_with_tight_tenant(tmp_path / "keys.toml", tenant="t", key="k", tight_key="tk")
    router = await create_router(
        RouterConfig(redis_url=redis_server.router_url, grpc_port=0, metrics_port=0)
    )
    gateway = await create_gateway(
        GatewayConfig(
            model_repository=repository,
            router_address=f"127.0.0.1:{router.port}",
            grpc_port=0,
            metrics_port=0,
            http_port=0,
            api_keys_file=keys,  # /health is open all the same
        )
    )
    try:
        assert gateway.http is not None
        status, body = await asyncio.to_thread(get, gateway.http.port, "/health")
        assert (status, body.get("error_type")) == (503, "Unhealthy")
        # The model's own routes still ask for a key.
        assert (await asyncio.to_thread(get, gateway.http.port, "/info"))[0] == 401
    finally:
        await gateway.stop()
        await router.stop()
