"""A load-generator target that keeps its calls in flight on one open ModelStreamInfer stream
(as tritonclient's `async_stream_infer` does), for comparing the tiers' CPU per request with
unary calls of the same request (services.gateway.kserve_infer says why it is cheaper).

Each `send()` is one request of the stream, answered by its own id; it raises `StreamRefusal`
(whose `code()` is the gRPC status the gateway put in the response's `error_message`) for a
request answered with an error, and TimeoutError past its timeout. Each request is a copy of
one built up front, with its id set.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc
import numpy as np

from bench.fabric.stack import IDENTITY_DIMS
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc


class StreamRefusal(Exception):
    """A request answered in-band with an error: `code()` as a gRPC error's."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        name = message.split(":", 1)[0]
        self._code = grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else None

    def code(self) -> grpc.StatusCode:
        return self._code or grpc.StatusCode.UNKNOWN


def identity_infer(
    request_id: str, model: str, timeout_s: float | None
) -> kserve.ModelInferRequest:
    """One row of the identity model, with Triton's `timeout` parameter (microseconds); None:
    no parameter, the deadline the call's (as a stock client's unary call sends it)."""
    row = np.arange(IDENTITY_DIMS, dtype="<f4")
    tensor = kserve.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=[1, IDENTITY_DIMS]
    )
    request = kserve.ModelInferRequest(
        model_name=model, id=request_id, inputs=[tensor], raw_input_contents=[row.tobytes()]
    )
    if timeout_s is not None:
        request.parameters["timeout"].int64_param = int(timeout_s * 1e6)
    return request


class StreamSender:
    """One open stream on `channel`; `send` is a load-generator target. Close with `aclose`.
    Every send has an id of its own, so a late answer to a call its caller gave up on is
    dropped, never taken for a newer call's."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, model: str = "identity"):
        self._timeout_s = timeout_s
        self._template = identity_infer("", model, timeout_s)
        self._ids = itertools.count()
        self._outbox: asyncio.Queue[kserve.ModelInferRequest | None] = asyncio.Queue()
        self._waiting: dict[str, asyncio.Future[None]] = {}
        #: Answers whose call was no longer waiting (its caller gave up on it).
        self.num_late_answers = 0
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        self._call = stub.ModelStreamInfer(self._outgoing())
        self._reader = asyncio.create_task(self._read())

    async def _outgoing(self) -> AsyncIterator[kserve.ModelInferRequest]:
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for response in self._call:
                future = self._waiting.pop(response.infer_response.id, None)
                if future is None or future.done():
                    self.num_late_answers += 1
                elif response.error_message:
                    future.set_exception(StreamRefusal(response.error_message))
                else:
                    future.set_result(None)
        finally:
            ended = ConnectionError("the stream ended")
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(ended)
            self._waiting.clear()

    async def send(self) -> None:
        if self._reader.done():
            raise ConnectionError("the stream ended")
        request = kserve.ModelInferRequest()
        request.CopyFrom(self._template)
        request.id = str(next(self._ids))
        future = asyncio.get_running_loop().create_future()
        self._waiting[request.id] = future
        self._outbox.put_nowait(request)
        try:
            # A second past the request's own timeout, which the gateway answers.
            await asyncio.wait_for(future, self._timeout_s + 1.0)
        finally:
            if self._waiting.get(request.id) is future:
                del self._waiting[request.id]

    async def aclose(self) -> None:
        self._outbox.put_nowait(None)
        try:
            await asyncio.wait_for(self._reader, 10.0)
        except Exception:  # the stream failed or hung: end it from this side
            self._call.cancel()
