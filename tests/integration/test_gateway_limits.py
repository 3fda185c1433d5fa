"""Limits at a real in-process gateway, checked before work is spent on a request: message size
(RELIABILITY.md scenario 37, with a real router and worker behind it), concurrent calls and
streams, calls waiting for the gateway's Python past grpc's pending bound, and KServe
ModelInfer's row cap and permission check ahead of decoding any element.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
import torch

from services.common import metric_names as names
from services.common.multiplex import MultiplexClient
from services.common.registry_schema import route_metadata
from services.common.tensors import tensor_to_pb
from services.gateway.auth import LOCAL_TENANT, hash_key
from services.gateway.config import GatewayConfig
from services.gateway.server import Gateway
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as wpb
from tests.support.in_process import Fabric, running_fabric, start_lone_gateway
from tests.support.models import affine_reference, write_affine_model, write_minilm_repository
from tests.support.redis import RedisServer
from tests.support.stream_status import PeerStatus
from tests.support.waiting import eventually, eventually_sync

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


@pytest.fixture
async def fabric(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fabric]:
    """Gateway (default limits, no keys), router and worker serving `affine`, all on port 0."""
    repository = tmp_path / "repo"
    write_affine_model(repository, slo_p99_ms=30_000)
    async with running_fabric(repository, redis_server) as fabric:
        yield fabric


def affine_request(rows: np.ndarray) -> kserve.ModelInferRequest:
    tensor = kserve.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=list(rows.shape)
    )
    return kserve.ModelInferRequest(
        model_name="affine", inputs=[tensor], raw_input_contents=[rows.tobytes()]
    )


async def test_s37_oversized_message_is_resource_exhausted_and_next_request_succeeds(
    fabric: Fabric,
) -> None:
    assert fabric.gateway.config.max_message_bytes == 4 * MIB, "the documented default"
    async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        oversized = affine_request(np.ones((5 * MIB // 16, 4), dtype=np.float32))
        assert oversized.ByteSize() > 5 * MIB
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ModelInfer(oversized, timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # Same channel, same connection: the next normal request is answered in full.
        rows = np.arange(8, dtype=np.float32).reshape(2, 4)
        response = await stub.ModelInfer(affine_request(rows), timeout=10)
        outputs = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
        expected = affine_reference(torch.from_numpy(rows)).numpy()
        np.testing.assert_allclose(outputs.reshape(2, 2), expected, rtol=1e-5, atol=1e-5)


async def test_rest_statistics_of_a_fresh_model_write_every_count_as_triton_does(
    fabric: Fabric,
) -> None:
    """A model served but not called yet: its REST statistics write each count as 0 (protobuf's
    JSON left out every field at its zero value: `fail` was {} and a client's
    `stats["inference_stats"]["fail"]["count"]` raised KeyError)."""
    assert fabric.gateway.http is not None
    url = f"http://127.0.0.1:{fabric.gateway.http.port}/v2/models/affine/stats"
    async with aiohttp.ClientSession() as session, session.get(url) as answer:
        assert answer.status == 200, await answer.text()
        (stats,) = (await answer.json())["model_stats"]
    assert (stats["inference_count"], stats["execution_count"]) == (0, 0)
    for duration in ("success", "fail", "queue", "compute_infer"):
        assert stats["inference_stats"][duration] == {"count": 0, "ns": 0}, duration


async def test_more_rows_than_the_model_s_whole_queue_are_refused_as_invalid(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Rows past the model's queue could never be queued: the gateway refuses them at once,
    INVALID_ARGUMENT naming the model's bound (the worker's own refusal names a bundle, which
    the caller never made), before its tenant is charged the rows; a call that fits is
    served."""
    repository = tmp_path / "repo"
    write_affine_model(repository, slo_p99_ms=30_000, max_queue_size=4)
    async with (
        running_fabric(repository, redis_server) as fabric,
        grpc.aio.insecure_channel(fabric.gateway_address) as channel,
    ):
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ModelInfer(affine_request(np.ones((5, 4), np.float32)), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "affine's queue of 4 rows" in (raised.value.details() or "")
        registry, labels = fabric.gateway.metrics.registry, {"tenant": LOCAL_TENANT}
        charged = registry.get_sample_value(names.GATEWAY_TENANT_ROWS_TOTAL, labels)
        assert not charged, "refused before its tenant was charged its rows"
        response = await stub.ModelInfer(affine_request(np.ones((4, 4), np.float32)))
        assert response.outputs[0].shape == [4, 2]
        assert registry.get_sample_value(names.GATEWAY_TENANT_ROWS_TOTAL, labels) == 4


async def test_a_batch_class_call_past_what_the_queue_takes_of_one_is_refused_as_invalid(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """`batch` rows are queued only while the queue is under half full, a call's rows all or
    none: 3 batch rows on a queue of 4 were refused on an idle worker too, RESOURCE_EXHAUSTED
    with a retry hint, for good. The gateway refuses them INVALID_ARGUMENT naming the bound,
    and so does the worker for a caller that bypasses the gateway (its slice alone); 2 rows
    are served."""
    repository = tmp_path / "repo"
    write_affine_model(repository, slo_p99_ms=30_000, max_queue_size=4)

    def predict(num_rows: int) -> api.PredictRequest:
        tensor = tensor_to_pb(np.ones(4, np.float32))
        inputs = [api.PredictInput(tensor=tensor)] * num_rows
        return api.PredictRequest(model_name="affine", inputs=inputs, priority=wpb.PRIORITY_BATCH)

    async with (
        running_fabric(repository, redis_server) as fabric,
        grpc.aio.insecure_channel(fabric.gateway_address) as channel,
        grpc.aio.insecure_channel(fabric.router_address) as router_channel,
    ):
        stub = api_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Predict(predict(3), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch-class calls' share of affine's queue of 4 rows (2)" in (
            raised.value.details() or ""
        )
        assert len((await stub.Predict(predict(2), timeout=10)).outputs) == 2
        request = wpb.InferRequest(model_name="affine", model_version="1")
        request.slices.append(wpb.Slice(rows=3, priority=wpb.PRIORITY_BATCH))
        request.packed.tensor.CopyFrom(tensor_to_pb(np.ones((3, 4), np.float32)))
        answer = wpb.InferResponse.FromString(
            await MultiplexClient(router_channel, "router").call(
                request.SerializeToString(),
                metadata=route_metadata("affine", "1", 3, "batch"),
                timeout_s=10,
            )
        )
        (status,) = answer.slices
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], status
        assert "exceed the 2 the queue takes of one" in status.message


async def test_more_rows_than_one_answer_carries_are_refused_as_invalid(tmp_path: Path) -> None:
    """Rows whose outputs no answer could carry (a model answering 32 MB a row: 2 fit one) can
    never be served: INVALID_ARGUMENT at once, naming the bound. Before, such a caller was
    sent alone, its rows computed, then refused RESOURCE_EXHAUSTED as if for load (its
    tenant's throttle fed, and its client retrying what could never succeed). No router is
    needed: nothing is sent."""
    config = write_affine_model(tmp_path / "repo") / "config.toml"
    config.write_text(config.read_text().replace("dims = [2]", "dims = [8000000]"))
    gateway = await start_lone_gateway(tmp_path / "repo", allow_unauthenticated=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.ModelInfer(affine_request(np.ones((3, 4), np.float32)), timeout=10)
    finally:
        await gateway.stop()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "send at most 2 a call" in (raised.value.details() or "")


@pytest.fixture
async def capped_gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    """A gateway serving at most two calls at once (no router: none of these calls needs it)."""
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=1000)
    gateway = await start_lone_gateway(
        repository, allow_unauthenticated=True, max_concurrent_rpcs=2
    )
    yield gateway
    await gateway.stop()


async def test_concurrent_calls_past_the_cap_are_resource_exhausted_streams_included(
    capped_gateway: Gateway,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capped_gateway.port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)

        async def open_stream() -> grpc.aio.StreamStreamCall:
            """A stream the gateway is serving: it has answered one request (in-band)."""
            stream = stub.ModelStreamInfer(timeout=30)
            await stream.write(kserve.ModelInferRequest(model_name="nope", id="probe"))
            response = await stream.read()
            assert response.infer_response.id == "probe" and response.error_message
            return stream

        async def live() -> grpc.StatusCode:
            try:
                await stub.ServerLive(kserve.ServerLiveRequest(), timeout=5)
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        streams = [await open_stream(), await open_stream()]
        assert await live() == grpc.StatusCode.RESOURCE_EXHAUSTED
        refused = stub.ModelStreamInfer(timeout=30)
        # Refused at once, the stream may end before grpc has sent our message, and then grpc
        # reports its own INTERNAL, not the gateway's status (PeerStatus).
        peer_status = PeerStatus(refused)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await refused.write(kserve.ModelInferRequest(model_name="nope", id="probe"))
            await refused.read()
        assert await peer_status.code_of(raised.value) == grpc.StatusCode.RESOURCE_EXHAUSTED

        for stream in streams:
            await stream.done_writing()
            assert await stream.read() is grpc.aio.EOF
            assert await stream.code() == grpc.StatusCode.OK

        async def is_served() -> bool:
            return await live() == grpc.StatusCode.OK

        # The server frees a slot just after the call ends; that cannot be awaited from here.
        await eventually(is_served, timeout_s=30.0, message="closed streams still hold the cap")


# -- KServe ModelInfer: permission and row cap before decoding ---------------------------------

SEARCH_KEY = "search-team-secret"
ADS_KEY = "ads-team-secret"
DOCS_KEY = "docs-team-secret"


@pytest.fixture
async def keyed_gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    """`search` may use every model, `ads` only `affine`, `docs` only `minilm`; at most 4 rows
    per request."""
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=1000)
    write_affine_model(repository)
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\ntenant = "search"\nsha256 = "{hash_key(SEARCH_KEY)}"\n\n'
        f'[[keys]]\ntenant = "ads"\nsha256 = "{hash_key(ADS_KEY)}"\nmodels = ["affine"]\n\n'
        f'[[keys]]\ntenant = "docs"\nsha256 = "{hash_key(DOCS_KEY)}"\nmodels = ["minilm"]\n'
    )
    gateway = await start_lone_gateway(repository, api_keys_file=keys, max_inputs_per_request=4)
    yield gateway
    await gateway.stop()


