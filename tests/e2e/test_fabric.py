"""The fixed-cost path end to end: gateway -> router -> workers over a real Redis, started as
separate processes the way `make run` starts them, called with real clients."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from services.common import metric_names as names
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb
from tests.conftest import cosine
from tests.support.fabric_load import TIMEOUT_S, predict_request, routed_to
from tests.support.kserve import run_kserve_client
from tests.support.metrics import samples, scrape, total
from tests.support.models import write_minilm_repository
from tests.support.processes import health_status
from tests.support.stack import Stack, start_stack
from tests.support.texts import sentences
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # SLO 30 s: these tests are about answers, routing and failure handling under bursts that
    # two CPU cores cannot serve within the default 250 ms (admission would rightly shed them).
    tmp = tmp_path_factory.mktemp("fabric")
    repository = write_minilm_repository(tmp / "repo", slo_p99_ms=30_000)
    stack = start_stack(tmp, num_workers=2, model_repository=repository, tolerate_exits=True)
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def vector(tensor: pb.Tensor) -> np.ndarray:
    assert tensor.dtype == pb.DATA_TYPE_FP32 and list(tensor.shape) == [384]
    return np.frombuffer(tensor.raw_data, dtype="<f4")


def worker_rows(stack: Stack) -> float:
    return sum(total(scrape(w.metrics_port), names.WORKER_ROWS_TOTAL) for w in stack.workers)


def minilm_batches(stack: Stack) -> float:
    """Batches of minilm version 1 the workers ran, by their own batch-size histogram."""
    return sum(
        total(
            scrape(w.metrics_port), f"{names.WORKER_BATCH_SIZE}_count", model="minilm",
            version="1",
        )
        for w in stack.workers
    )  # fmt: skip


def minilm_rows(stack: Stack) -> float:
    """Rows of minilm version 1 the workers ran, by their own metrics."""
    return sum(
        total(scrape(w.metrics_port), names.WORKER_ROWS_TOTAL, model="minilm", version="1")
        for w in stack.workers
    )


async def test_every_tier_is_serving(stack: Stack) -> None:
    for tier in (stack.gateway, stack.router, *stack.workers):
        assert await health_status(tier.address) == health_pb2.HealthCheckResponse.SERVING


async def test_every_tier_process_samples_its_event_loop_lag(stack: Stack) -> None:
    """Which tier is the bottleneck is visible: each process's loop lag beside its CPU."""
    for tier in (stack.gateway, stack.router, *stack.workers):
        await eventually(
            lambda tier=tier: total(
                scrape(tier.metrics_port), f"{names.EVENT_LOOP_LAG_SECONDS}_count"
            ) > 0,
            timeout_s=10.0,
            message=f"{tier.address}: no event-loop lag samples",
        )  # fmt: skip
        text = scrape(tier.metrics_port)
        ((_, recent_s),) = samples(text, names.EVENT_LOOP_LAG_RECENT_SECONDS)
        assert 0.0 <= recent_s < 60.0
        assert total(text, names.PROCESS_CPU_SECONDS_TOTAL) > 0.0


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


async def test_a_text_too_long_in_tokens_refuses_its_caller_alone(
    stack: Stack, reference_embedder
) -> None:
    """Concurrent calls are tokenized together, per bundle (services.gateway.coalescer): a
    text that passes the per-call checks but is too many tokens for the model fails its own
    call, INVALID_ARGUMENT, and its bundle-mates are served."""
    texts = sentences(31, min_words=1, max_words=30, seed=11)
    reference = reference_embedder(texts)
    too_long = "word " * 300  # 302 tokens, the model takes 256; few enough characters
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        calls = [stub.Predict(predict_request(t), timeout=TIMEOUT_S) for t in texts]
        calls.insert(16, stub.Predict(predict_request(too_long), timeout=TIMEOUT_S))
        replies = await asyncio.gather(*calls, return_exceptions=True)
    refused = replies.pop(16)
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "accepts at most 256" in (refused.details() or "")
    for reply, expected in zip(replies, reference, strict=True):
        assert not isinstance(reply, BaseException), reply
        assert cosine(vector(reply.outputs[0]), expected) >= 0.999


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
    # Concurrent calls travel to the router in bundles: it routes and answers each once.
    bundles = delta(stack.gateway, f"{names.GATEWAY_BUNDLE_SLICES}_count")
    assert delta(stack.gateway, f"{names.GATEWAY_BUNDLE_SLICES}_sum") == num_requests
    assert delta(stack.router, names.ROUTER_RESPONSES_TOTAL, code="OK") == bundles
    assert delta(stack.router, names.ROUTER_ROUTED_TOTAL) == bundles
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


