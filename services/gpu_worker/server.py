"""gRPC wiring of the worker: the servicer, health, reflection and the server's lifecycle."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry

from services.common.errors import FingerprintMismatch, InvalidInput, Unavailable
from services.common.lifecycle import SERVING, add_health_and_reflection, new_server, set_serving
from services.common.model_repository import ModelKind, load_repository
from services.common.multiplex import STREAM_METHOD, MultiplexServer
from services.common.pb_conversions import finish_reason_to_pb, model_kind_to_pb
from services.common.sampling import sampling_from_pb
from services.common.telemetry import count_outcome
from services.common.tensors import dtype_pb, tensor_from_pb, tensor_to_pb
from services.common.tracing import TracingInterceptor
from services.gpu_worker.backends.base import Backend, RawInput, TokenIds, select_device
from services.gpu_worker.batching.driver import BatchingDriver
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.loaded_models import AnyBackend, LoadedModels, load_versions
from services.gpu_worker.metrics import WorkerMetrics
from services.gpu_worker.registry_publisher import RegistryPublisher
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name


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


def _check_fingerprint(request_fingerprint: str, backend: AnyBackend) -> None:
    if request_fingerprint and request_fingerprint != backend.fingerprint:
        raise FingerprintMismatch(
            f"inputs were prepared for fingerprint {request_fingerprint}; "
            f"{backend.config.name}/{backend.version.version} is {backend.fingerprint}"
        )


def _version_info(backend: AnyBackend, *, is_ready: bool) -> pb.ModelVersionInfo:
    config = backend.config
    is_text = config.kind is ModelKind.EMBEDDING

    def specs(tensors: Sequence) -> list[pb.TensorSpec]:
        return [pb.TensorSpec(name=t.name, dtype=dtype_pb(t.dtype), dims=t.dims) for t in tensors]

    return pb.ModelVersionInfo(
        model_name=config.name,
        model_version=backend.version.version,
        fingerprint=backend.fingerprint,
        kind=model_kind_to_pb(config.kind),
        max_batch_size=config.max_batch_size,
        slo_p99_ms=config.slo_p99_ms,
        length_buckets=list(backend.buckets) if isinstance(backend, Backend) and is_text else [],
        max_input_tokens=backend.text.max_tokens
        if isinstance(backend, GenerationBackend)
        else backend.max_input_tokens,
        max_model_len=backend.max_model_len if isinstance(backend, GenerationBackend) else 0,
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
        self._batching: BatchingDriver | None = None
        self._metrics: WorkerMetrics | None = None
        self.streams = MultiplexServer(
            self.Infer,
            deserialize=pb.InferRequest.FromString,
            serialize=pb.InferResponse.SerializeToString,
        )

    def attach(
        self, models: LoadedModels, batching: BatchingDriver, metrics: WorkerMetrics
    ) -> None:
        self._models, self._batching, self._metrics = models, batching, metrics

    async def Infer(
        self, request: pb.InferRequest, context: grpc.aio.ServicerContext
    ) -> pb.InferResponse:
        if self._models is None or self._batching is None or self._metrics is None:
            raise Unavailable("worker is still loading models")
        backend = self._models.fixed_cost_backend(request.model_name, request.model_version)
        labels = (backend.config.name, backend.version.version)
        with count_outcome(self._metrics.requests_total, *labels):
            _check_fingerprint(request.fingerprint, backend)
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
            outputs = await self._batching.submit(
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

    async def InferStream(
        self,
        requests: AsyncIterator[pb.InferStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.InferStreamResponse]:
        async for message in self.streams.serve(requests, context):
            yield message

    async def Generate(
        self, request: pb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self._models is None:
            raise Unavailable("worker is still loading models")
        backend = self._models.generation_backend(request.model_name, request.model_version)
        _check_fingerprint(request.fingerprint, backend)
        which = request.WhichOneof("prompt")
        if which == "text":
            prompt = backend.encode(request.text)
        elif which == "token_ids":
            if not request.fingerprint:
                raise InvalidInput("token_ids prompts require the tokenizer's fingerprint")
            if len(request.token_ids) % 4:
                raise InvalidInput("token_ids must be little-endian int32 (a multiple of 4 bytes)")
            ids = backend.text.check_ids(np.frombuffer(request.token_ids, dtype="<i4"))
            prompt = [int(i) for i in ids]
        else:
            raise InvalidInput("request has no prompt (text or token_ids)")
        params = sampling_from_pb(request.sampling)
        remaining_s = context.time_remaining()
        limits = (remaining_s, backend.config.shed_budget_s(0.0))
        stream = backend.engine.generate(
            prompt,
            params,
            priority=request.priority,
            first_token_limit_s=min((x for x in limits if x is not None), default=None),
        )
        async for delta in stream:
            yield pb.GenerateResponse(
                token_ids=delta.token_ids,
                text=delta.text,
                finish_reason=finish_reason_to_pb(delta.finish_reason),
                prompt_tokens=delta.prompt_tokens,
                completion_tokens=delta.completion_tokens,
            )

    async def ListModels(
        self, request: pb.ListWorkerModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkerModelsResponse:
        backends = self._models.backends if self._models else ()
        ready = self._batching is not None
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
    generation_metrics: GenerationMetrics
    batching: BatchingDriver | None = None
    models: LoadedModels | None = None
    registry_publisher: RegistryPublisher | None = None

    async def load(self) -> None:
        """Loads every version in the repository and warms it up, off the event loop."""
        device = select_device()

        def load_and_warm() -> tuple[LoadedModels, BatchingDriver]:
            versions = load_repository(self.config.model_repository)
            models = LoadedModels(load_versions(versions, device, self.generation_metrics))
            batching = BatchingDriver(models.fixed_cost, self.config.batching, self.metrics)
            batching.warm_up()
            for backend in models.generation:
                backend.warm_up()
            return models, batching

        models, batching = await _in_daemon_thread(load_and_warm)
        # Everything loaded so far (weights, tokenizers, the torch runtime) lives as long as
        # the process: out of the collector's view, a full collection no longer walks it
        # while requests wait (tens of ms per collection otherwise, as latency spikes).
        gc.collect()
        gc.freeze()
        self.batching = batching
        self.models = models
        batching.start()
        for backend in models.generation:
            backend.engine.start()
        self.servicer.attach(models, batching, self.metrics)
        await set_serving(self.health, (SERVICE_NAME,), SERVING)
        if self.config.redis_url:
            address = self.config.advertise_address or f"{self.config.host}:{self.port}"
            self.registry_publisher = RegistryPublisher(self.config, address, models, batching)
            self.registry_publisher.start()
        log.info(
            "worker ready on port %d (%s): %s",
            self.port,
            device,
            ", ".join(
                f"{b.config.name}/{b.version.version}@{b.fingerprint}" for b in models.backends
            ),
        )

    async def stop(self) -> None:
        """Drain: NOT_SERVING at once, refuse new work, finish admitted work, then close."""
        await self.health.enter_graceful_shutdown()
        if self.registry_publisher is not None:
            self.registry_publisher.mark_draining()
        drains = [b.engine.drain() for b in self.models.generation] if self.models else []
        if self.batching is not None:
            drains.append(self.batching.drain())
        try:
            await asyncio.wait_for(asyncio.gather(*drains), self.config.drain_grace_s)
        except TimeoutError:
            log.warning("drain did not finish within %.1fs", self.config.drain_grace_s)
        if self.registry_publisher is not None:
            await self.registry_publisher.close()
        self.servicer.streams.close()  # answered everything admitted: end the streams too
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
    # A stream is a channel for many requests, each traced on its own: not a span itself.
    server = new_server([TracingInterceptor(untraced_methods=(STREAM_METHOD,))], is_internal=True)
    servicer = WorkerServicer(device=str(select_device()))
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_servicer = await add_health_and_reflection(server, (SERVICE_NAME,))
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    await server.start()
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    return Worker(
        generation_metrics=GenerationMetrics(registry),
        config=config,
        server=server,
        port=port,
        health=health_servicer,
        servicer=servicer,
        metrics=metrics,
    )