async def test_a_call_refused_at_its_headers_is_answered_without_waiting_for_its_body(
    keyed_gateway: Gateway,
) -> None:
    """A call presenting no API key is refused at its headers: answered UNAUTHENTICATED at
    once, not after a body it never sends. Before, the refusal waited for the body, and a
    caller that sent none held its place at the door (and at grpc's max_concurrent_rpcs) until
    its deadline or its connection's age: enough such calls, sent with no key at all, filled
    the door and refused every tenant."""
    door = keyed_gateway.door
    assert door is not None
    body_sent = asyncio.Event()

    async def no_body() -> AsyncIterator[bytes]:
        await body_sent.wait()  # never, while the call lasts
        yield b""

    async with grpc.aio.insecure_channel(f"127.0.0.1:{keyed_gateway.port}") as channel:
        predict = channel.stream_unary("/inference.v1.InferenceService/Predict")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await predict(no_body(), timeout=20)
        body_sent.set()
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, raised.value
    # Its place is given back as the call's task ends, which may be a turn of the loop after
    # its status reached the caller (a run once looked first): well within the 20 s it held.
    await eventually(lambda: door.num_in_flight == 0, timeout_s=5, message="the door's place")


def undecodable_text(num_rows: int, num_bytes: int) -> kserve.ModelInferRequest:
    """A minilm request of `num_rows` texts whose BYTES framing is broken: the first length
    prefix claims more bytes than follow."""
    tensor = kserve.ModelInferRequest.InferInputTensor(
        name="text", datatype="BYTES", shape=[num_rows]
    )
    raw = b"\xff\xff\xff\x7f" + b"x" * (num_bytes - 4)
    return kserve.ModelInferRequest(model_name="minilm", inputs=[tensor], raw_input_contents=[raw])


