"""gRPC wiring of the worker: the servicer, health, reflection and the server's lifecycle."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry

from services.common.errors import FingerprintMismatch, InvalidInput, NotFound, Unavailable
from services.common.lifecycle import SERVING, add_health_and_reflection, new_server, set_serving
from services.common.model_repository import ModelKind, load_repository
from services.common.tensors import dtype_pb, tensor_from_pb, tensor_to_pb
from services.gpu_worker.backends import load_backend
from services.gpu_worker.backends.base import Backend, RawInput, TokenIds, select_device
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.metrics import WorkerMetrics
from services.gpu_worker.registration import Registration
from services.gpu_worker.scheduler import BatchScheduler
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_KIND_PB = {
    ModelKind.EMBEDDING: pb.MODEL_KIND_EMBEDDING,
    ModelKind.TORCHSCRIPT: pb.MODEL_KIND_TORCHSCRIPT,
    ModelKind.GENERATION: pb.MODEL_KIND_GENERATION,
}


class LoadedModels:
    """Loaded backends by (model name, version)."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self._by_key = {(b.config.name, b.version.version): b for b in backends}
        self.backends = tuple(backends)

    def resolve(self, model_name: str, model_version: str) -> Backend:
        if not _NAME_RE.match(model_name):
            raise InvalidInput(f"model name {model_name!r} is not a valid model name")
        if model_version and not model_version.isdigit():
            raise InvalidInput(f"model version {model_version!r} must be a version number")
        if model_version:
            backend = self._by_key.get((model_name, str(int(model_version))))
        else:
            versions = [b for (name, _), b in self._by_key.items() if name == model_name]
            backend = max(versions, key=lambda b: int(b.version.version), default=None)
        if backend is None:
            raise NotFound(f"model {model_name!r} version {model_version or 'latest'!r} not found")
        return backend


def _raw_input(model_input: pb.ModelInput) -> RawInput:
    which = model_input.WhichOneof("payload")
    if which == "text":
        return model_input.text
    if which == "token_ids":
        if len(model_input.token_ids) % 4:
            raise InvalidInput("token_ids must be little-endian int32 (a multiple of 4 bytes)")
        return TokenIds(np.frombuffer(model_input.token_ids, dtype="<i4"))
    if which == "tensor":
        return tensor_from_pb(model_input.tensor)
    raise InvalidInput("an input has no payload (text, token_ids or tensor)")


