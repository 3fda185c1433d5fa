"""The Open Inference Protocol v2 (KServe v2) gRPC service, so stock Triton and KServe clients
work unmodified. Same behaviour as the project's own API: both call the one Predictor. The
inference requests themselves are decoded and served by services.gateway.kserve_infer.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc

from services.common.door import Door
from services.common.errors import (
    InvalidInput,
    NotFound,
    PermissionDenied,
    ServingError,
    Unavailable,
)
from services.common.model_repository import TensorSpec
from services.common.repository_state import ModelState
from services.gateway.auth import KeyStore, Principal, current_principal
from services.gateway.kserve_infer import StreamInfer, infer_one
from services.gateway.metrics import GatewayMetrics
from services.gateway.predictor import Predictor
from services.gateway.repository_control import RepositoryControl
from services.gateway.triton_info import (
    PLATFORMS,
    UNIMPLEMENTED_RPCS,
    model_config_message,
    request_inputs,
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
#: The `api` label of the KServe calls this servicer (and the REST door before it) counts.
KSERVE_API = "kserve_v2"


class KServeServicer(kserve_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        predictor: Predictor,
        metrics: GatewayMetrics,
        *,
        max_inputs: int,
        repository: RepositoryControl | None = None,
        door: Door | None = None,
        keys: KeyStore | None = None,
    ) -> None:
        self._predictor = predictor
        self._metrics = metrics
        #: Most rows one ModelInfer may carry, checked before any element is decoded.
        self._max_inputs = max_inputs
        #: The fleet's desired model state (None without Redis: the repository RPCs refuse).
        self._repository = repository
        #: ModelStreamInfer's requests pass the process's door one by one (unary calls pass
        #: it as calls, before this servicer).
        self._streams = StreamInfer(predictor, metrics, max_inputs, door, keys)

    def _repository_control(self, action: str, model_name: str = "") -> RepositoryControl:
        """The repository control, for an admin caller only, of a model its key may use
        (`model_name`: the one the action changes): an admin key limited to some models
        loaded and unloaded every other one (review finding)."""
        principal = current_principal()
        principal.check_admin(action)
        if model_name and principal.models is not None:  # a load may find it on disk first
            principal.check_model(model_name)
        if self._repository is None:
            raise Unavailable(f"{action} needs the gateway's Redis (--redis-url)")
        return self._repository

    async def RepositoryIndex(
        self, request: kserve.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> kserve.RepositoryIndexResponse:
        """Every version of the repository, READY or UNAVAILABLE in the fleet (admin only)."""
        control = self._repository_control("RepositoryIndex")
        index = await control.index(is_ready_only=request.ready)
        principal = current_principal()  # the models its key may use (load failures name workers)
        allowed = [m for m in index.models if _may_use(principal, m.name)]
        return kserve.RepositoryIndexResponse(models=allowed)

    async def RepositoryModelLoad(
        self, request: kserve.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> kserve.RepositoryModelLoadResponse:
        """Asks every worker whose pool has the model to load all its versions (admin only);
        answers once the fleet serves them, or FAILED_PRECONDITION with the load errors."""
        control = self._repository_control("RepositoryModelLoad", request.model_name)
        if request.parameters:  # Triton's config override and model files: a load would
            # answer OK with the repository's own config in force, its caller none the wiser
            raise InvalidInput(
                f"RepositoryModelLoad parameters ({', '.join(sorted(request.parameters))}) are "
                "not supported: a model's config and files are read from the model repository; "
                "change them there, then load"
            )
        remaining_s = context.time_remaining()
        timeout_s = LOAD_WAIT_S if remaining_s is None else min(LOAD_WAIT_S, remaining_s - 0.5)
        await control.load(request.model_name, timeout_s=max(0.0, timeout_s))
        return kserve.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: kserve.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> kserve.RepositoryModelUnloadResponse:
        """Asks every worker to unload the model (admin only): its calls in flight finish;
        answers once the desired state is written: workers converge within about 1-2 s."""
        control = self._repository_control("RepositoryModelUnload", request.model_name)
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
        # A number or a label, as every other method takes it ("01", "stable").
        if request.version and catalog.version_of(config.name, request.version) not in versions:
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
            inputs=metadata(spec for spec, _ in request_inputs(config)),
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
                version = catalog.version_of(name, request.version)  # "01", "stable": "1"
                if version not in versions:
                    raise NotFound(f"model {name!r} version {request.version!r} is not served")
                versions = [version]
            stats.extend(
                statistics.message(name, v, catalog.worker_times(name, v)) for v in versions
            )
        return kserve.ModelStatisticsResponse(model_stats=stats)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[kserve.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[kserve.ModelStreamInferResponse]:
        served = self._streams.serve(
            request_iterator,
            current_principal(),
            tuple(context.invocation_metadata() or ()),
            context.time_remaining,
        )
        # Closed here when the client goes away, not whenever it is collected: its requests
        # stop at once (serve's `finally`).
        async with contextlib.aclosing(served) as responses:
            async for response in responses:
                yield response

    async def ModelInfer(
        self, request: kserve.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ModelInferResponse:
        label = self._predictor.catalog.label_for(request.model_name)
        time_left_s = context.time_remaining()
        with self._metrics.observe_request(KSERVE_API, label, time_left_s):
            return await infer_one(
                self._predictor, request, current_principal(), time_left_s, self._max_inputs
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