def test_stock_kserve_v2_client_streams_an_embedding_model(
    stack: Stack, reference_embedder
) -> None:
    """tritonclient's start_stream / async_stream_infer on minilm (not decoupled): each text
    answered once, by its request id, and a wrong request refused in-band beside them."""
    texts = [f"streamed text number {i}" for i in range(12)]
    result = run_kserve_client(stack.gateway.address, "--model", "minilm", "--stream", *texts)
    assert sorted(result["embeddings"]) == sorted(f"t{i}" for i in range(12))
    reference = reference_embedder(texts)
    for i, want in enumerate(reference):
        (got,) = np.asarray(result["embeddings"][f"t{i}"])
        assert cosine(got, want) >= 0.999
    (error,) = result["errors"]
    assert error.startswith("INVALID_ARGUMENT: input text must be BYTES"), error


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
        (predict_request("fine", ""), grpc.StatusCode.INVALID_ARGUMENT),
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


async def _statistics(stack: Stack) -> kserve.ModelStatistics:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        reply = await stub.ModelStatistics(
            kserve.ModelStatisticsRequest(name="minilm", version="1"), timeout=TIMEOUT_S
        )
    (stats,) = reply.model_stats
    return stats


async def _settled_statistics(stack: Stack) -> kserve.ModelStatistics:
    """The statistics once the workers' totals of earlier traffic have all arrived (they travel
    by heartbeat, router refresh and the gateway's catalog refresh): the rows they report are
    the rows the workers' own metrics count (both are counted at the same place, per batch)."""

    async def settled() -> kserve.ModelStatistics | None:
        rows = minilm_rows(stack)
        stats = await _statistics(stack)
        return stats if stats.inference_stats.queue.count == rows else None

    return await eventually(
        settled, timeout_s=60.0, message="the gateway's statistics caught up with the workers"
    )


