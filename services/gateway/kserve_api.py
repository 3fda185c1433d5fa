"""The Open Inference Protocol v2 (KServe v2) gRPC service, so stock Triton and KServe clients
work unmodified. Same behaviour as the project's own API: both call the one Predictor.

Wire conventions (as tritonclient sends and reads them): BYTES inputs arrive in
`raw_input_contents` as 4-byte little-endian lengths each followed by the bytes (or typed in
`contents.bytes_contents`); outputs go back in `raw_output_contents`, one entry per output, in
the order of `outputs`.
"""

from __future__ import annotations

import importlib.metadata
import math
import struct
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import numpy as np

from services.common.errors import (
    InvalidInput,
    NotFound,
    PermissionDenied,
    ServingError,
    Unavailable,
)
from services.common.model_repository import ModelConfig, TensorSpec
from services.common.repository_state import ModelState
from services.common.tensors import MAX_ELEMENTS, NUMPY_DTYPES
from services.gateway.auth import Principal, current_principal
from services.gateway.kserve_generate import check_inputs, stream_infer
from services.gateway.metrics import GatewayMetrics
from services.gateway.predictor import PredictCall, Predictor, PredictValue
from services.gateway.repository_control import RepositoryControl
from services.gateway.triton_info import (
    PLATFORMS,
    UNIMPLEMENTED_RPCS,
    model_config_message,
    request_parameters,
    unimplemented,
)
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc

SERVER_NAME = "inference-fabric"
#: The installed distribution's version (pyproject.toml), as ServerMetadata reports it.
SERVER_VERSION = importlib.metadata.version("inference-fabric")
#: Triton protocol extensions this server serves (ServerMetadata).
EXTENSIONS = (
    "model_configuration",
    "statistics",
    "schedule_policy",
    "parameters",
    "model_repository",
    # KServe v2 REST's binary tensor data (the gateway's HTTP port; gRPC has raw contents).
    "binary_tensor_data",
)
#: Longest a RepositoryModelLoad waits for the fleet to serve the model (less with a tighter
#: caller deadline): warm-up of a large model takes tens of seconds.
LOAD_WAIT_S = 120.0
_TYPED_FIELDS = {
    "FP32": "fp32_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
}


def _decode_bytes(raw: bytes, count: int) -> list[str]:
    """Length-prefixed BYTES elements; INVALID_ARGUMENT if the framing or UTF-8 is wrong."""
    texts, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInput("BYTES tensor: truncated length prefix")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput("BYTES tensor: element runs past the end of the data")
        try:
            texts.append(raw[offset : offset + length].decode("utf-8"))
        except UnicodeDecodeError as error:
            raise InvalidInput("BYTES tensor elements must be UTF-8 text") from error
        offset += length
    if len(texts) != count:
        raise InvalidInput(f"BYTES tensor holds {len(texts)} elements; its shape says {count}")
    return texts


def _num_rows(shape: list[int], row_dims: tuple[int, ...], name: str, *, is_bytes: bool) -> int:
    """Rows in a [batch, *row_dims] input (BYTES: [batch] or [batch, 1])."""
    if is_bytes:
        is_valid = len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)
        expected = "[batch] or [batch, 1]"
    else:
        is_valid = len(shape) == len(row_dims) + 1 and tuple(shape[1:]) == row_dims
        expected = f"[batch, {', '.join(map(str, row_dims))}]"
    if not is_valid or shape[0] < 0:
        raise InvalidInput(f"input {name} has shape {shape}; expected {expected}")
    if shape[0] == 0:
        raise InvalidInput(f"input {name} is empty")
    return shape[0]


