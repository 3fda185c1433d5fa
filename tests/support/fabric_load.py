"""Load and counters shared by the fixed-cost e2e tests."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from services.common import metric_names as names
from services.common.tensors import tensor_to_pb
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.metrics import scrape, total
from tests.support.stack import Stack
from tests.support.waiting import eventually

#: Client deadline of these tests: long enough that a retry on another worker always fits.
TIMEOUT_S = 20.0
#: Bound on each wait for a load to reach a count of answers: generous, since a stack shares
#: two cores with another test module; a load that stalls fails by name.
ANSWERS_TIMEOUT_S = 120.0


def predict_request(*texts: str, model: str = "minilm", version: str = "") -> api.PredictRequest:
    return api.PredictRequest(
        model_name=model, model_version=version, inputs=[api.PredictInput(text=t) for t in texts]
    )


def predict_row_request(
    row: np.ndarray, *, model: str = "affine", request_id: str = ""
) -> api.PredictRequest:
    """A Predict of one tensor row (an affine-shaped test model's: FP32 [4])."""
    return api.PredictRequest(
        model_name=model, inputs=[api.PredictInput(tensor=tensor_to_pb(row))], request_id=request_id
    )


def routed_to(stack: Stack, worker_id: str) -> float:
    return total(scrape(stack.router.metrics_port), names.ROUTER_ROUTED_TOTAL, worker=worker_id)


class ClosedLoopLoad:
    """Closed-loop load until `stop`: `concurrency` callers, each sending one request after
    another; `results` holds None for each answer and the error of each failure. Created
    inside a running event loop."""

    def __init__(self, address: str, concurrency: int = 6) -> None:
        self.results: list[BaseException | None] = []
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(address, concurrency))

    async def _run(self, address: str, concurrency: int) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)

            async def caller(n: int) -> None:
                i = 0
                while not self._stop.is_set():
                    try:
                        reply = await stub.Predict(
                            predict_request(f"caller {n} request {i}"), timeout=TIMEOUT_S
                        )
                        assert len(reply.outputs) == 1
                        self.results.append(None)
                    except grpc.aio.AioRpcError as error:
                        self.results.append(error)
                    i += 1

            await asyncio.gather(*(caller(n) for n in range(concurrency)))

    async def answered(self, more: int, what: str, timeout_s: float = ANSWERS_TIMEOUT_S) -> None:
        """Waits until `more` calls beyond those made so far have ended."""
        count = len(self.results)
        await eventually(
            lambda: len(self.results) >= count + more,
            timeout_s=timeout_s,
            message=f"{more} more calls ended {what}",
        )

    def failures(self) -> list[BaseException]:
        return [r for r in self.results if r is not None]

    async def stop(self) -> list[BaseException | None]:
        self._stop.set()
        await self._task
        return self.results
