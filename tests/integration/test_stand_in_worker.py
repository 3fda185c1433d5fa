"""A worker started with `--stand-in-curve` serves minilm as the GPU-speed stand-in over real
gRPC: the gateway-facing contract (token ids stamped with its fingerprint, outputs [384] FP32,
refusals) is the real model's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from services.common import metric_names as names
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.metrics import scrape, total
from tests.support.models import write_small_minilm_repository
from tests.support.processes import REPO_ROOT, ServiceProcess, start_worker
from tests.support.texts import sentences

pytestmark = pytest.mark.integration

H100 = REPO_ROOT / "services" / "sim" / "curves" / "minilm_h100.json"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    tmp = tmp_path_factory.mktemp("stand-in")
    repository = write_small_minilm_repository(tmp / "repo")
    service = start_worker(
        tmp, model_repository=repository, extra_args=(f"--stand-in-curve={H100}",)
    )
    yield service
    assert service.terminate() == 0, service.log()


async def test_concurrent_texts_are_answered_with_the_models_shape(
    worker: ServiceProcess,
) -> None:
    texts = sentences(32, min_words=1, max_words=20, seed=4)
    before = scrape(worker.metrics_port)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        requests = [pb.InferRequest(model_name="minilm", inputs=[pb.ModelInput(text=t)])
                    for t in texts]  # fmt: skip
        responses = await asyncio.gather(*(stub.Infer(r, timeout=60) for r in requests))
        bad = pb.InferRequest(model_name="minilm", inputs=[pb.ModelInput(text="word " * 100)])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Infer(bad, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 32" in (refused.value.details() or "")
    for response in responses:
        (tensor,) = response.outputs
        assert tensor.dtype == pb.DATA_TYPE_FP32 and list(tensor.shape) == [384]
        assert np.linalg.norm(np.frombuffer(tensor.raw_data, dtype="<f4")) == pytest.approx(1.0)
    after = scrape(worker.metrics_port)
    # Every row ran through the batcher (the refused one never did).
    assert total(after, names.WORKER_ROWS_TOTAL) - total(before, names.WORKER_ROWS_TOTAL) == 32
