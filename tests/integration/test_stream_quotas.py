"""A tenant's quotas hold inside one ModelStreamInfer stream: each generation it carries is
admitted as a call of its own (a real in-process fabric serving tiny-llama, a gateway with a
keys file, a stock-shaped KServe stream)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest

from services.gateway.auth import hash_key
from services.gateway.config import GatewayConfig
from services.gateway.http.kserve_rest import generate_request
from services.gateway.server import create_gateway
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from tests.support.in_process import PERIOD_S, running_fabric
from tests.support.processes import REPO_ROOT
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"
KEY = "stream-key"


async def test_one_stream_runs_no_more_generations_than_the_tenants_max_concurrency(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Five long generations on one stream of a tenant allowed 2 calls in flight: 2 run, the
    other 3 are refused in-band RESOURCE_EXHAUSTED (before, the stream was admitted once and
    all five ran)."""
    repository = tmp_path / "repo"
    repository.mkdir()
    shutil.copytree(REPO_ROOT / "models" / MODEL, repository / MODEL)
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\ntenant = "t"\nsha256 = "{hash_key(KEY)}"\n\n[tenants.t]\nmax_concurrency = 2\n'
    )
    async with running_fabric(repository, redis_server, with_gateway=False) as fabric:
        gateway = await create_gateway(
            GatewayConfig(
                model_repository=repository,
                router_address=fabric.router_address,
                grpc_port=0,
                metrics_port=0,
                http_port=-1,
                catalog_refresh_s=PERIOD_S,
                api_keys_file=keys,
            )
        )
        catalog = asyncio.create_task(gateway.refresh_catalog())
        try:
            await eventually(lambda: bool(gateway.catalog.served_versions(MODEL)), message="served")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                requests = []
                for i in range(5):
                    body = {"id": f"r{i}", "text_input": "hello",
                            "parameters": {"max_tokens": 300, "ignore_eos": True}}  # fmt: skip
                    requests.append(generate_request(MODEL, "", body))
                stream = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                    iter(requests), metadata=(("authorization", f"Bearer {KEY}"),), timeout=60
                )
                refused: set[str] = set()
                running: set[str] = set()
                async for response in stream:
                    assert isinstance(response, kserve.ModelStreamInferResponse)
                    request_id = response.infer_response.id
                    if response.error_message:
                        assert response.error_message.startswith("RESOURCE_EXHAUSTED")
                        refused.add(request_id)
                    else:
                        running.add(request_id)
                    if len(refused) + len(running) == 5:
                        break
                    assert len(running) <= 2, (running, refused)
                stream.cancel()
            assert (len(running), len(refused)) == (2, 3)
        finally:
            catalog.cancel()
            await gateway.stop()
