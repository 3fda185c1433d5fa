"""A tenant's quotas hold for ModelStreamInfer: a stream counts in flight while it lives, idle
or not, and the generations it carries beyond its first running one are admitted as calls of
their own (a real in-process fabric serving tiny-llama, a gateway with a keys file, stock-shaped
KServe streams)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from services.gateway.auth import hash_key
from services.gateway.config import GatewayConfig
from services.gateway.http.kserve_rest import generate_request
from services.gateway.server import Gateway, create_gateway
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from tests.support.in_process import PERIOD_S, running_fabric
from tests.support.processes import REPO_ROOT
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"
KEY = "stream-key"
METADATA = (("authorization", f"Bearer {KEY}"),)


@asynccontextmanager
async def _gateway_of_a_tenant_allowed_two(
    tmp_path: Path, redis_server: RedisServer
) -> AsyncIterator[Gateway]:
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
            yield gateway
        finally:
            catalog.cancel()
            await gateway.stop()


def _long_generation(request_id: str) -> kserve.ModelInferRequest:
    body = {"id": request_id, "text_input": "hello",
            "parameters": {"max_tokens": 300, "ignore_eos": True}}  # fmt: skip
    return generate_request(MODEL, "", body)


async def test_one_stream_runs_no_more_generations_than_the_tenants_max_concurrency(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Five long generations on one stream of a tenant allowed 2 calls in flight: 2 run (the
    first in the stream's own place), the other 3 are refused in-band RESOURCE_EXHAUSTED
    (before, the stream was admitted once and all five ran)."""
    async with (
        _gateway_of_a_tenant_allowed_two(tmp_path, redis_server) as gateway,
        grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel,
    ):
        requests = [_long_generation(f"r{i}") for i in range(5)]
        stream = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter(requests), metadata=METADATA, timeout=60
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


async def test_idle_streams_count_against_the_tenants_max_concurrency(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two streams that have sent nothing hold the tenant's 2 places: a third stream is
    refused RESOURCE_EXHAUSTED; once one of them ends, a new stream runs a generation."""
    async with (
        _gateway_of_a_tenant_allowed_two(tmp_path, redis_server) as gateway,
        grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel,
    ):
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        idle = [stub.ModelStreamInfer(metadata=METADATA, timeout=60) for _ in range(2)]
        quotas = gateway.predictor.admission.quotas
        await eventually(lambda: quotas.in_flight("t") == 2, message="both streams admitted")
        third = stub.ModelStreamInfer(metadata=METADATA, timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            # Refused as the stream opens: its write may already meet the refusal, or its read.
            await third.write(_long_generation("third"))
            await third.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrency" in (refused.value.details() or "")
        await idle[0].done_writing()
        assert await idle[0].code() == grpc.StatusCode.OK
        await eventually(lambda: quotas.in_flight("t") == 1, message="the ended stream released")
        fourth = stub.ModelStreamInfer(metadata=METADATA, timeout=60)
        await fourth.write(_long_generation("fourth"))
        response = await fourth.read()
        assert isinstance(response, kserve.ModelStreamInferResponse)
        assert (response.error_message, response.infer_response.id) == ("", "fourth")
        fourth.cancel()
        idle[1].cancel()