async def model_infer(
    gateway: Gateway, request: kserve.ModelInferRequest, key: str
) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("authorization", f"Bearer {key}"),)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ModelInfer(request, timeout=10, metadata=metadata)
    return raised.value


async def test_s36_model_infer_checks_permission_and_rows_before_decoding(
    keyed_gateway: Gateway,
) -> None:
    # The contents alone would fail to decode...
    decoded = await model_infer(keyed_gateway, undecodable_text(2, 1024), SEARCH_KEY)
    assert decoded.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "BYTES tensor" in (decoded.details() or "")

    # A shape of one text whose data holds 750,000 empty elements is refused at the second,
    # not after all of them were made into strings (review finding).
    tensor = kserve.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[1])
    empties = kserve.ModelInferRequest(
        model_name="minilm", inputs=[tensor], raw_input_contents=[b"\0\0\0\0" * 750_000]
    )
    refused = await model_infer(keyed_gateway, empties, SEARCH_KEY)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more elements than its shape's 1" in (refused.details() or "")

    # ...but a caller without the model never gets that far, however large the tensor,
    denied = await model_infer(keyed_gateway, undecodable_text(2, 3 * MIB), ADS_KEY)
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED

    # nor does a request over the row cap.
    too_many = await model_infer(keyed_gateway, undecodable_text(5, 1024), SEARCH_KEY)
    assert too_many.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "5 inputs exceed the limit of 4" in (too_many.details() or "")