async def test_model_statistics_count_the_requests_rows_and_batches_that_ran(
    stack: Stack,
) -> None:
    before = await _settled_statistics(stack)
    batches_before = minilm_batches(stack)
    texts = sentences(40, min_words=1, max_words=20, seed=5)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        await asyncio.gather(
            *(stub.Predict(predict_request(t, t), timeout=TIMEOUT_S) for t in texts)
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Predict(predict_request("word " * 2000), timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = await _statistics(stack)
    success, fail = after.inference_stats.success, after.inference_stats.fail
    assert success.count - before.inference_stats.success.count == 40
    assert after.inference_count - before.inference_count == 80
    assert success.ns > before.inference_stats.success.ns
    assert after.last_inference >= before.last_inference and after.last_inference > 0
    # Too long for the resolved version's tokenizer: that version's failure.
    assert fail.count - before.inference_stats.fail.count == 1 and fail.ns > 0

    async def workers_reported() -> kserve.ModelStatistics | None:
        stats = await _statistics(stack)
        rows = stats.inference_stats.queue.count - before.inference_stats.queue.count
        return stats if rows >= 80 else None

    # The workers' figures travel by heartbeat, router and the gateway's catalog refresh.
    stats = await eventually(workers_reported, message="the workers' totals reached us")
    executions = stats.execution_count - before.execution_count
    # The statistics count exactly the batches the workers ran (their own metric), and some
    # of those held several rows: fewer batches than the 80 rows.
    assert executions == minilm_batches(stack) - batches_before
    assert executions < 80, "rows ran in batches"
    assert stats.inference_stats.queue.count - before.inference_stats.queue.count == 80
    executions_timed = stats.inference_stats.compute_infer.count
    assert executions_timed - before.inference_stats.compute_infer.count == executions
    compute_ns = stats.inference_stats.compute_infer.ns - before.inference_stats.compute_infer.ns
    assert 0 < compute_ns < success.ns - before.inference_stats.success.ns


def test_stock_client_request_parameters_priority_and_timeout_are_honoured(stack: Stack) -> None:
    """Triton's `timeout` parameter (microseconds) is the call's deadline when tighter than the
    gRPC one; `priority` 3 is this fabric's `batch` class (1 critical, 2 interactive)."""
    expired = run_kserve_client(
        stack.gateway.address, "--model", "minilm", "--expect-error",
        "--server-timeout-us", "1", "hello",
    )  # fmt: skip
    assert expired["error_status"] == "StatusCode.DEADLINE_EXCEEDED", expired

    port = stack.gateway.metrics_port
    batch_before = total(scrape(port), names.GATEWAY_TENANT_REQUESTS_TOTAL, priority="batch")
    result = run_kserve_client(
        stack.gateway.address, "--model", "minilm", "--priority", "3",
        "--server-timeout-us", "30000000", "hello", "world",
    )  # fmt: skip
    assert len(result["embeddings"]) == 2
    batch_after = total(scrape(port), names.GATEWAY_TENANT_REQUESTS_TOTAL, priority="batch")
    assert batch_after - batch_before == 1

    out_of_range = run_kserve_client(
        stack.gateway.address, "--model", "minilm", "--expect-error", "--priority", "7", "hello"
    )
    assert out_of_range["error_status"] == "StatusCode.INVALID_ARGUMENT", out_of_range
    assert "priority" in out_of_range["message"]


def test_stock_client_reads_model_config_and_statistics(stack: Stack) -> None:
    result = run_kserve_client(
        stack.gateway.address, "--model", "minilm", "--introspect", "hello", "world"
    )
    config = result["config"]["config"]
    assert config["name"] == "minilm" and config["max_batch_size"] == 64
    assert config["input"] == [{"name": "text", "data_type": "TYPE_STRING", "dims": ["1"]}]
    assert config["output"] == [{"name": "embedding", "data_type": "TYPE_FP32", "dims": ["384"]}]
    batching = config["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == str(30_000 * 1000)
    assert batching["priority_levels"] == "3" and batching["default_priority_level"] == "2"
    assert "model_transaction_policy" not in config  # not decoupled: the default is omitted
    (stats,) = result["statistics"]["model_stats"]
    assert stats["name"] == "minilm" and stats["version"] == "1"
    assert int(stats["inference_stats"]["success"]["count"]) >= 1
    assert int(stats["inference_count"]) >= 2
    unimplemented = result["unimplemented"]
    assert unimplemented["status"] == "StatusCode.UNIMPLEMENTED", unimplemented
    assert "SystemSharedMemoryStatus is not implemented" in unimplemented["message"]


CLIENT_PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "python"
_CLIENT_PROBE = """
import json, sys
from inference_fabric_client import Client, FabricError
with Client(sys.argv[1], timeout_s=60) as client:
    vectors = client.embed(["hello world", "naïve café"])
    try:
        client.embed(["x"], model="no-such-model")
        missing = None
    except FabricError as error:
        missing = error.code
    models = [m["name"] for m in client.models()]
print(json.dumps({"shape": list(vectors.shape), "vectors": vectors.tolist(), "missing": missing,
                  "torch": "torch" in sys.modules, "models": models}))
"""


def test_slim_client_package_installs_without_torch_and_embeds(
    stack: Stack, tmp_path: Path, reference_embedder
) -> None:
    venv = tmp_path / "client-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # Built from a copy: pip builds a local directory in place, and left build/ and egg-info in
    # the checkout (a stale build/lib would carry deleted modules into the next install).
    checkout = tmp_path / "checkout"
    shutil.copytree(CLIENT_PACKAGE, checkout / "clients" / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "dist"))  # fmt: skip
    shutil.copytree(CLIENT_PACKAGE.parent.parent / "proto", checkout / "proto")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(checkout / "clients" / "python")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    probe = subprocess.run(
        [str(python), "-c", _CLIENT_PROBE, stack.gateway.address],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    result = json.loads(probe.stdout)
    installed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "torch" not in {p["name"].lower() for p in json.loads(installed)}
    assert result["shape"] == [2, 384] and not result["torch"]
    assert result["missing"] == "NOT_FOUND" and "minilm" in result["models"]
    reference = reference_embedder(["hello world", "naïve café"])
    for got, want in zip(np.asarray(result["vectors"]), reference, strict=True):
        assert cosine(got, want) >= 0.999