def _values(
    config: ModelConfig, request: kserve.ModelInferRequest, max_rows: int
) -> list[PredictValue]:
    """The request's rows, decoded only after every check on the tensor's metadata (name,
    dtype, shape, row cap) has passed."""
    check_inputs(request)
    spec = config.inputs[0]
    tensors = {t.name: i for i, t in enumerate(request.inputs)}
    if set(tensors) != {spec.name}:
        raise InvalidInput(
            f"{config.name} takes exactly one input named {spec.name!r}, got {sorted(tensors)}"
        )
    index = tensors[spec.name]
    tensor = request.inputs[index]
    if tensor.datatype != spec.dtype:
        raise InvalidInput(
            f"input {spec.name} must be {spec.dtype}, got {tensor.datatype or 'none'}"
        )
    shape = list(tensor.shape)
    count = _num_rows(shape, spec.dims, spec.name, is_bytes=spec.dtype == "BYTES")
    if count > max_rows:
        raise InvalidInput(f"{count} inputs exceed the limit of {max_rows}")
    if spec.dtype == "BYTES":
        if request.raw_input_contents:
            return list(_decode_bytes(request.raw_input_contents[index], count))
        elements = list(tensor.contents.bytes_contents)
        if len(elements) != count:
            raise InvalidInput(
                f"input {spec.name} holds {len(elements)} elements; shape says {count}"
            )
        try:
            return [e.decode("utf-8") for e in elements]
        except UnicodeDecodeError as error:
            raise InvalidInput("BYTES tensor elements must be UTF-8 text") from error
    dtype = NUMPY_DTYPES[spec.dtype]
    num_elements = math.prod(shape)  # Python ints: a numpy product would wrap around
    if num_elements > MAX_ELEMENTS:
        raise InvalidInput(f"input {spec.name} of {num_elements} elements exceeds the limit")
    if request.raw_input_contents:
        raw = request.raw_input_contents[index]
        if len(raw) != num_elements * dtype.itemsize:
            raise InvalidInput(f"input {spec.name}: {len(raw)} bytes do not match shape {shape}")
        array = np.frombuffer(raw, dtype=dtype)
    else:
        field = _TYPED_FIELDS.get(spec.dtype)
        values = getattr(tensor.contents, field) if field else []
        if len(values) != num_elements:
            raise InvalidInput(
                f"input {spec.name}: {len(values)} values do not match shape {shape}"
            )
        array = np.asarray(values, dtype=dtype)
    return list(array.reshape((count, *spec.dims)))


