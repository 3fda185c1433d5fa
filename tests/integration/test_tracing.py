"""One request, one trace: gateway, router and worker in one process on port 0, a real
redis-server, a real TorchScript model, spans caught by the SDK's in-memory exporter."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.common.logs import JsonFormatter
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.in_process import Fabric, running_fabric
from tests.support.models import write_affine_model
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration

PREDICT = "inference.v1.InferenceService/Predict"
WORKER_INFER = "inference.v1.WorkerService/Infer"


@pytest.fixture
async def fabric(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fabric]:
    repository = tmp_path / "repo"
    write_affine_model(repository, slo_p99_ms=30_000)
    async with running_fabric(repository, redis_server) as fabric:
        yield fabric


def predict_request(*shape: int) -> api.PredictRequest:
    values = np.arange(int(np.prod(shape)), dtype=np.float32)
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=list(shape), raw_data=values.tobytes())
    return api.PredictRequest(model_name="affine", inputs=[api.PredictInput(tensor=tensor)])


async def predict(fabric: Fabric, request: api.PredictRequest) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
        try:
            await api_grpc.InferenceServiceStub(channel).Predict(request, timeout=10)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def server_spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [
        s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER and s.name == name
    ]


def child_of(parent: ReadableSpan, candidates: list[ReadableSpan]) -> ReadableSpan:
    (child,) = [s for s in candidates if s.parent and s.parent.span_id == parent.context.span_id]
    return child


async def test_one_request_is_one_trace_across_the_three_tiers(
    fabric: Fabric, spans: InMemorySpanExporter
) -> None:
    assert await predict(fabric, predict_request(4)) == grpc.StatusCode.OK

    (gateway_span,) = server_spans(spans, PREDICT)
    infer_spans = server_spans(spans, WORKER_INFER)
    assert len(infer_spans) == 2  # the router's and the worker's: same method, one hop apart
    router_span = child_of(gateway_span, infer_spans)
    worker_span = child_of(router_span, infer_spans)
    trace_ids = {s.context.trace_id for s in (gateway_span, router_span, worker_span)}
    assert trace_ids == {gateway_span.context.trace_id}
    for span in (gateway_span, router_span, worker_span):
        assert span.status.status_code is not StatusCode.ERROR
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
        assert span.attributes["rpc.system"] == "grpc"

    (batch,) = [s for s in spans.get_finished_spans() if s.name == "batch"]
    assert batch.parent is None  # a batch serves many traces: it links them, belongs to none
    # The request reached the worker in a bundle, whose hops are one caller's trace: the batch
    # links each caller's own span (its slice's traceparent), the gateway's.
    links = [(link.context.trace_id, link.context.span_id) for link in batch.links]
    assert links == [(gateway_span.context.trace_id, gateway_span.context.span_id)]
    assert batch.attributes["inference.model"] == "affine"
    assert batch.attributes["inference.batch.size"] == 1


async def test_invalid_request_ends_at_the_gateway_with_an_error_span(
    fabric: Fabric, spans: InMemorySpanExporter
) -> None:
    assert await predict(fabric, predict_request(3)) == grpc.StatusCode.INVALID_ARGUMENT

    (gateway_span,) = server_spans(spans, PREDICT)
    assert gateway_span.status.status_code is StatusCode.ERROR
    assert (
        gateway_span.attributes["rpc.grpc.status_code"]
        == (grpc.StatusCode.INVALID_ARGUMENT.value[0])
    )
    assert server_spans(spans, WORKER_INFER) == []


async def test_a_calls_log_lines_carry_its_trace_and_request_ids(
    fabric: Fabric, spans: InMemorySpanExporter
) -> None:
    """With the tiers' JSON log format at debug level, each call ends with an access line
    that carries the caller's `x-request-id` and the call's trace id."""
    lines = io.StringIO()
    handler = logging.StreamHandler(lines)
    handler.setFormatter(JsonFormatter("test"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            await stub.Predict(
                predict_request(4), metadata=(("x-request-id", "req-42"),), timeout=10
            )
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Predict(
                    predict_request(3), metadata=(("x-request-id", "req-43"),), timeout=10
                )
    finally:
        root.removeHandler(handler)
        root.setLevel(level)

    records = [json.loads(line) for line in lines.getvalue().splitlines()]
    access = {r["request_id"]: r for r in records if r["message"].startswith(PREDICT)}
    (gateway_ok,) = [s for s in server_spans(spans, PREDICT) if s.status.is_ok]
    assert access["req-42"]["message"].startswith(f"{PREDICT} OK ")
    assert access["req-42"]["trace_id"] == format(gateway_ok.context.trace_id, "032x")
    assert access["req-43"]["message"].startswith(f"{PREDICT} INVALID_ARGUMENT ")
    assert access["req-42"]["level"] == "debug"
