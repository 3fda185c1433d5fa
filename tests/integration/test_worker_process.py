"""The worker as a real process, called over real gRPC, checked from its own metrics."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2

from services.common import metric_names as names
from services.common.processes import ProcessError
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.conftest import cosine
from tests.support.metrics import samples, scrape, total
from tests.support.models import (
    STALL,
    affine_reference,
    infer_request,
    outputs,
    release_stall,
    row,
    write_affine_model,
    write_minilm_repository,
    write_stalling_model,
)
from tests.support.processes import ServiceProcess, health_status, runs_uvloop, start_worker
from tests.support.texts import sentences
from tests.support.waiting import eventually

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
        (text_request("ok", ""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
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
    """Rows queued when the SIGTERM lands are answered before the worker exits 0. They queue
    behind a stalled batch (the stalling model's, gate closed), so the drain has work left
    however fast or busy the machine: queued behind ordinary batches (0.1 s each), a test
    process paused for longer found none left, and a fast machine may too."""
    repository = tmp_path / "repo"
    gate = tmp_path / "gate"
    write_affine_model(repository, max_batch_size=4, slo_p99_ms=30_000)
    write_stalling_model(repository, gate)
    # On asyncio's own event loop: the setting's other value serves and drains as well.
    service = start_worker(
        tmp_path,
        model_repository=repository,
        extra_args=("--torch-threads", "1", "--event-loop", "asyncio"),
    )
    assert not runs_uvloop(service.process.pid)

    def metric(name: str, model: str) -> float:
        return total(scrape(service.metrics_port), name, model=model)

    dispatched = names.WORKER_QUEUE_WAIT_SECONDS + "_count"
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            stalled_before = metric(dispatched, "stall")
            stalled = asyncio.ensure_future(
                stub.Infer(infer_request("stall", row(STALL, 0, 0, 0)), timeout=60)
            )
            await eventually(
                lambda: metric(dispatched, "stall") > stalled_before,
                message="the stalled row holds the executor",
            )
            rows = [np.full(4, 100.0 + i, dtype=np.float32) for i in range(16)]
            in_flight = [
                asyncio.ensure_future(stub.Infer(infer_request("affine", r), timeout=60))
                for r in rows
            ]
            await eventually(
                lambda: metric(names.WORKER_QUEUE_DEPTH, "affine") == len(rows),
                message="every row queued behind the stalled one",
            )
            service.process.send_signal(signal.SIGTERM)

            async def is_not_serving() -> bool:  # the port stays open: the stall holds the drain
                status = await health_status(service.address)
                return status == health_pb2.HealthCheckResponse.NOT_SERVING

            await eventually(is_not_serving, message="draining: NOT_SERVING")
            assert not any(call.done() for call in in_flight)
            release_stall(gate)
            answers = await asyncio.gather(stalled, *in_flight)
    finally:
        release_stall(gate)
        code = await asyncio.to_thread(service.terminate)
    # Every row admitted before the signal was answered, each with its own output.
    expected = affine_reference(torch.from_numpy(np.stack(rows))).numpy()
    answered = np.concatenate([outputs(a) for a in answers[1:]])
    np.testing.assert_allclose(answered, expected, rtol=1e-5)
    assert code == 0, service.log()
    assert "draining" in service.log()


async def test_a_worker_stopped_after_its_watchdog_fired_exits_one(tmp_path: Path) -> None:
    """A model call runs past the watchdog: the worker turns NOT_SERVING (its liveness probe
    then has it stopped) and, stopped, exits 1, not 0 as after an ordinary stop: its pod's or
    the stack's record shows the fault (review finding)."""
    repository, gate = tmp_path / "repo", tmp_path / "gate"
    write_stalling_model(repository, gate)
    service = start_worker(tmp_path, model_repository=repository, extra_args=("--watchdog-s", "1"))
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Infer(infer_request("stall", row(STALL, 0, 0, 0)), timeout=60)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE

            async def is_not_serving() -> bool:
                status = await health_status(service.address)
                return status == health_pb2.HealthCheckResponse.NOT_SERVING

            await eventually(is_not_serving, message="wedged: NOT_SERVING")
    finally:
        release_stall(gate)  # the wedged call returns, so the drain ends
        code = await asyncio.to_thread(service.terminate)
    assert code == 1, service.log()


def test_s23_model_that_fails_to_load_keeps_worker_from_becoming_ready(tmp_path: Path) -> None:
    model_dir = write_affine_model(tmp_path / "repo")
    (model_dir / "1" / "model.pt").write_bytes(b"not a torchscript archive")
    with pytest.raises(ProcessError, match="exited with code 1"):
        start_worker(tmp_path, model_repository=tmp_path / "repo", ready_timeout_s=60)
