"""The fixed-cost path end to end: gateway -> router -> workers over a real Redis, started as
separate processes the way `make run` starts them, called with real clients."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from services.common import metric_names as names
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb
from tests.conftest import cosine
from tests.support.fabric_load import TIMEOUT_S, predict_request, routed_to
from tests.support.kserve import run_kserve_client
from tests.support.metrics import scrape, total
from tests.support.models import write_minilm_repository
from tests.support.processes import health_status
from tests.support.stack import Stack, start_stack
from tests.support.texts import sentences

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # SLO 30 s: these tests are about answers, routing and failure handling under bursts that
    # two CPU cores cannot serve within the default 250 ms (admission would rightly shed them).
    tmp = tmp_path_factory.mktemp("fabric")
    repository = write_minilm_repository(tmp / "repo", slo_p99_ms=30_000)
    stack = start_stack(tmp, num_workers=2, model_repository=repository, tolerate_exits=True)
    yield stack
    assert stack.stop() == 0, stack.log("launcher")


def vector(tensor: pb.Tensor) -> np.ndarray:
    assert tensor.dtype == pb.DATA_TYPE_FP32 and list(tensor.shape) == [384]
    return np.frombuffer(tensor.raw_data, dtype="<f4")


def worker_rows(stack: Stack) -> float:
    return sum(total(scrape(w.metrics_port), names.WORKER_ROWS_TOTAL) for w in stack.workers)


async def test_every_tier_is_serving(stack: Stack) -> None:
    for tier in (stack.gateway, stack.router, *stack.workers):
        assert await health_status(tier.address) == health_pb2.HealthCheckResponse.SERVING


async def test_200_concurrent_predicts_are_correct_and_batched(
    stack: Stack, reference_embedder
) -> None:
    texts = sentences(200, min_words=1, max_words=60, seed=3)
    reference = reference_embedder(texts)
    batches_before = sum(
        total(scrape(w.metrics_port), f"{names.WORKER_BATCH_SIZE}_count") for w in stack.workers
    )
    rows_before = worker_rows(stack)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        replies = await asyncio.gather(
            *(stub.Predict(predict_request(t), timeout=TIMEOUT_S) for t in texts)
        )
    for i, reply in enumerate(replies):
        assert (reply.model_name, reply.model_version) == ("minilm", "1")
        assert cosine(vector(reply.outputs[0]), reference[i]) >= 0.999
    batches = sum(
        total(scrape(w.metrics_port), f"{names.WORKER_BATCH_SIZE}_count") for w in stack.workers
    )
    assert worker_rows(stack) - rows_before == 200
    assert batches - batches_before < 200, "batches larger than one row must have formed"
    for worker in stack.workers:
        assert routed_to(stack, worker.worker_id) > 0, "traffic must reach both workers"


async def test_every_tier_counts_the_load_and_worker_time_adds_up(stack: Stack) -> None:
    tiers = [stack.gateway, stack.router, *stack.workers]
    before = {tier.metrics_port: scrape(tier.metrics_port) for tier in tiers}

    def delta(tier, name: str, **labels: str) -> float:
        return total(scrape(tier.metrics_port), name, **labels) - total(
            before[tier.metrics_port], name, **labels
        )

    def worker_delta(name: str, **labels: str) -> float:
        return sum(delta(w, name, **labels) for w in stack.workers)

    num_requests = 60
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        await asyncio.gather(
            *(
                stub.Predict(predict_request(f"counted request {i}"), timeout=TIMEOUT_S)
                for i in range(num_requests)
            )
        )
    assert delta(stack.gateway, names.GATEWAY_REQUESTS_TOTAL, api="v1", code="OK") == num_requests
    assert delta(stack.gateway, names.GATEWAY_INPUTS_TOTAL) == num_requests
    assert delta(stack.router, names.ROUTER_RESPONSES_TOTAL, code="OK") == num_requests
    assert delta(stack.router, names.ROUTER_ROUTED_TOTAL) == num_requests
    assert worker_delta(names.WORKER_REQUESTS_TOTAL, code="OK") == num_requests
    assert worker_delta(names.WORKER_ROWS_TOTAL) == num_requests
    assert worker_delta(f"{names.WORKER_ROW_LATENCY_SECONDS}_count") == num_requests
    # The worker's stage split accounts for its latency: linger + backlog + compute = latency.
    latency = worker_delta(f"{names.WORKER_ROW_LATENCY_SECONDS}_sum")
    stages = sum(
        worker_delta(f"{stage}_sum")
        for stage in (
            names.WORKER_LINGER_SECONDS,
            names.WORKER_BACKLOG_SECONDS,
            names.WORKER_ROW_COMPUTE_SECONDS,
        )
    )
    assert latency > 0
    assert stages == pytest.approx(latency, rel=0.02)
    assert worker_delta(f"{names.WORKER_QUEUE_WAIT_SECONDS}_sum") == pytest.approx(
        worker_delta(f"{names.WORKER_LINGER_SECONDS}_sum")
        + worker_delta(f"{names.WORKER_BACKLOG_SECONDS}_sum"),
        rel=0.02,
    )


async def test_multi_input_predict_keeps_order(stack: Stack, reference_embedder) -> None:
    texts = sentences(12, min_words=1, max_words=120, seed=5)
    reference = reference_embedder(texts)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        reply = await api_grpc.InferenceServiceStub(channel).Predict(
            predict_request(*texts), timeout=TIMEOUT_S
        )
    assert [
        cosine(vector(t), r) >= 0.999 for t, r in zip(reply.outputs, reference, strict=True)
    ] == [True] * 12


def test_stock_kserve_v2_client(stack: Stack, reference_embedder) -> None:
    texts = ["hello world", "Batching compatible requests on GPUs", "naïve café"]
    result = run_kserve_client(stack.gateway.address, "--model", "minilm", *texts)
    assert result["live"] and result["ready"] and result["model_ready"]
    assert result["server_metadata"]["name"] == "inference-fabric"
    metadata = result["model_metadata"]
    assert metadata["name"] == "minilm" and metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    assert result["embedding_shape"] == [3, 384]
    for got, want in zip(np.asarray(result["embeddings"]), reference_embedder(texts), strict=True):
        assert cosine(got, want) >= 0.999


def test_s38_stock_kserve_v2_client_wrong_dtype_is_invalid_argument(stack: Stack) -> None:
    rows_before = worker_rows(stack)
    result = run_kserve_client(
        stack.gateway.address, "--model", "minilm", "--expect-error", "--datatype", "FP32", "a", "b"
    )
    assert result["error_status"] == "StatusCode.INVALID_ARGUMENT", result
    assert worker_rows(stack) == rows_before


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (predict_request(""), grpc.StatusCode.INVALID_ARGUMENT),
        (predict_request("fine", "  "), grpc.StatusCode.INVALID_ARGUMENT),
        (predict_request("word " * 400), grpc.StatusCode.INVALID_ARGUMENT),
        (api.PredictRequest(model_name="minilm"), grpc.StatusCode.INVALID_ARGUMENT),
        (
            api.PredictRequest(model_name="minilm", inputs=[api.PredictInput()]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            api.PredictRequest(
                model_name="minilm",
                inputs=[
                    api.PredictInput(
                        tensor=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[2], raw_data=b"\0" * 8)
                    )
                ],
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            api.PredictRequest(
                model_name="minilm",
                inputs=[
                    api.PredictInput(
                        tensor=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[3], raw_data=b"\0" * 8)
                    )
                ],
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (predict_request("hi", model="nope"), grpc.StatusCode.NOT_FOUND),
        (predict_request("hi", version="7"), grpc.StatusCode.NOT_FOUND),
        (predict_request("hi", version="beta"), grpc.StatusCode.NOT_FOUND),
        (predict_request("hi", version="1; drop"), grpc.StatusCode.INVALID_ARGUMENT),
        (predict_request("hi", model=""), grpc.StatusCode.INVALID_ARGUMENT),
        (predict_request("hi", model=" "), grpc.StatusCode.INVALID_ARGUMENT),
        (predict_request("hi", model="../x"), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_s38_bad_input_never_reaches_a_worker(stack: Stack, request_, code) -> None:
    rows_before = worker_rows(stack)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Predict(request_, timeout=TIMEOUT_S)
        assert raised.value.code() == code, raised.value.details()
        await stub.Predict(predict_request("the next good request still works"), timeout=TIMEOUT_S)
    assert worker_rows(stack) == rows_before + 1