def _version_info(backend: Backend, *, is_ready: bool) -> pb.ModelVersionInfo:
    config = backend.config

    def specs(tensors: Sequence) -> list[pb.TensorSpec]:
        return [pb.TensorSpec(name=t.name, dtype=dtype_pb(t.dtype), dims=t.dims) for t in tensors]

    return pb.ModelVersionInfo(
        model_name=config.name,
        model_version=backend.version.version,
        fingerprint=backend.fingerprint,
        kind=_KIND_PB[config.kind],
        max_batch_size=config.max_batch_size,
        slo_p99_ms=config.slo_p99_ms,
        length_buckets=list(backend.buckets) if config.kind is ModelKind.EMBEDDING else [],
        max_input_tokens=backend.max_input_tokens,
        inputs=specs(config.inputs),
        outputs=specs(config.outputs),
        is_ready=is_ready,
        tokenizer_fingerprint=backend.tokenizer_fingerprint,
    )


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """Thin: decode, resolve, prepare, submit to the scheduler, encode."""

    def __init__(self, device: str) -> None:
        self._device = device
        self._models: LoadedModels | None = None
        self._scheduler: BatchScheduler | None = None
        self._metrics: WorkerMetrics | None = None

    def attach(
        self, models: LoadedModels, scheduler: BatchScheduler, metrics: WorkerMetrics
    ) -> None:
        self._models, self._scheduler, self._metrics = models, scheduler, metrics

    async def Infer(
        self, request: pb.InferRequest, context: grpc.aio.ServicerContext
    ) -> pb.InferResponse:
        if self._models is None or self._scheduler is None or self._metrics is None:
            raise Unavailable("worker is still loading models")
        backend = self._models.resolve(request.model_name, request.model_version)
        labels = (backend.config.name, backend.version.version)
        code = grpc.StatusCode.OK
        try:
            if request.fingerprint and request.fingerprint != backend.fingerprint:
                raise FingerprintMismatch(
                    f"inputs were prepared for fingerprint {request.fingerprint}; "
                    f"{labels[0]}/{labels[1]} is {backend.fingerprint}"
                )
            if not request.inputs:
                raise InvalidInput("request has no inputs")
            if len(request.inputs) > backend.config.max_queue_size:
                raise InvalidInput(
                    f"{len(request.inputs)} inputs exceed the queue capacity of "
                    f"{backend.config.max_queue_size}; split the request"
                )
            raw = [_raw_input(i) for i in request.inputs]
            if not request.fingerprint and any(isinstance(r, TokenIds) for r in raw):
                raise InvalidInput("token_ids inputs require the tokenizer's fingerprint")
            rows = backend.prepare_many(raw)
            outputs = await self._scheduler.submit(
                backend,
                rows,
                timeout_s=context.time_remaining(),
                tenant=request.tenant or "default",
            )
            return pb.InferResponse(
                model_name=labels[0],
                model_version=labels[1],
                fingerprint=backend.fingerprint,
                outputs=[tensor_to_pb(o) for o in outputs],
            )
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as error:
            code = getattr(error, "code", grpc.StatusCode.INTERNAL)
            raise
        finally:
            self._metrics.requests_total.labels(*labels, code.name).inc()

    async def ListModels(
        self, request: pb.ListWorkerModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkerModelsResponse:
        backends = self._models.backends if self._models else ()
        ready = self._scheduler is not None
        return pb.ListWorkerModelsResponse(
            versions=[_version_info(b, is_ready=ready) for b in backends], device=self._device
        )


@dataclass
class Worker:
    """A worker process's parts. `start` binds and serves NOT_SERVING, `load` loads and warms
    up then flips to SERVING, `stop` drains."""

    config: WorkerConfig
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    servicer: WorkerServicer
    metrics: WorkerMetrics
    scheduler: BatchScheduler | None = None
    registration: Registration | None = None

    async def load(self) -> None:
        """Loads every version in the repository and warms it up, off the event loop."""
        device = select_device()

        def load_and_warm() -> tuple[list[Backend], BatchScheduler]:
            versions = load_repository(self.config.model_repository)
            backends = [load_backend(v, device) for v in versions]
            scheduler = BatchScheduler(backends, self.config.scheduler, self.metrics)
            scheduler.warm_up()
            return backends, scheduler

        backends, scheduler = await _in_daemon_thread(load_and_warm)
        self.scheduler = scheduler
        scheduler.start()
        self.servicer.attach(LoadedModels(backends), scheduler, self.metrics)
        await set_serving(self.health, (SERVICE_NAME,), SERVING)
        if self.config.redis_url:
            address = self.config.advertise_address or f"{self.config.host}:{self.port}"
            self.registration = Registration(self.config, address, backends, scheduler)
            self.registration.start()
        log.info(
            "worker ready on port %d (%s): %s",
            self.port,
            device,
            ", ".join(f"{b.config.name}/{b.version.version}@{b.fingerprint}" for b in backends),
        )

    async def stop(self) -> None:
        """Drain: NOT_SERVING at once, refuse new work, finish admitted work, then close."""
        await self.health.enter_graceful_shutdown()
        if self.registration is not None:
            self.registration.mark_draining()
        if self.scheduler is not None:
            try:
                await asyncio.wait_for(self.scheduler.drain(), self.config.drain_grace_s)
            except TimeoutError:
                log.warning("drain did not finish within %.1fs", self.config.drain_grace_s)
        if self.registration is not None:
            await self.registration.close()
        await self.server.stop(grace=1.0)


async def _in_daemon_thread(fn):  # type: ignore[no-untyped-def]
    """Runs blocking `fn` in a daemon thread: a SIGTERM during model loading must not wait for
    the load to finish before the process can exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: object, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            result = fn()
        except BaseException as error:  # delivered to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, error)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name="model-loader", daemon=True).start()
    return await future


async def create_worker(config: WorkerConfig) -> Worker:
    """Builds and starts the gRPC server (NOT_SERVING until `load` completes)."""
    server = new_server()
    servicer = WorkerServicer(device=str(select_device()))
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_servicer = await add_health_and_reflection(server, (SERVICE_NAME,))
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    await server.start()
    metrics = WorkerMetrics(CollectorRegistry())
    return Worker(
        config=config,
        server=server,
        port=port,
        health=health_servicer,
        servicer=servicer,
        metrics=metrics,
    )
