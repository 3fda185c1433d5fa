"""API keys at a real in-process gateway (RELIABILITY.md scenario 36): UNAUTHENTICATED,
PERMISSION_DENIED, hashed storage, keys re-read when their file changes, refusal before the
request body is parsed, and no start without keys unless asked for.

No router is running: authentication and authorization are decided before any routing, so a
request that passes them ends UNAVAILABLE (no fleet yet), which is how these tests see it passed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import metric_names as names
from services.common.errors import UpstreamError
from services.gateway.auth import hash_key
from services.gateway.bundle_clock import BundleClock
from services.gateway.config import GatewayConfig
from services.gateway.server import Gateway
from services.gateway.throttle import Shed
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as wpb
from tests.support.in_process import affine_and_stall_fabric, start_lone_gateway
from tests.support.models import (
    STALL,
    release_stall,
    write_affine_model,
    write_minilm_repository,
    write_small_minilm_repository,
)
from tests.support.processes import REPO_ROOT, health_status
from tests.support.redis import RedisServer
from tests.support.stream_status import PeerStatus
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

SEARCH_KEY = "search-team-secret"
ADS_KEY = "ads-team-secret"


def keys_toml(*entries: tuple[str, str, list[str] | None]) -> str:
    """A keys file of (tenant, key, models) entries."""
    tables = []
    for tenant, key, models in entries:
        limit = "" if models is None else f"models = {models!r}\n"
        tables.append(f'[[keys]]\ntenant = "{tenant}"\nsha256 = "{hash_key(key)}"\n{limit}')
    return "\n".join(tables)


SEARCH = ("search", SEARCH_KEY, None)
ADS = ("ads", ADS_KEY, ["affine"])


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    keys = tmp_path / "keys.toml"
    keys.write_text(keys_toml(SEARCH, ADS))
    assert SEARCH_KEY not in keys.read_text()
    return keys


@pytest.fixture
async def gateway(tmp_path: Path, keys_file: Path) -> AsyncIterator[Gateway]:
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=1000)
    write_affine_model(repository)
    gateway = await start_lone_gateway(repository, api_keys_file=keys_file)
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
async def test_s36_missing_or_wrong_key_is_unauthenticated(gateway: Gateway, metadata) -> None:
    assert await call(gateway, metadata) == grpc.StatusCode.UNAUTHENTICATED


async def test_calls_without_a_known_key_are_counted(gateway: Gateway) -> None:
    """Refused before any call is counted (the authentication stage runs before the handler),
    a flood of missing or made-up keys showed in no metric. Both ports count, by reason."""
    for metadata in ((), (("authorization", "Bearer wrong"),), (("x-api-key", "wrong"),)):
        assert await call(gateway, metadata) == grpc.StatusCode.UNAUTHENTICATED
    assert gateway.http is not None
    url = f"http://127.0.0.1:{gateway.http.port}/v2/models/affine"
    async with aiohttp.ClientSession() as session, session.get(url) as answer:
        assert answer.status == 401
    registry, name = gateway.metrics.registry, names.GATEWAY_UNAUTHENTICATED_TOTAL
    assert registry.get_sample_value(name, {"reason": "missing_key"}) == 2
    assert registry.get_sample_value(name, {"reason": "unknown_key"}) == 2


async def test_valid_key_passes_authentication(gateway: Gateway) -> None:
    for metadata in ((("authorization", f"Bearer {SEARCH_KEY}"),), (("x-api-key", SEARCH_KEY),)):
        # Past auth, the request meets the missing fleet.
        assert await call(gateway, metadata) == grpc.StatusCode.UNAVAILABLE


async def test_s36_key_limited_to_other_models_is_permission_denied(gateway: Gateway) -> None:
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


async def test_reflection_and_health_watch_need_a_key(gateway: Gateway) -> None:
    """Reflection's and health Watch's calls are streams a caller keeps open: without a key,
    idle ones could hold every place of the gateway's --max-concurrent-rpcs. A key's holder
    lists the services; health Check needs none (test_health_needs_no_key)."""

    async def services(metadata: tuple[tuple[str, str], ...]) -> list[str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            asked = reflection_pb2.ServerReflectionRequest(list_services="")
            stream = stub.ServerReflectionInfo(iter([asked]), timeout=5, metadata=metadata)
            (answer,) = [message async for message in stream]
            return [s.name for s in answer.list_services_response.service]

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await services(())
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    listed = await services((("authorization", f"Bearer {SEARCH_KEY}"),))
    assert "inference.v1.InferenceService" in listed
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await watch.read()
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_tei_s_refusal_names_no_model_to_a_caller(tmp_path: Path, keys_file: Path) -> None:
    """With two embedding models and no --tei-model, TEI's routes are refused: the message
    named every embedding model, to any caller, models its key may not use included
    (ListModels hides them)."""
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=1000)
    shutil.copytree(repository / "minilm", repository / "secret-embedder")
    write_affine_model(repository)
    gateway = await start_lone_gateway(repository, api_keys_file=keys_file)
    try:
        assert gateway.http is not None
        url = f"http://127.0.0.1:{gateway.http.port}/embed"
        headers = {"Authorization": f"Bearer {ADS_KEY}"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, json={"inputs": "hi"}, headers=headers) as answer,
        ):
            status, body = answer.status, await answer.text()
    finally:
        await gateway.stop()
    assert status == 400, body
    assert "several embedding models" in body and "2" not in body
    assert "secret-embedder" not in body and "minilm" not in body


async def test_the_kserve_liveness_and_readiness_calls_need_no_key(gateway: Gateway) -> None:
    """As on the HTTP port (/v2/health/live and /ready are open), a stock KServe client asks
    whether the server is live or ready without a key; its other calls still need one."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        assert (await stub.ServerLive(kserve.ServerLiveRequest(), timeout=5)).live
        ready = await stub.ServerReady(kserve.ServerReadyRequest(), timeout=5)
        assert not ready.ready  # no router has answered: answered, not refused
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ServerMetadata(kserve.ServerMetadataRequest(), timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("path", ["/v2/models/affine/infer", "/v2/models/affine", "/v1/models"])
@pytest.mark.parametrize("header", [b"Authorization: Bearer \xff\xfe", b"X-Api-Key: \xc3("])
async def test_a_key_that_is_not_utf8_over_http_is_an_unknown_key(
    gateway: Gateway, path: str, header: bytes
) -> None:
    """The HTTP server keeps a header's bytes that are not UTF-8 as surrogates; hashing such a
    key raised, and the caller got 500 with a stack trace logged, not 401."""
    assert gateway.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.http.port)
    body = b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}'
    method = b"POST" if path.endswith("/infer") else b"GET"
    writer.write(
        method + b" " + path.encode() + b" HTTP/1.1\r\nHost: localhost\r\n" + header
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body) if method == b"POST" else 0).encode() + b"\r\nConnection: close\r\n\r\n"
        + (body if method == b"POST" else b"")
    )  # fmt: skip
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.split()[1] == b"401", answer[:300]
    assert b"www-authenticate: bearer" in answer.lower()


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def replace_file(path: Path, text: str) -> None:
    """Writes `text` as a new file renamed over `path`, as a Secret update does."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(path)


#: Bound on the wait for the gateway to re-read its keys file (it polls it every second):
#: generous, since that the change takes effect without a restart is what is checked.
RELOAD_TIMEOUT_S = 30.0


async def test_s36_added_key_works_and_removed_key_is_refused_without_a_restart(
    gateway: Gateway, keys_file: Path
) -> None:
    new_key = "new-team-secret"
    assert await call(gateway, bearer(new_key)) == grpc.StatusCode.UNAUTHENTICATED

    keys_file.write_text(keys_toml(SEARCH, ADS, ("new", new_key, None)))  # edited in place

    async def new_key_passes() -> bool:
        return await call(gateway, bearer(new_key)) == grpc.StatusCode.UNAVAILABLE

    await eventually(
        new_key_passes, timeout_s=RELOAD_TIMEOUT_S, message="the added key was not accepted"
    )

    replace_file(keys_file, keys_toml(ADS, ("new", new_key, None)))

    async def search_refused() -> bool:
        return await call(gateway, bearer(SEARCH_KEY)) == grpc.StatusCode.UNAUTHENTICATED

    await eventually(
        search_refused, timeout_s=RELOAD_TIMEOUT_S, message="the removed key still works"
    )
    assert await call(gateway, bearer(new_key)) == grpc.StatusCode.UNAVAILABLE


async def test_s36_a_key_removed_while_its_stream_is_open_is_refused_on_that_stream(
    gateway: Gateway, keys_file: Path
) -> None:
    """A ModelStreamInfer stream opened with a key that is then revoked: its next request is
    refused UNAUTHENTICATED in-band. Before, the stream kept the principal it started with,
    and served the revoked key's requests until its connection aged out (minutes)."""
    requests: asyncio.Queue[kserve.ModelInferRequest | None] = asyncio.Queue()

    async def sent() -> AsyncIterator[kserve.ModelInferRequest]:
        while (request := await requests.get()) is not None:
            yield request

    text = kserve.InferTensorContents(bytes_contents=[b"hi"])
    request = kserve.ModelInferRequest(
        model_name="minilm",
        inputs=[
            kserve.ModelInferRequest.InferInputTensor(
                name="text", datatype="BYTES", shape=[1], contents=text
            )
        ],
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        stream = stub.ModelStreamInfer(sent(), metadata=bearer(SEARCH_KEY), timeout=60)
        requests.put_nowait(request)
        first = await stream.read()
        assert first.error_message.startswith("UNAVAILABLE"), first  # past auth: no fleet

        replace_file(keys_file, keys_toml(ADS))

        async def search_refused() -> bool:
            return await call(gateway, bearer(SEARCH_KEY)) == grpc.StatusCode.UNAUTHENTICATED

        await eventually(search_refused, timeout_s=RELOAD_TIMEOUT_S, message="not reloaded")
        requests.put_nowait(request)
        second = await stream.read()
        requests.put_nowait(None)
    assert second.error_message.startswith("UNAUTHENTICATED"), second


async def test_s36_a_keys_file_that_does_not_parse_keeps_the_old_keys(
    gateway: Gateway, keys_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="services.gateway.auth")
    # Besides files that do not parse: a misspelt field of a key (`model`: read as no limit,
    # every model granted) and a misspelt table (`[tenant.search]`: its limits never applied)
    # were taken silently.
    misspelt = keys_toml(SEARCH, ADS)
    typos = (
        misspelt.replace("models =", "model ="),
        f"{misspelt}\n[tenant.search]\nrows_per_s = 1\n",
    )
    for garbage in ("[[keys]\ntenant = ", "", '[[keys]]\ntenant = "x"\nsha256 = "short"\n', *typos):
        caplog.clear()
        replace_file(keys_file, garbage)

        def reload_refused() -> bool:
            return "not reloaded" in caplog.text

        await eventually(
            reload_refused, timeout_s=RELOAD_TIMEOUT_S, message=f"{garbage!r} was not read"
        )
        assert await call(gateway, bearer(SEARCH_KEY)) == grpc.StatusCode.UNAVAILABLE
        assert await call(gateway, bearer(ADS_KEY)) == grpc.StatusCode.PERMISSION_DENIED
        assert await call(gateway, bearer("x")) == grpc.StatusCode.UNAUTHENTICATED


async def raw_call(
    gateway: Gateway, method: str, body: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    """`body` sent as it is (no serializer) to `method`, unary or a one-message stream."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        try:
            if method.endswith("StreamInfer"):
                stream = channel.stream_stream(method)(iter([body]), metadata=metadata, timeout=5)
                # The gateway may end the stream before grpc has sent our message, and then
                # grpc reports its own INTERNAL, not the gateway's status (PeerStatus).
                peer_status = PeerStatus(stream)
                try:
                    _ = [m async for m in stream]
                except grpc.aio.AioRpcError as error:
                    return await peer_status.code_of(error)
            else:
                await channel.unary_unary(method)(body, metadata=metadata, timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


NOT_PROTOBUF = b"\xff\xff\xff\xff"  # a truncated varint tag: no message parses from it


@pytest.mark.parametrize(
    "method",
    [
        "/inference.v1.InferenceService/Predict",
        "/inference.GRPCInferenceService/ModelInfer",
        "/inference.GRPCInferenceService/ModelStreamInfer",
    ],
)
async def test_s36_refused_before_the_body_is_parsed(
    gateway: Gateway, method: str, spans: InMemorySpanExporter
) -> None:
    # With a key the body is parsed, and fails: it is not a protobuf message.
    parsed = await raw_call(gateway, method, NOT_PROTOBUF, bearer(SEARCH_KEY))
    assert parsed not in (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED)
    # Without one it never is: the caller learns only that it is not authenticated.
    assert await raw_call(gateway, method, NOT_PROTOBUF) == grpc.StatusCode.UNAUTHENTICATED
    assert await raw_call(gateway, method, NOT_PROTOBUF, bearer("wrong")) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    codes = [
        s.attributes.get("rpc.grpc.status_code")
        for s in spans.get_finished_spans()
        if s.name == method.lstrip("/") and s.attributes is not None
    ]
    assert codes.count(grpc.StatusCode.UNAUTHENTICATED.value[0]) == 2, "refusals are traced"


async def test_s36_gateway_without_keys_refuses_to_start(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    started = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.gateway", "--grpc-port", "0", "--metrics-port", "0",
        cwd=REPO_ROOT, env=environ, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(started.communicate(), timeout=60)
    assert started.returncode == 2
    assert b"--allow-unauthenticated" in stderr and b"--api-keys-file" in stderr
    with pytest.raises(ValueError, match="API keys"):
        GatewayConfig(model_repository=tmp_path)


async def test_s36_allow_unauthenticated_serves_everyone_as_local_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=1000)
    caplog.set_level(logging.WARNING, logger="services.gateway.server")
    gateway = await start_lone_gateway(repository, allow_unauthenticated=True)
    try:
        assert "AUTHENTICATION IS OFF" in caplog.text
        assert await call(gateway, ()) == grpc.StatusCode.UNAVAILABLE, "past auth, no fleet"
    finally:
        await gateway.stop()


async def test_s36_the_slim_client_sends_its_api_key(gateway: Gateway) -> None:
    """`inference_fabric_client.Client(api_key=...)`: no key is UNAUTHENTICATED, a key for
    other models PERMISSION_DENIED, a good key passes auth (UNAVAILABLE: no fleet here)."""
    from inference_fabric_client import Client, FabricError

    def code_with(api_key: str | None, model: str) -> str:
        with Client(f"127.0.0.1:{gateway.port}", api_key=api_key, timeout_s=5) as client:
            try:
                client.embed(["hi"], model=model)
            except FabricError as error:
                return error.code
        return "OK"

    assert await asyncio.to_thread(code_with, None, "minilm") == "UNAUTHENTICATED"
    assert await asyncio.to_thread(code_with, ADS_KEY, "minilm") == "PERMISSION_DENIED"
    assert await asyncio.to_thread(code_with, SEARCH_KEY, "minilm") == "UNAVAILABLE"


async def test_a_burst_of_calls_passes_max_concurrency_no_further(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A tenant allowed 3 calls in flight sends 16 at once, each held at the worker (a stalled
    model): 3 run and 13 are refused RESOURCE_EXHAUSTED (max_concurrency), then the 3 are
    answered. A call is counted in the step that checked for room: before, it was counted
    only once its handler started, after its body arrived, and a burst's calls all passed the
    check meanwhile."""
    keys = tmp_path / "keys.toml"
    keys.write_text(keys_toml(SEARCH) + "\n[tenants.search]\nmax_concurrency = 3\n")
    async with affine_and_stall_fabric(
        tmp_path, redis_server, gateway_settings={"api_keys_file": keys}
    ) as fabric:
        row = np.array([STALL, 0, 0, 0], dtype="<f4")
        tensor = wpb.Tensor(dtype=wpb.DATA_TYPE_FP32, shape=[4], raw_data=row.tobytes())
        request = api.PredictRequest(model_name="stall", inputs=[api.PredictInput(tensor=tensor)])
        # 1 MiB of a field the gateway does not know (parsed and ignored): each body takes a
        # while to arrive, as a large or slow caller's does, and the calls' checks interleave.
        padding = b"\x82\x3e" + _varint(1 << 20) + bytes(1 << 20)  # field 992, bytes
        body = request.SerializeToString() + padding
        metadata = (("authorization", f"Bearer {SEARCH_KEY}"),)
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            predict = channel.unary_unary(
                "/inference.v1.InferenceService/Predict",
                response_deserializer=api.PredictResponse.FromString,
            )
            calls = [
                asyncio.ensure_future(predict(body, metadata=metadata, timeout=60))
                for _ in range(16)
            ]
            refused = []
            while len(refused) < 13:
                done, _ = await asyncio.wait(
                    [c for c in calls if c not in refused], return_when=asyncio.FIRST_COMPLETED
                )
                for call in done:
                    error = call.exception()
                    assert isinstance(error, grpc.aio.AioRpcError), error
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                    assert "max_concurrency" in (error.details() or "")
                    refused.append(call)
            release_stall(tmp_path / "gate")
            answered = await asyncio.gather(*(c for c in calls if c not in refused))
    assert len(answered) == 3


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


@pytest.mark.parametrize(
    "refused_by", ["throttle", "downstream", "invalid", "too many tokens", "not started"]
)
async def test_calls_refused_for_load_spend_none_of_their_tenants_rows(
    tmp_path: Path, redis_server: RedisServer, refused_by: str
) -> None:
    """A tenant allowed 2 rows a second (a bucket of 2), while every call is refused for load:
    by the gateway's throttle (downstream was refusing), or downstream (RESOURCE_EXHAUSTED:
    queue full, or predicted past its deadline). Ten such calls spend none of the tenant's
    rows, so once calls go through again the tenant is served, not refused for rows it never
    got. Before, only the throttle's refusals kept the rows. So do calls refused as invalid
    (INVALID_ARGUMENT: a NaN row, found after the rows were charged; a text of more tokens than
    the model takes, found when its bundle is tokenized) and calls that provably
    ran nothing downstream (UNAVAILABLE, not started). (Each call still spends
    a request of a request rate: every call made counts, so a flood is refused before its body
    is read.)"""
    keys = tmp_path / "keys.toml"
    keys.write_text(keys_toml(SEARCH) + "\n[tenants.search]\nrows_per_s = 2\nburst_s = 1\n")
    if refused_by == "too many tokens":  # up to 32 tokens, in texts up to 2,048 characters
        write_small_minilm_repository(tmp_path / "repo")
    async with affine_and_stall_fabric(
        tmp_path, redis_server, gateway_settings={"api_keys_file": keys}
    ) as fabric:
        predictor = fabric.gateway.predictor
        throttle, bundles = predictor._throttle, predictor._bundles
        admit, bundle_call = throttle.admit, bundles.call

        async def refused_downstream(*_: object, **__: object) -> None:
            if refused_by == "not started":  # a worker stopping: nothing of the call ran
                raise UpstreamError(grpc.StatusCode.UNAVAILABLE, "draining", is_not_started=True)
            raise UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")

        expected = grpc.StatusCode.RESOURCE_EXHAUSTED
        nan = wpb.Tensor(
            dtype=wpb.DATA_TYPE_FP32, shape=[4], raw_data=bytes(12) + b"\x00\x00\xc0\x7f"
        )
        sent = [api.PredictInput(tensor=nan)]
        if refused_by == "throttle":
            throttle.admit = lambda *_: Shed(retry_after_s=0.1, probability=0.9)  # type: ignore[method-assign]
        elif refused_by in ("invalid", "too many tokens"):
            expected = grpc.StatusCode.INVALID_ARGUMENT
        elif refused_by == "not started":
            expected = grpc.StatusCode.UNAVAILABLE
            throttle.admit = lambda *_: None  # type: ignore[method-assign]
            bundles.call = refused_downstream  # type: ignore[method-assign]
        else:  # the throttle, which would learn to refuse them, stays out of it
            throttle.admit = lambda *_: None  # type: ignore[method-assign]
            bundles.call = refused_downstream  # type: ignore[method-assign]
        tensor = wpb.Tensor(dtype=wpb.DATA_TYPE_FP32, shape=[4], raw_data=bytes(16))
        request = api.PredictRequest(model_name="affine", inputs=[api.PredictInput(tensor=tensor)])
        metadata = (("authorization", f"Bearer {SEARCH_KEY}"),)
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            for _ in range(10):
                refused_call = request
                if refused_by == "invalid":
                    refused_call = api.PredictRequest(model_name="affine", inputs=sent)
                elif refused_by == "too many tokens":
                    refused_call = api.PredictRequest(
                        model_name="minilm", inputs=[api.PredictInput(text="word " * 60)]
                    )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Predict(refused_call, timeout=5, metadata=metadata)
                assert refused.value.code() == expected, refused.value.details()
                assert "rows_per_s" not in (refused.value.details() or "")
            bundles.call = bundle_call  # type: ignore[method-assign]
            if refused_by == "throttle":
                throttle.admit = admit  # type: ignore[method-assign]
            answer = await stub.Predict(request, timeout=5, metadata=metadata)
    assert len(answer.outputs) == 1


async def test_calls_whose_deadline_passes_before_they_leave_the_gateway_spend_no_rows(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A tenant allowed 2 rows a second (a bucket of 2) whose calls each expire at the gateway
    before their bundle leaves it (every bundle held for an answer that never comes, the
    callers allowing 0.1 s): each call ran nowhere, so its row returns to the tenant, and ten
    such calls in a row each end DEADLINE_EXCEEDED, not refused for rows it never got; then a
    call that is sent is served. Before, each expired call kept its row, so the bucket emptied
    after a few (it refills 0.2 rows a call) and the rest were refused RESOURCE_EXHAUSTED."""
    keys = tmp_path / "keys.toml"
    keys.write_text(keys_toml(SEARCH) + "\n[tenants.search]\nrows_per_s = 2\nburst_s = 1\n")
    async with affine_and_stall_fabric(
        tmp_path, redis_server, gateway_settings={"api_keys_file": keys}
    ) as fabric:
        bundles = fabric.gateway.predictor._bundles
        clock, bundles._clock = bundles._clock, _HoldsEveryBundle()
        tensor = wpb.Tensor(dtype=wpb.DATA_TYPE_FP32, shape=[4], raw_data=bytes(16))
        request = api.PredictRequest(model_name="affine", inputs=[api.PredictInput(tensor=tensor)])
        metadata = (("authorization", f"Bearer {SEARCH_KEY}"),)
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            codes = []
            for _ in range(10):
                with pytest.raises(grpc.aio.AioRpcError) as expired:
                    await stub.Predict(request, timeout=0.1, metadata=metadata)
                codes.append(expired.value.code())
            assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 10
            bundles._clock = clock
            answer = await stub.Predict(request, timeout=5, metadata=metadata)
    assert len(answer.outputs) == 1


class _HoldsEveryBundle(BundleClock):
    """Holds every ready bundle for 30 s, whatever is out (none is: nothing answers it)."""

    def hold_s(self, *_: object) -> float:
        return 30.0
