"""The worker as a real process, called over real gRPC, checked from its own metrics."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from services.common import metric_names as names
from services.common.processes import ProcessError
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.conftest import cosine
from tests.support.metrics import samples, scrape, total
from tests.support.models import write_affine_model, write_minilm_repository
from tests.support.processes import ServiceProcess, health_status, runs_uvloop, start_worker
from tests.support.texts import sentences

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    # The default SLO (250 ms) is for steady traffic; a burst of 64 long inputs on two CPU cores
    # would rightly be shed. This test is about answers and batches, so it allows 30 s.
    tmp = tmp_path_factory.mktemp("worker")
    repository = write_minilm_repository(tmp / "repo", slo_p99_ms=30_000)
    # Batches of at most 16 rows and 2048 tokens: the worker's start is its warm-up, every
    # bucket at every power-of-two batch size up to the largest, which at the default (64 rows,
    # 8192 tokens) takes minutes on two CPU cores busy with other tests. These tests need
    # batches, not large ones.
    config = repository / "minilm" / "config.toml"
    text = config.read_text()
    for default, small in (("max_batch_size = 64", "16"), ("max_batch_tokens = 8192", "2048")):
        assert default in text, default
        text = text.replace(default, f"{default.split(' = ')[0]} = {small}")
    config.write_text(text)
    service = start_worker(tmp, model_repository=repository)
    yield service
    assert service.terminate() == 0, service.log()


def text_request(*texts: str, **fields: str) -> pb.InferRequest:
    return pb.InferRequest(
        model_name=fields.pop("model_name", "minilm"),
        inputs=[pb.ModelInput(text=t) for t in texts],
        **fields,
    )


def embedding(response: pb.InferResponse, index: int = 0) -> np.ndarray:
    tensor = response.outputs[index]
    assert tensor.dtype == pb.DATA_TYPE_FP32
    assert list(tensor.shape) == [384]
    return np.frombuffer(tensor.raw_data, dtype="<f4")


async def test_s16_concurrent_mixed_lengths_batch_correctly(worker, reference_embedder) -> None:
    texts = sentences(64, min_words=1, max_words=180, seed=11)
    reference = reference_embedder(texts)
    before = scrape(worker.metrics_port)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        responses = await asyncio.gather(*(stub.Infer(text_request(t), timeout=30) for t in texts))
    for i, response in enumerate(responses):
        assert response.model_name == "minilm" and response.model_version == "1"
        assert cosine(embedding(response), reference[i]) >= 0.999

    after = scrape(worker.metrics_port)
    rows = total(after, names.WORKER_ROWS_TOTAL) - total(before, names.WORKER_ROWS_TOTAL)
    batches = total(after, f"{names.WORKER_BATCH_SIZE}_count") - total(
        before, f"{names.WORKER_BATCH_SIZE}_count"
    )
    assert rows == 64
    assert batches < 64, "some batches must hold more than one row"
    singles = total(after, f"{names.WORKER_BATCH_SIZE}_bucket", le="1.0") - total(
        before, f"{names.WORKER_BATCH_SIZE}_bucket", le="1.0"
    )
    assert singles < batches
    buckets_used = {
        labels["bucket"] for labels, value in samples(after, names.WORKER_BATCHES_TOTAL) if value
    }
    assert len(buckets_used) >= 3, buckets_used
    assert total(after, names.WORKER_MIXED_BUCKET_BATCHES_TOTAL) == 0


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (text_request(""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (text_request("word " * 400), grpc.StatusCode.INVALID_ARGUMENT, "at most 256"),
        (text_request("ok", "   "), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (pb.InferRequest(model_name="minilm"), grpc.StatusCode.INVALID_ARGUMENT, "no inputs"),
        (
            pb.InferRequest(model_name="minilm", inputs=[pb.ModelInput()]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "no payload",
        ),
        (
            pb.InferRequest(model_name="minilm", inputs=[pb.ModelInput(token_ids=b"\x01\x00\x00")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "multiple of 4",
        ),
        (
            pb.InferRequest(
                model_name="minilm",
                inputs=[pb.ModelInput(token_ids=b"\x65\x00\x00\x00\x66\x00\x00\x00")],
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "fingerprint",
        ),
        (text_request("hi", model_name="nope"), grpc.StatusCode.NOT_FOUND, "not found"),
        (text_request("hi", model_name="../x"), grpc.StatusCode.INVALID_ARGUMENT, "not a valid"),
        (text_request("hi", model_name=""), grpc.StatusCode.INVALID_ARGUMENT, "not a valid"),
        (text_request("hi", model_version="9"), grpc.StatusCode.NOT_FOUND, "not found"),
        (
            text_request("hi", model_version="v1"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "version number",
        ),
        # Digits int() does not read (a superscript; past its 4,300 digits): INTERNAL before.
        (text_request("hi", model_version="²"), grpc.StatusCode.INVALID_ARGUMENT, "version number"),
        (
            text_request("hi", model_version="1" * 5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "model version '111",  # the rest of the message cut (grpc_errors.bounded_message)
        ),
        (
            text_request("hi", fingerprint="0123456789abcdef"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "fingerprint",
        ),
    ],
)
async def test_s38_bad_input_is_refused_and_never_runs(
    worker, request_, code, message: str
) -> None:
    rows_before = total(scrape(worker.metrics_port), names.WORKER_ROWS_TOTAL)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Infer(request_, timeout=10)
        assert raised.value.code() == code
        assert message in raised.value.details()
        # The worker keeps serving.
        ok = await stub.Infer(text_request("still serving"), timeout=10)
    assert len(ok.outputs) == 1
    rows_after = total(scrape(worker.metrics_port), names.WORKER_ROWS_TOTAL)
    assert rows_after == rows_before + 1, "only the good request may reach the model"


async def test_fingerprint_from_list_models_is_accepted(worker) -> None:
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        listing = await stub.ListModels(pb.ListWorkerModelsRequest(), timeout=10)
        (info,) = listing.versions
        assert info.is_ready and info.kind == pb.MODEL_KIND_EMBEDDING
        assert list(info.length_buckets) == [16, 32, 64, 128, 256]
        response = await stub.Infer(
            text_request("a", "b c", fingerprint=info.fingerprint), timeout=10
        )
    assert response.fingerprint == info.fingerprint
    assert len(response.outputs) == 2
    assert await health_status(worker.address) == health_pb2.HealthCheckResponse.SERVING


def test_the_worker_runs_on_uvloop_by_default(worker: ServiceProcess) -> None:
    assert runs_uvloop(worker.process.pid)
    assert "running on uvloop's event loop" in worker.log()


async def test_s29_sigterm_drains_in_flight_work_and_exits_zero(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    # Batches with a small real cost (about 0.1 s): rows are still queued when the SIGTERM
    # lands, and the drain's work is far inside its 30 s grace, however busy the machine
    # (one torch thread: two would contend with the other test module for the cores). On
    # asyncio's own event loop: the setting's other value serves and drains as well.
    write_affine_model(repository, work_iters=100, max_batch_size=4)
    service = start_worker(
        tmp_path,
        model_repository=repository,
        extra_args=("--torch-threads", "1", "--event-loop", "asyncio"),
    )
    assert not runs_uvloop(service.process.pid)
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            rows = [np.full(4, 100.0 + i, dtype=np.float32) for i in range(16)]
            calls = [
                stub.Infer(
                    pb.InferRequest(
                        model_name="affine",
                        inputs=[
                            pb.ModelInput(
                                tensor=pb.Tensor(
                                    dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=r.tobytes()
                                )
                            )
                        ],
                    ),
                    timeout=60,
                )
                for r in rows
            ]
            in_flight = [asyncio.ensure_future(c) for c in calls]
            # Wait until the first batch has run: the rest were sent with it, so most are
            # queued or running by now. Not all need be: on busy cores a call can still be on
            # its way in when the signal lands, and the worker then refuses it at the door.
            await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            num_done_at_signal = sum(call.done() for call in in_flight)
            service.process.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*in_flight, return_exceptions=True)
    finally:
        code = await asyncio.to_thread(service.terminate)
    # Every call the worker admitted was answered: the only failures are the door's refusal of
    # calls that arrived once it was draining (never queued, never run).
    failures = [r for r in results if isinstance(r, Exception)]
    refused_at_the_door = [
        f
        for f in failures
        if isinstance(f, grpc.aio.AioRpcError)
        and f.code() == grpc.StatusCode.UNAVAILABLE
        and f.details() == "worker is draining"
    ]
    assert len(refused_at_the_door) == len(failures), failures
    # And work queued at the signal was drained: calls answered OK after it.
    num_ok = len(results) - len(failures)
    assert num_ok > num_done_at_signal, (num_ok, num_done_at_signal, failures)
    assert code == 0, service.log()
    assert "draining" in service.log()


def test_s23_model_that_fails_to_load_keeps_worker_from_becoming_ready(tmp_path: Path) -> None:
    model_dir = write_affine_model(tmp_path / "repo")
    (model_dir / "1" / "model.pt").write_bytes(b"not a torchscript archive")
    with pytest.raises(ProcessError, match="exited with code 1"):
        start_worker(tmp_path, model_repository=tmp_path / "repo", ready_timeout_s=60)
