"""Scenarios 23 and 24 and the worker's drain: real in-process workers on port 0, real
TorchScript models (one version's weights corrupt), a real redis-server for the registry."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2
from prometheus_client import generate_latest

from services.common import metric_names as names
from services.common.model_repository import ModelConfigError
from services.common.registry_schema import RegistryKeys, WorkerRecord, connect
from services.gpu_worker.batching.driver import BatchingDriver
from services.gpu_worker.config import HeartbeatConfig, WorkerConfig
from services.gpu_worker.server import SERVICE_NAME, Worker, create_worker
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.metrics import total
from tests.support.models import write_affine_model
from tests.support.processes import health_status
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


def request(version: str = "") -> pb.InferRequest:
    data = np.array([1, 2, 3, 4], dtype=np.float32).tobytes()
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=data)
    return pb.InferRequest(
        model_name="affine", model_version=version, inputs=[pb.ModelInput(tensor=tensor)]
    )


def corrupt(model_dir: Path, version: int) -> None:
    (model_dir / str(version) / "model.pt").write_bytes(b"not a torchscript archive")


class _Failing(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this device")


def fail_warm_up(model_dir: Path, version: int) -> None:
    """A version whose weights load and whose every run fails (its warm-up first)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript, as bench.models
        torch.jit.script(_Failing()).save(str(model_dir / str(version) / "model.pt"))


def config(tmp_path: Path, redis_url: str | None = None) -> WorkerConfig:
    return WorkerConfig(
        model_repository=tmp_path / "repo",
        grpc_port=0,
        metrics_port=0,
        redis_url=redis_url,
        worker_id="w1",
        heartbeat=HeartbeatConfig(period_s=0.05),
    )


async def registered(redis_server: RedisServer) -> WorkerRecord | None:
    client = connect(redis_server.url)
    try:
        keys = RegistryKeys()
        raw = await client.get(keys.worker("w1"))
        is_listed = await client.zscore(keys.workers, "w1") is not None
    finally:
        await client.aclose()
    return WorkerRecord.from_json(raw) if raw is not None and is_listed else None


async def test_s24_a_version_that_fails_to_load_leaves_the_others_serving(
    tmp_path: Path, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    corrupt(write_affine_model(tmp_path / "repo", versions=(1, 2)), 2)
    worker = await create_worker(config(tmp_path, redis_server.worker_url))
    try:
        with caplog.at_level(logging.ERROR):
            await worker.load()
        record = await eventually(lambda: registered(redis_server), message="registered")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            listed = await stub.ListModels(pb.ListWorkerModelsRequest(), timeout=10)
            latest = await stub.Infer(request(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.Infer(request("2"), timeout=10)
        status = await health_status(f"127.0.0.1:{worker.port}", SERVICE_NAME)
    finally:
        await worker.stop()
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert [(v.model_version, v.is_ready) for v in listed.versions] == [("1", True)]
    assert [(m.name, m.version) for m in record.models] == [("affine", "1")]
    assert latest.model_version == "1"
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    assert "affine/2 failed to load" in caplog.text
    exported = generate_latest(worker.metrics.registry).decode()
    failures = names.WORKER_MODEL_LOAD_FAILURES_TOTAL
    assert total(exported, failures, model="affine", version="2") == 1
    assert total(exported, failures, model="affine", version="1") == 0


async def test_a_version_whose_warm_up_fails_at_start_is_left_out_as_a_failed_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, it failed the worker's start (a crash loop until the version left the disk),
    where a hot load of it left it out (review finding)."""
    fail_warm_up(write_affine_model(tmp_path / "repo", versions=(1, 2)), 2)
    worker = await create_worker(config(tmp_path))
    try:
        with caplog.at_level(logging.ERROR):
            await worker.load()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            listed = await stub.ListModels(pb.ListWorkerModelsRequest(), timeout=10)
            latest = await stub.Infer(request(), timeout=10)
        status = await health_status(f"127.0.0.1:{worker.port}", SERVICE_NAME)
    finally:
        await worker.stop()
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert [(v.model_version, v.is_ready) for v in listed.versions] == [("1", True)]
    assert latest.model_version == "1"
    assert "affine/2 failed to warm up" in caplog.text
    exported = generate_latest(worker.metrics.registry).decode()
    failures = names.WORKER_MODEL_LOAD_FAILURES_TOTAL
    assert total(exported, failures, model="affine", version="2") == 1
    # A model whose only version fails its warm-up is one with no loadable version.
    fail_warm_up(tmp_path / "repo" / "affine", 1)
    alone = await create_worker(config(tmp_path))
    try:
        with pytest.raises(ModelConfigError, match="no version of affine loaded"):
            await alone.load()
    finally:
        await alone.stop()


async def test_s23_a_model_with_no_loadable_version_keeps_the_worker_not_serving(
    tmp_path: Path,
) -> None:
    write_affine_model(tmp_path / "repo", name="good")
    corrupt(write_affine_model(tmp_path / "repo", versions=(1, 2)), 1)
    corrupt(tmp_path / "repo" / "affine", 2)
    worker = await create_worker(config(tmp_path))
    try:
        with pytest.raises(ModelConfigError, match="no version of affine loaded"):
            await worker.load()
        status = await health_status(f"127.0.0.1:{worker.port}", SERVICE_NAME)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.WorkerServiceStub(channel).Infer(request(), timeout=10)
    finally:
        await worker.stop()
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_drain_that_fails_still_deregisters_the_worker(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 16: a drain error other than a timeout skipped deregistration, leaving an entry
    # that drew routers' calls to a process going away.
    write_affine_model(tmp_path / "repo")
    worker: Worker = await create_worker(config(tmp_path, redis_server.worker_url))
    await worker.load()
    await eventually(lambda: registered(redis_server), message="registered")

    async def broken_drain(self: BatchingDriver) -> None:
        raise RuntimeError("drain broke")

    monkeypatch.setattr(BatchingDriver, "drain", broken_drain)
    with pytest.raises(RuntimeError, match="drain broke"):
        await worker.stop()
    assert await registered(redis_server) is None
    # The server closed too: nothing answers on its port any more.
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await health_status(f"127.0.0.1:{worker.port}")
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
