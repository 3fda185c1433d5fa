"""Every tier's `/metrics` carries the standard process metrics and `inference_build_info`:
gateway, router and worker built in one process on port 0 (each on its own registry, as in
production), their registries served over HTTP and scraped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.common import metric_names as names
from services.common.telemetry import package_version
from services.gateway.config import GatewayConfig
from services.gateway.server import create_gateway
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.server import create_worker
from services.router.config import RouterConfig
from services.router.server import create_router
from tests.support.metrics import samples, scrape, serving
from tests.support.models import write_affine_model
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def tier_scrapes(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[dict[str, str]]:
    """Each tier's `/metrics` text, by tier name."""
    repository = tmp_path / "repo"
    write_affine_model(repository)
    worker = await create_worker(
        WorkerConfig(model_repository=repository, grpc_port=0, metrics_port=0)
    )
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
            allow_unauthenticated=True,
        )
    )
    try:
        tiers = {"gateway": gateway, "router": router, "worker": worker}
        scrapes = {}
        for tier, service in tiers.items():
            with serving(service.metrics.registry) as port:
                scrapes[tier] = await asyncio.to_thread(scrape, port)
        yield scrapes
    finally:
        await gateway.stop()
        await router.stop()
        await worker.stop()


async def test_every_tier_exports_process_metrics_and_build_info(
    tier_scrapes: dict[str, str],
) -> None:
    for tier, text in tier_scrapes.items():
        for name in (
            names.PROCESS_RESIDENT_MEMORY_BYTES,
            names.PROCESS_CPU_SECONDS_TOTAL,
            names.PROCESS_OPEN_FDS,
        ):
            ((_, value),) = samples(text, name)
            assert value > 0, f"{tier}: {name} = {value}"
        assert samples(text, names.BUILD_INFO) == [
            ({"tier": tier, "version": package_version()}, 1.0)
        ], tier
