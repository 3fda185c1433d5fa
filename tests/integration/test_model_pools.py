"""Model pools: a worker started with `--models` loads and serves those models only, and one
naming a model the repository lacks does not start."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.common.processes import ProcessError
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.models import write_affine_model
from tests.support.processes import start_worker

pytestmark = pytest.mark.integration


async def test_a_worker_serves_only_the_models_of_its_pool(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    for name in ("alpha", "beta", "gamma"):
        write_affine_model(repository, name)
    service = start_worker(
        tmp_path, model_repository=repository, extra_args=("--models", "beta,gamma")
    )
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            listed = await stub.ListModels(pb.ListWorkerModelsRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Infer(pb.InferRequest(model_name="alpha"), timeout=10)
    finally:
        assert service.terminate() == 0, service.log()
    assert sorted(v.model_name for v in listed.versions) == ["beta", "gamma"]
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_pool_naming_an_unknown_model_does_not_start(tmp_path: Path) -> None:
    write_affine_model(tmp_path / "repo", "alpha")
    with pytest.raises(ProcessError, match="exited with code"):
        start_worker(
            tmp_path,
            model_repository=tmp_path / "repo",
            extra_args=("--models", "alpha,missing"),
            ready_timeout_s=60,
        )
    logs = "".join(p.read_text() for p in tmp_path.glob("worker-ready-*.log"))
    assert "models not in the repository: missing" in logs
