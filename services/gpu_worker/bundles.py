"""The worker's side of a bundle (services.common.bundles): the rows of several callers in one
call, each caller's slice admitted, queued, timed out, cancelled and answered on its own.

One bad, refused, late or cancelled slice never fails its bundle-mates: only what the whole
bundle shares (the model, its version and fingerprint, the packed columns) fails the call.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import numpy as np

from services.common.bundles import SliceCancels, slice_time_left_s, unpack_token_rows
from services.common.errors import InvalidInput
from services.common.grpc_errors import status_of
from services.common.priority import PriorityClass, worker_priority
from services.common.tensors import tensor_from_pb, tensor_to_pb
from services.common.text import TokenIds
from services.common.tracing import traced_as
from services.gpu_worker.backends.base import Backend, RawInput
from services.gpu_worker.batching.driver import BatchingDriver
from services.gpu_worker.metrics import WorkerMetrics
from services.pb.inference.v1 import worker_pb2 as pb

_OK = pb.SliceStatus()


def request_priority(value: int) -> PriorityClass:
    """The priority class of an internal request; INVALID_ARGUMENT for an unknown value."""
    try:
        return worker_priority(value)
    except ValueError as error:
        raise InvalidInput(str(error)) from error


def bundle_rows(request: pb.InferRequest, num_rows: int) -> list[RawInput]:
    """Every row of a bundle's packed columns, in slice order; INVALID_ARGUMENT for columns
    that do not make `num_rows` rows (the whole bundle fails: its caller built it wrong)."""
    packed = request.packed
    if packed.token_ids or packed.row_lengths:
        if not request.fingerprint:
            raise InvalidInput("token_ids inputs require the tokenizer's fingerprint")
        ids = unpack_token_rows(packed.token_ids, packed.row_lengths, num_rows)
        return [TokenIds(i) for i in ids]
    if packed.HasField("tensor"):
        stacked = tensor_from_pb(packed.tensor)
        if stacked.ndim < 1 or stacked.shape[0] != num_rows:
            raise InvalidInput(
                f"packed tensor of shape {list(stacked.shape)} is not {num_rows} rows"
            )
        return list(stacked)
    raise InvalidInput("a bundle carries no packed rows (token_ids or tensor)")


class BundleRunner:
    """Runs bundles on one worker's batching driver."""

    def __init__(self, batching: BatchingDriver, metrics: WorkerMetrics) -> None:
        self._batching = batching
        self._metrics = metrics

    async def infer(
        self,
        backend: Backend,
        request: pb.InferRequest,
        time_left_s: float | None,
        cancels: SliceCancels | None,
    ) -> pb.InferResponse:
        """The answer to a bundle: one status per slice, the OK slices' rows stacked."""
        try:
            tasks = self._start_slices(backend, request, time_left_s)
        except Exception as error:  # refuses every slice alike: counted for each
            code = status_of(error).code.name
            labels = (backend.config.name, backend.version.version, code)
            self._metrics.requests_total.labels(*labels).inc(len(request.slices))
            raise

        def cancel(index: int) -> None:
            if index < len(tasks):
                tasks[index].cancel()  # its rows leave the queue (BatchingDriver.submit)

        stop = None if cancels is None else cancels.listen(cancel)
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if stop is not None:
                stop()
        return self._answer(backend, results)

    def _start_slices(
        self, backend: Backend, request: pb.InferRequest, time_left_s: float | None
    ) -> list[asyncio.Task[list[np.ndarray]]]:
        """One task per slice; raises what refuses the whole bundle."""
        backend.check_fingerprint(request.fingerprint)
        slices = request.slices
        if any(s.rows == 0 for s in slices):
            raise InvalidInput("every slice of a bundle needs at least one row")
        num_rows = sum(s.rows for s in slices)
        if num_rows > backend.config.max_queue_size:
            raise InvalidInput(
                f"{num_rows} inputs exceed the queue capacity of "
                f"{backend.config.max_queue_size}; split the bundle"
            )
        # What refuses every slice alike refuses the bundle, so the router retries it elsewhere.
        self._batching.open_lane(backend)
        rows = bundle_rows(request, num_rows)
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[list[np.ndarray]]] = []
        start = 0
        for piece in slices:
            part = rows[start : start + piece.rows]
            start += piece.rows
            timeout_s = slice_time_left_s(time_left_s, piece.earlier_us)
            tasks.append(loop.create_task(self._run_slice(backend, part, piece, timeout_s)))
        return tasks

    async def _run_slice(
        self,
        backend: Backend,
        raw: Sequence[RawInput],
        piece: pb.Slice,
        timeout_s: float | None,
    ) -> list[np.ndarray]:
        labels = (backend.config.name, backend.version.version)
        code = "OK"
        try:
            with traced_as(piece.traceparent):
                prepared = backend.prepare_many(raw)
                if piece.unnormalized:
                    prepared = [dataclasses.replace(r, is_normalized=False) for r in prepared]
                return await self._batching.submit(
                    backend,
                    prepared,
                    timeout_s=timeout_s,
                    tenant=piece.tenant or "default",
                    priority=request_priority(piece.priority),
                    weight=piece.tenant_weight,
                )
        except BaseException as error:
            code = status_of(error).code.name
            raise
        finally:
            self._metrics.requests_total.labels(*labels, code).inc()

    @staticmethod
    def _answer(backend: Backend, results: Sequence[object]) -> pb.InferResponse:
        response = pb.InferResponse(
            model_name=backend.config.name,
            model_version=backend.version.version,
            fingerprint=backend.fingerprint,
        )
        outputs: list[np.ndarray] = []
        for result in results:
            if isinstance(result, BaseException):
                status = status_of(result)
                response.slices.append(
                    pb.SliceStatus(
                        code=status.code.value[0],
                        message=status.message,
                        trailers=dict(status.trailers),
                    )
                )
            else:
                assert isinstance(result, list)
                outputs.extend(result)
                response.slices.append(_OK)
        if outputs:
            first = outputs[0]
            if all(o.shape == first.shape and o.dtype == first.dtype for o in outputs):
                response.packed_outputs.CopyFrom(tensor_to_pb(np.stack(outputs)))
            else:  # rows of different shapes do not stack: one tensor each
                response.outputs.extend(tensor_to_pb(o) for o in outputs)
        return response