class KServeServicer(kserve_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        predictor: Predictor,
        metrics: GatewayMetrics,
        *,
        max_inputs: int,
        repository: RepositoryControl | None = None,
    ) -> None:
        self._predictor = predictor
        self._metrics = metrics
        #: Most rows one ModelInfer may carry, checked before any element is decoded.
        self._max_inputs = max_inputs
        #: The fleet's desired model state (None without Redis: the repository RPCs refuse).
        self._repository = repository

    def _repository_control(self, action: str) -> RepositoryControl:
        """The repository control, for an admin caller only."""
        current_principal().check_admin(action)
        if self._repository is None:
            raise Unavailable(f"{action} needs the gateway's Redis (--redis-url)")
        return self._repository

    async def RepositoryIndex(
        self, request: kserve.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> kserve.RepositoryIndexResponse:
        """Every version of the repository, READY or UNAVAILABLE in the fleet (admin only)."""
        control = self._repository_control("RepositoryIndex")
        return await control.index(is_ready_only=request.ready)

    async def RepositoryModelLoad(
        self, request: kserve.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> kserve.RepositoryModelLoadResponse:
        """Asks every worker whose pool has the model to load all its versions (admin only);
        answers once the fleet serves them, or FAILED_PRECONDITION with the load errors."""
        control = self._repository_control("RepositoryModelLoad")
        remaining_s = context.time_remaining()
        timeout_s = LOAD_WAIT_S if remaining_s is None else min(LOAD_WAIT_S, remaining_s - 0.5)
        await control.load(request.model_name, timeout_s=max(0.0, timeout_s))
        return kserve.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: kserve.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> kserve.RepositoryModelUnloadResponse:
        """Asks every worker to unload the model (admin only): its calls in flight finish;
        answers once the desired state is written: workers converge within about 1-2 s."""
        control = self._repository_control("RepositoryModelUnload")
        await control.set_state(request.model_name, ModelState.UNLOADED)
        return kserve.RepositoryModelUnloadResponse()

    async def ServerLive(
        self, request: kserve.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ServerLiveResponse:
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: kserve.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ServerReadyResponse:
        catalog = self._predictor.catalog
        ready = any(catalog.served_versions(n) for n in catalog.model_names())
        return kserve.ServerReadyResponse(ready=ready)

    async def ServerMetadata(
        self, request: kserve.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ServerMetadataResponse:
        return kserve.ServerMetadataResponse(
            name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS
        )

    async def ModelReady(
        self, request: kserve.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ModelReadyResponse:
        try:
            current_principal().check_model(request.name)
            self._predictor.catalog.resolve(request.name, request.version)
        except ServingError:
            return kserve.ModelReadyResponse(ready=False)
        return kserve.ModelReadyResponse(ready=True)

    async def ModelMetadata(
        self, request: kserve.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ModelMetadataResponse:
        catalog = self._predictor.catalog
        config = catalog.config(request.name)
        current_principal().check_model(config.name)
        versions = [v.model_version for v in catalog.served_versions(config.name)]
        if request.version and request.version not in versions:
            raise NotFound(f"model {config.name!r} version {request.version!r} is not served")

        def metadata(
            specs: Iterable[TensorSpec],
        ) -> list[kserve.ModelMetadataResponse.TensorMetadata]:
            return [
                kserve.ModelMetadataResponse.TensorMetadata(
                    name=s.name,
                    datatype=s.dtype,
                    shape=[-1] if s.dtype == "BYTES" else [-1, *s.dims],
                )
                for s in specs
            ]

        return kserve.ModelMetadataResponse(
            name=config.name,
            versions=versions,
            platform=PLATFORMS[config.kind],
            inputs=metadata(config.inputs),
            outputs=metadata(config.outputs),
        )

    async def ModelConfig(
        self, request: kserve.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ModelConfigResponse:
        catalog = self._predictor.catalog
        config = catalog.config(request.name)
        current_principal().check_model(config.name)
        if request.version:
            catalog.resolve(config.name, request.version)
        return kserve.ModelConfigResponse(config=model_config_message(config))

    async def ModelStatistics(
        self, request: kserve.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ModelStatisticsResponse:
        catalog, principal = self._predictor.catalog, current_principal()
        if request.name:
            principal.check_model(catalog.config(request.name).name)
            names = [request.name]
        else:
            names = [n for n in catalog.model_names() if _may_use(principal, n)]
        stats: list[kserve.ModelStatistics] = []
        for name in names:
            served = [v.model_version for v in catalog.served_versions(name)]
            statistics = self._predictor.statistics
            versions = sorted({*served, *statistics.versions(name)}, key=_numeric)
            if request.version:
                if request.version not in versions:
                    raise NotFound(f"model {name!r} version {request.version!r} is not served")
                versions = [request.version]
            stats.extend(
                statistics.message(name, v, catalog.worker_times(name, v)) for v in versions
            )
        return kserve.ModelStatisticsResponse(model_stats=stats)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[kserve.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[kserve.ModelStreamInferResponse]:
        responses = stream_infer(
            self._predictor, request_iterator, current_principal(), context.time_remaining
        )
        async for response in responses:
            yield response

    async def ModelInfer(
        self, request: kserve.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ModelInferResponse:
        label = self._predictor.catalog.label_for(request.model_name)
        with self._metrics.observe_request("kserve_v2", label):
            config = self._predictor.catalog.config(request.model_name)
            principal = current_principal()
            # Before any input is decoded: a caller may not spend our CPU on a model it may
            # not use, nor on more rows than the cap.
            principal.check_model(config.name)
            if config.generation is not None:
                raise InvalidInput(f"{config.name} is a decoupled model: call ModelStreamInfer")
            options = request_parameters(request.parameters)
            output = config.outputs[0]
            requested = [o.name for o in request.outputs]
            if requested and requested != [output.name]:
                raise InvalidInput(
                    f"{config.name} has one output, {output.name!r}; asked {requested}"
                )
            result = await self._predictor.predict(
                PredictCall(
                    model_name=request.model_name,
                    version_spec=request.model_version,
                    inputs=_values(config, request, self._max_inputs),
                    principal=principal,
                    request_id=request.id,
                    timeout_s=options.deadline_s(context.time_remaining()),
                    priority=options.priority,
                )
            )
            batch = np.stack(result.outputs).astype(NUMPY_DTYPES[output.dtype], copy=False)
            return kserve.ModelInferResponse(
                model_name=result.model_name,
                model_version=result.model_version,
                id=request.id,
                outputs=[
                    kserve.ModelInferResponse.InferOutputTensor(
                        name=output.name, datatype=output.dtype, shape=list(batch.shape)
                    )
                ],
                raw_output_contents=[batch.tobytes()],
            )


def _may_use(principal: Principal, model_name: str) -> bool:
    try:
        principal.check_model(model_name)
    except PermissionDenied:
        return False
    return True


def _numeric(version: str) -> tuple[int, str]:
    return (len(version), version)


def _unimplemented_method(rpc: str) -> Any:
    async def method(self: KServeServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise unimplemented(rpc)

    method.__name__ = method.__qualname__ = rpc
    return method


for _rpc in UNIMPLEMENTED_RPCS:
    setattr(KServeServicer, _rpc, _unimplemented_method(_rpc))