async def test_v1_predict_checks_model_permission_rows_and_id_before_decoding(
    keyed_gateway: Gateway,
) -> None:
    """inference.v1 Predict in ModelInfer's order: inputs with no payload fail to decode
    (INVALID_ARGUMENT), but an unknown model is NOT_FOUND, a key without the model
    PERMISSION_DENIED, more inputs than the cap and a request id past 256 characters are
    refused for those, all before any input is decoded. Before, Predict decoded every input
    first, so each of these heard about the payloads."""
    empty = [api.PredictInput() for _ in range(2)]

    async def predict(key: str, **fields: object) -> tuple[grpc.StatusCode, str]:
        request = api.PredictRequest(**{"model_name": "minilm", "inputs": empty, **fields})
        metadata = (("authorization", f"Bearer {key}"),)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{keyed_gateway.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await api_grpc.InferenceServiceStub(channel).Predict(
                    request, timeout=10, metadata=metadata
                )
        return raised.value.code(), raised.value.details() or ""

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert await predict(SEARCH_KEY) == (invalid, "an input has no payload (text or tensor)")
    assert (await predict(SEARCH_KEY, model_name="nope"))[0] == grpc.StatusCode.NOT_FOUND
    assert (await predict(ADS_KEY))[0] == grpc.StatusCode.PERMISSION_DENIED
    too_many = await predict(SEARCH_KEY, inputs=[api.PredictInput()] * 5)
    assert too_many == (invalid, "5 inputs exceed the limit of 4")
    long_id = await predict(SEARCH_KEY, request_id="x" * 300)
    assert long_id == (invalid, "request id of 300 characters; at most 256")
    # A name of 50,000 characters was echoed whole into the status message, past what grpc's
    # clients take as trailers: the caller got another status than INVALID_ARGUMENT (review
    # finding). Messages are cut to MAX_STATUS_MESSAGE_BYTES.
    for name in ("m" * 50_000, "\u00e9" * 25_000):
        code, details = await predict(SEARCH_KEY, model_name=name)
        assert code == invalid and "is not a valid model name" not in details
        assert details.startswith("model name '") and len(details.encode()) <= 2_100
    # A name no repository holds, in the shape other servers' names take, is a model not
    # found (OpenAI's clients fall back on a 404; a 400 they do not): review finding.
    for name in ("BAAI/bge-small-en-v1.5", "Qwen2.5-7B-Instruct"):
        code, details = await predict(SEARCH_KEY, model_name=name)
        assert code == grpc.StatusCode.NOT_FOUND and name in details
    for malformed in ("m\x00", " ", "a b", "../x", "/etc/passwd", "a\\b"):
        assert (await predict(SEARCH_KEY, model_name=malformed))[0] == invalid


async def test_rest_infer_checks_permission_and_rows_before_decoding(
    keyed_gateway: Gateway,
) -> None:
    """The same order on the REST port: texts that are numbers fail to decode (400), but a key
    without the model is refused first (403), and so is a request over the row cap (400 for
    its rows). Before, the REST port decoded every element first: the caller without the model
    heard what was wrong with its data."""
    assert keyed_gateway.http is not None
    url = f"http://127.0.0.1:{keyed_gateway.http.port}/v2/models/minilm/infer"

    def body(num_rows: int) -> dict[str, object]:
        data = list(range(num_rows))  # not strings: no BYTES tensor's elements
        return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [num_rows],
                            "data": data}]}  # fmt: skip

    async def infer(num_rows: int, key: str) -> tuple[int, str]:
        headers = {"authorization": f"Bearer {key}"}
        async with (
            aiohttp.ClientSession(headers=headers) as session,
            session.post(url, json=body(num_rows)) as answer,
        ):
            return answer.status, (await answer.json())["error"]

    status, error = await infer(2, SEARCH_KEY)
    assert status == 400 and "inputs exceed" not in error, error  # the data's own fault
    status, error = await infer(2, ADS_KEY)
    assert status == 403, error
    status, error = await infer(5, SEARCH_KEY)
    assert (status, error) == (400, "5 inputs exceed the limit of 4")


