"""API keys at a real in-process gateway: UNAUTHENTICATED, PERMISSION_DENIED, hashed storage.

No router is running: authentication and authorization are decided before any routing, so a
request that passes them ends UNAVAILABLE (no fleet yet), which is how these tests see it passed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.gateway.auth import hash_key
from services.gateway.config import GatewayConfig
from services.gateway.server import Gateway, create_gateway
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.models import write_affine_model, write_minilm_repository
from tests.support.processes import health_status

pytestmark = pytest.mark.integration

SEARCH_KEY = "search-team-secret"
ADS_KEY = "ads-team-secret"


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=1000)
    write_affine_model(repository)
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f"""
[[keys]]
tenant = "search"
sha256 = "{hash_key(SEARCH_KEY)}"

[[keys]]
tenant = "ads"
sha256 = "{hash_key(ADS_KEY)}"
models = ["affine"]
"""
    )
    assert SEARCH_KEY not in keys.read_text()
    gateway = await create_gateway(
        GatewayConfig(
            model_repository=repository,
            router_address="127.0.0.1:1",
            grpc_port=0,
            metrics_port=0,
            api_keys_file=keys,
        )
    )
    yield gateway
    await gateway.stop()


async def call(
    gateway: Gateway, metadata: tuple[tuple[str, str], ...], model: str = "minilm"
) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        request = api.PredictRequest(model_name=model, inputs=[api.PredictInput(text="hi")])
        try:
            await stub.Predict(request, timeout=5, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        (("authorization", "Bearer wrong"),),
        (("x-api-key", "wrong"),),
        (("authorization", SEARCH_KEY),),
    ],
)
async def test_missing_or_wrong_key_is_unauthenticated(gateway: Gateway, metadata) -> None:
    assert await call(gateway, metadata) == grpc.StatusCode.UNAUTHENTICATED


async def test_valid_key_passes_authentication(gateway: Gateway) -> None:
    for metadata in ((("authorization", f"Bearer {SEARCH_KEY}"),), (("x-api-key", SEARCH_KEY),)):
        # Past auth, the request meets the missing fleet.
        assert await call(gateway, metadata) == grpc.StatusCode.UNAVAILABLE


async def test_key_limited_to_other_models_is_permission_denied(gateway: Gateway) -> None:
    ads = (("authorization", f"Bearer {ADS_KEY}"),)
    assert await call(gateway, ads, model="minilm") == grpc.StatusCode.PERMISSION_DENIED
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        listing = await stub.ListModels(api.ListModelsRequest(), timeout=5, metadata=ads)
        assert [m.name for m in listing.models] == ["affine"]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.GetModel(api.GetModelRequest(model_name="minilm"), timeout=5, metadata=ads)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND


async def test_health_needs_no_key(gateway: Gateway) -> None:
    # NOT_SERVING (no router has answered yet), but answered without a key.
    status = await health_status(f"127.0.0.1:{gateway.port}")
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
