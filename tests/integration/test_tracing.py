"""One request, one trace: gateway, router and worker in one process on port 0, a real
redis-server, a real TorchScript model, spans caught by the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.gateway.config import GatewayConfig
from services.gateway.server import Gateway, create_gateway
from services.gpu_worker.config import HeartbeatConfig, WorkerConfig
from services.gpu_worker.server import Worker, create_worker
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb
from services.router.config import RouterConfig
from services.router.server import Router, create_router
from tests.support.models import write_affine_model
from tests.support.processes import health_status
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

PREDICT = "inference.v1.InferenceService/Predict"
WORKER_INFER = "inference.v1.WorkerService/Infer"


@dataclass
class Fabric:
    worker: Worker
    router: Router
    gateway: Gateway


@pytest.fixture
async def fabric(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fabric]:
    repository = tmp_path / "repo"
    write_affine_model(repository, slo_p99_ms=30_000)
    worker = await create_worker(
        WorkerConfig(
            model_repository=repository,
            grpc_port=0,
            metrics_port=0,
            redis_url=redis_server.url,
            worker_id="w0",
            heartbeat=HeartbeatConfig(period_s=0.05),
        )
    )
    await worker.load()
    router = await create_router(
        RouterConfig(redis_url=redis_server.url, grpc_port=0, metrics_port=0, refresh_period_s=0.05)
    )
    sync = asyncio.create_task(router.sync.run())
    gateway = await create_gateway(
        GatewayConfig(
            model_repository=repository,
            router_address=f"127.0.0.1:{router.port}",
            grpc_port=0,
            metrics_port=0,
            catalog_refresh_s=0.05,
        )
    )
    refresh = asyncio.create_task(gateway.refresh_catalog())
    try:

        async def is_ready() -> bool:
            status = await health_status(f"127.0.0.1:{gateway.port}")
            return status == health_pb2.HealthCheckResponse.SERVING and bool(
                gateway.catalog.served_versions("affine")
            )

        # Other components' readiness (a heartbeat read, a catalog refresh) cannot be awaited.
        await eventually(is_ready, timeout_s=20.0, message="the fabric did not become ready")
        yield Fabric(worker, router, gateway)
    finally:
        refresh.cancel()
        await gateway.stop()
        await router.stop()
        sync.cancel()
        for task in (refresh, sync):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await worker.stop()


def predict_request(*shape: int) -> api.PredictRequest:
    values = np.arange(int(np.prod(shape)), dtype=np.float32)
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=list(shape), raw_data=values.tobytes())
    return api.PredictRequest(model_name="affine", inputs=[api.PredictInput(tensor=tensor)])


async def predict(fabric: Fabric, request: api.PredictRequest) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fabric.gateway.port}") as channel:
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
    assert worker_span.context in [link.context for link in batch.links]
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