async def test_a_request_naming_very_many_tensors_is_refused_before_any_is_looked_at(
    keyed_gateway: Gateway,
) -> None:
    """100,000 empty inputs (a few bytes each, under the message limit): refused at once by
    count, where looking for duplicate names compared every name with every other, for
    minutes, on the gateway's one event loop; then, unserved, a request with a classification
    output (Triton's top-k extension), which was ignored: a stock client parsed the full
    tensor as the top k."""
    many = kserve.ModelInferRequest(model_name="affine")
    many.inputs.extend(
        kserve.ModelInferRequest.InferInputTensor(name=str(i)) for i in range(100_000)
    )
    refused = await model_infer(keyed_gateway, many, ADS_KEY)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "100000 inputs: a request names at most 16" in (refused.details() or "")
    classify = affine_request(np.ones((1, 4), np.float32))
    asked = classify.outputs.add(name="y")
    asked.parameters["classification"].int64_param = 3
    refused = await model_infer(keyed_gateway, classify, ADS_KEY)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "classification extension is not supported" in (refused.details() or "")


async def test_rest_infer_refuses_very_many_tensors_and_classification(
    keyed_gateway: Gateway,
) -> None:
    assert keyed_gateway.http is not None
    url = f"http://127.0.0.1:{keyed_gateway.http.port}/v2/models/affine/infer"
    headers = {"authorization": f"Bearer {ADS_KEY}"}
    one = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    many = {"inputs": [{**one, "name": str(i)} for i in range(1000)]}
    classify = {"inputs": [one], "outputs": [{"name": "y", "parameters": {"classification": 3}}]}
    async with aiohttp.ClientSession(headers=headers) as session:
        for body, words in ((many, "1000 inputs"), (classify, "classification")):
            async with session.post(url, json=body) as answer:
                assert answer.status == 400, await answer.text()
                assert words in (await answer.json())["error"]


async def test_embeddings_check_the_callers_right_to_the_model_before_its_kind(
    keyed_gateway: Gateway,
) -> None:
    """A key limited to minilm asking affine (a tensor model) for embeddings: 403, as for any
    model it may not use; it was told 400, affine "takes tensor inputs": what kind of model a
    name it may not use is."""
    assert keyed_gateway.http is not None
    url = f"http://127.0.0.1:{keyed_gateway.http.port}/v1/embeddings"
    headers = {"authorization": f"Bearer {DOCS_KEY}"}
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.post(url, json={"model": "affine", "input": "hi"}) as answer,
    ):
        assert answer.status == 403, await answer.text()
        assert "tensor" not in await answer.text()


