"""Load and counters shared by the fixed-cost e2e tests (tests/e2e/test_fabric*.py)."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common import metric_names as names
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.metrics import scrape, total
from tests.support.stack import Stack

#: Client deadline of these tests: long enough that a retry on another worker always fits.
TIMEOUT_S = 20.0


def predict_request(*texts: str, model: str = "minilm", version: str = "") -> api.PredictRequest:
    return api.PredictRequest(
        model_name=model, model_version=version, inputs=[api.PredictInput(text=t) for t in texts]
    )


def routed_to(stack: Stack, worker_id: str) -> float:
    return total(scrape(stack.router.metrics_port), names.ROUTER_ROUTED_TOTAL, worker=worker_id)


async def run_load(
    address: str, *, seconds: float, concurrency: int = 6
) -> list[BaseException | None]:
    """Closed-loop load: `concurrency` callers, each sending one request after another."""
    results: list[BaseException | None] = []
    stop_at = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)

        async def caller(n: int) -> None:
            i = 0
            while time.monotonic() < stop_at:
                try:
                    reply = await stub.Predict(
                        predict_request(f"caller {n} request {i}"), timeout=TIMEOUT_S
                    )
                    assert len(reply.outputs) == 1
                    results.append(None)
                except grpc.aio.AioRpcError as error:
                    results.append(error)
                i += 1

        await asyncio.gather(*(caller(n) for n in range(concurrency)))
    return results