async def test_s38_model_infer_row_cap_comes_before_tensor_decoding(keyed_gateway: Gateway) -> None:
    tensor = kserve.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[5, 4])
    short = kserve.ModelInferRequest(
        model_name="affine", inputs=[tensor], raw_input_contents=[b"\x00" * 7]
    )
    too_many = await model_infer(keyed_gateway, short, ADS_KEY)
    assert too_many.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceed the limit of 4" in (too_many.details() or "")


# -- calls grpc holds before the gateway's Python picks them up --------------------------------


def _burst_while_blocked(
    port: int,
    num_calls: int,
    max_pending_calls: int,
    blocked: threading.Event,
    arrived: threading.Event,
) -> list[str]:
    """Once the loop is `blocked`, sends `num_calls` ServerLive calls at once from this thread
    (a blocking channel, so not on the blocked loop), lets them reach the server (`arrived`
    set once grpc has dropped every call past the hard bound, or, where it drops none, after
    a wait long enough for loopback), and returns their status names once answered."""
    assert blocked.wait(timeout=30), "the loop never blocked"
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        futures = [stub.ServerLive.future(kserve.ServerLiveRequest(), timeout=30) for _ in
                   range(num_calls)]  # fmt: skip
        # Past the hard bound (twice the soft one), and the server's one outstanding pick-up.
        must_drop = num_calls - (2 * max_pending_calls + 1)
        if max_pending_calls and must_drop > 0:
            # The drops themselves, seen while the loop is blocked: every call that could be
            # kept has arrived (a late one would be picked up and answered OK).
            eventually_sync(
                lambda: sum(f.done() and f.code() == grpc.StatusCode.CANCELLED
                            for f in futures) >= must_drop,
                timeout_s=25.0,
                message="the calls past the hard bound dropped while the loop is blocked",
            )  # fmt: skip
        else:
            time.sleep(1.5)  # nothing is dropped: a late call is answered OK all the same
        arrived.set()
        codes = []
        for future in futures:
            try:
                future.result()
                codes.append("OK")
            except grpc.RpcError as error:
                codes.append(error.code().name)
        return codes


@pytest.mark.parametrize(
    ("max_pending_calls", "num_calls"),
    [(4, 40), (GatewayConfig.max_pending_calls, 200)],
)
async def test_calls_waiting_past_the_pending_bound_are_dropped_before_python_sees_them(
    tmp_path: Path, max_pending_calls: int, num_calls: int
) -> None:
    """While the gateway's loop is stalled (saturated: no call is picked up), calls past twice
    `max_pending_calls` are dropped by grpc's C core, CANCELLED, without reaching the
    gateway; those it held are served once the loop runs. By default (grpc's own bound, 1,000)
    a burst of 200, the e2e's, is held whole."""
    repository = write_minilm_repository(tmp_path / "repo", slo_p99_ms=1000)
    gateway = await start_lone_gateway(
        repository, allow_unauthenticated=True, max_pending_calls=max_pending_calls
    )
    try:
        blocked, arrived = threading.Event(), threading.Event()
        burst = asyncio.create_task(
            asyncio.to_thread(
                _burst_while_blocked, gateway.port, num_calls, max_pending_calls, blocked, arrived
            )
        )
        await asyncio.sleep(0.1)  # the thread is waiting for the loop to block
        blocked.set()  # and from here to the end of the wait, no turn of the loop runs
        assert arrived.wait(timeout=30), "the burst was never sent"
        codes = Counter(await burst)
    finally:
        await gateway.stop()
    assert sum(codes.values()) == num_calls and set(codes) <= {"OK", "CANCELLED"}, codes
    if max_pending_calls == 0 or 2 * max_pending_calls + 1 >= num_calls:
        assert codes["OK"] == num_calls, codes
    else:
        # One call matched the server's outstanding pick-up; grpc keeps every call up to the
        # soft bound and none past the hard one (twice it).
        assert max_pending_calls + 1 <= codes["OK"] <= 2 * max_pending_calls + 1, codes
