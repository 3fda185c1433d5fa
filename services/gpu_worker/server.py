"""gRPC wiring of the worker: the servicer, health, reflection and the server's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health

from services.common.errors import InvalidInput, Unavailable
from services.common.lifecycle import (
    NOT_SERVING,
    SERVING,
    add_health_and_reflection,
    cancel_and_wait,
    drain_within,
    freeze_startup_heap,
    new_server,
    set_serving,
)
from services.common.model_repository import select_models
from services.common.multiplex import STREAM_METHOD
from services.common.multiplex_server import MultiplexServer
from services.common.repository_state import DesiredState
from services.common.sampling import sampling_from_pb
from services.common.telemetry import Outcome, tier_registry
from services.common.tensors import tensor_to_pb
from services.common.text import TokenIds
from services.common.tls import HealthListener, add_port, start_health_listener
from services.common.tracing import Tracing
from services.gpu_worker.backends.base import check_device, select_device
from services.gpu_worker.batching.driver import BatchingDriver
from services.gpu_worker.bundles import BundleRunner, given_up, request_priority
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.execution import resolve_threads
from services.gpu_worker.front import engine_grpc_target
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.generation.request_stream import delta_to_pb
from services.gpu_worker.hot_swap import ModelSwapper, in_daemon_thread
from services.gpu_worker.load_options import LoadOptions
from services.gpu_worker.loaded_models import LoadedModels, load_versions
from services.gpu_worker.metrics import WorkerMetrics
from services.gpu_worker.reconcile import is_wanted
from services.gpu_worker.registry_publisher import RegistryPublisher
from services.gpu_worker.repository_follower import (
    RepositoryFollower,
    desired_at_start,
    read_pool_at_start,
)
from services.gpu_worker.wire import generation_prompt, generation_weight, raw_input, version_info
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: The batching loop's drain task, by name (a stop that overran names it).
BATCHING_DRAIN = "drain batching"

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """Thin: decode, resolve, prepare, submit to the scheduler, encode."""

    def __init__(self, device: str) -> None:
        self._device = device
        self._models: LoadedModels | None = None
        self._batching: BatchingDriver | None = None
        self._metrics: WorkerMetrics | None = None
        self._bundles: BundleRunner | None = None
        self.streams = MultiplexServer(
            self.Infer,
            deserialize=pb.InferRequest.FromString,
            serialize=pb.InferResponse.SerializeToString,
        )

    def attach(
        self, models: LoadedModels, batching: BatchingDriver, metrics: WorkerMetrics
    ) -> None:
        self._models, self._batching, self._metrics = models, batching, metrics
        self._bundles = BundleRunner(batching, metrics)

    async def Infer(
        self, request: pb.InferRequest, context: grpc.aio.ServicerContext
    ) -> pb.InferResponse:
        if self._models is None or self._batching is None or self._metrics is None:
            raise Unavailable("worker is still loading models")
        backend = self._models.fixed_cost_backend(request.model_name, request.model_version)
        if request.slices and self._bundles is not None:
            cancels = getattr(context, "slice_cancels", None)  # on an InferStream
            return await self._bundles.infer(backend, request, context.time_remaining(), cancels)
        labels = (backend.config.name, backend.version.version)
        time_left_s, called_s = context.time_remaining(), time.monotonic()
        with Outcome(
            self._metrics.requests_total_of,
            labels,
            given_up=lambda: given_up(time_left_s, called_s),
        ):
            backend.check_fingerprint(request.fingerprint)
            if not request.inputs:
                raise InvalidInput("request has no inputs")
            if len(request.inputs) > backend.config.max_queue_size:
                raise InvalidInput(
                    f"{len(request.inputs)} inputs exceed the queue capacity of "
                    f"{backend.config.max_queue_size}; split the request"
                )
            raw = [raw_input(i) for i in request.inputs]
            if not request.fingerprint and any(isinstance(r, TokenIds) for r in raw):
                raise InvalidInput("token_ids inputs require the tokenizer's fingerprint")
            rows = backend.prepare_many(raw)
            if request.unnormalized:
                rows = [dataclasses.replace(row, is_normalized=False) for row in rows]
            outputs = await self._batching.submit(
                backend,
                rows,
                timeout_s=context.time_remaining(),
                tenant=request.tenant or "default",
                priority=request_priority(request.priority),
                weight=request.tenant_weight,
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
        backend.check_fingerprint(request.fingerprint)
        prompt = generation_prompt(backend, request)
        params = sampling_from_pb(request.sampling)
        if request.fills_context and not request.sampling.max_tokens:  # the context left
            params = dataclasses.replace(params, max_tokens=backend.scheduler.room_for(len(prompt)))
        limits = (context.time_remaining(), backend.config.shed_budget_s(0.0))
        stream = backend.engine.generate(
            prompt,
            params,
            priority=request_priority(request.priority).rank,
            first_token_limit_s=min((x for x in limits if x is not None), default=None),
            tenant=request.tenant or "default",
            weight=generation_weight(request.tenant_weight),
        )
        # Closed with this stream (its caller gone): the sequence and its blocks go now.
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta_to_pb(delta)

    async def ListModels(
        self, request: pb.ListWorkerModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkerModelsResponse:
        models = self._models.all if self._models else ()
        ready = self._batching is not None
        return pb.ListWorkerModelsResponse(
            versions=[version_info(m, is_ready=ready) for m in models], device=self._device
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
    #: Plaintext health-only listener for probes (None unless `tls.health_port` is set).
    health_listener: HealthListener | None = None
    #: Set once a serving loop died: the worker no longer serves (see `on_fatal`).
    fatal_error: Exception | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: Follows the desired model state (with `redis_url`); stopped first when draining.
    _follower: asyncio.Task[None] | None = None

    async def load(self, before_serving: Callable[[], Awaitable[None]] | None = None) -> None:
        """Loads every version of the worker's models (all in the repository without
        `--models`) and warms them up, off the event loop; then awaits `before_serving` (a
        worker's fronts listening), turns SERVING and joins the registry."""
        device = select_device()
        desired = await desired_at_start(self.config)  # what the fleet unloaded stays unloaded

        def load_and_warm() -> tuple[LoadedModels, BatchingDriver, LoadOptions]:
            repository = read_pool_at_start(self.config.model_repository, self.config.models)
            pool = select_models(repository, self.config.models)
            versions = [v for v in pool if is_wanted(v.config.name, desired or {}, pool=())]
            driver_config = resolve_threads(self.config.batching, device)
            # Generation engines choose their threads up to the count resolved now, for
            # versions loaded while serving too (not the count torch gives their thread then).
            threads = driver_config.model_threads
            options = dataclasses.replace(self.config.load_options, host_threads=threads)
            models = load_versions(versions, device, self.generation_metrics, options)
            batching = BatchingDriver(models.fixed_cost, driver_config, self.metrics)
            num_failed = 0
            for backend, error in batching.warm_up():
                models.fail_warm_up(backend, error)
                num_failed += 1
            for generation in models.generation:
                try:
                    generation.warm_up()
                except Exception as error:  # left out, as in a hot load (hot_swap)
                    models.fail_warm_up(generation, error)
                    generation.discard()
                    num_failed += 1
            if num_failed:  # the device's fault, not the versions'? then the start fails
                check_device(device)
            models.check_every_model_served()
            return models, batching, options

        models, batching, options = await in_daemon_thread(load_and_warm)
        for failure in models.failed:  # logged by load_versions; served without them
            self.metrics.model_load_failures_total.labels(failure.model, failure.version).inc()
        freeze_startup_heap()
        self.batching = batching
        self.models = models
        batching.start(on_fatal=self.on_fatal)
        for backend in models.generation:
            # The same watchdog as the batching driver's model calls bounds each step.
            backend.engine.start(on_fatal=self.on_fatal, watchdog_s=self.config.batching.watchdog_s)
        self.servicer.attach(models, batching, self.metrics)
        if before_serving is not None:
            await before_serving()
            if self.fatal_error is not None:  # failed meanwhile: it must not turn SERVING
                raise RuntimeError(f"the worker failed while starting: {self.fatal_error}")
        await set_serving(self.health, (SERVICE_NAME,), SERVING)
        if self.config.redis_url:
            address = self.config.advertise_address or f"{self.config.host}:{self.port}"
            self.registry_publisher = RegistryPublisher(self.config, address, models, batching)
            self.registry_publisher.start()
            self._follow_desired_state(models, batching, device, options, desired)
        log.info(
            "worker ready on port %d (%s): %s",
            self.port,
            device,
            ", ".join(f"{m.config.name}/{m.version.version}@{m.fingerprint}" for m in models.all),
        )

    def _follow_desired_state(
        self,
        models: LoadedModels,
        batching: BatchingDriver,
        device: torch.device,
        options: LoadOptions,
        start_state: Mapping[str, DesiredState] | None,
    ) -> None:
        """Starts loading and unloading versions (as `options` say) as the fleet's desired
        state says (`start_state`: what the start-up load followed)."""
        assert self.registry_publisher is not None
        publisher = self.registry_publisher
        swapper = ModelSwapper(
            models=models,
            batching=batching,
            device=device,
            worker_metrics=self.metrics,
            generation_metrics=self.generation_metrics,
            on_fatal=self.on_fatal,
            on_change=publisher.publish_soon,
            watchdog_s=self.config.batching.watchdog_s,
            options=options,
        )
        follower = RepositoryFollower(
            client=publisher.client,
            registry_prefix=self.config.registry_prefix,
            repository_dir=self.config.model_repository,
            pool=self.config.models,
            models=models,
            swapper=swapper,
            start_state=start_state,
            on_applied=publisher.publish_soon,
        )
        self._follower = asyncio.get_running_loop().create_task(follower.run(), name="follower")

    def on_fatal(self, error: Exception) -> None:
        """A serving loop died, or a model call ran past the executor watchdog (its requests
        already failed UNAVAILABLE): stop taking traffic.
        Health turns NOT_SERVING, overall too, so readiness fails at once and the liveness probe
        has the process replaced (a loop that died on a bug is not restarted in place: its
        state is suspect); the registry entry says draining, so routers stop choosing it."""
        self.fatal_error = error
        if self.registry_publisher is not None:
            self.registry_publisher.mark_draining()
        task = asyncio.get_running_loop().create_task(
            set_serving(self.health, (SERVICE_NAME,), NOT_SERVING)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Drain: NOT_SERVING at once and the registry entry marked draining; new work still
        taken for `drain_announce_s` while routers read the mark, then refused; admitted work
        finished; then close."""
        await self.health.enter_graceful_shutdown()
        # Died on a bug, it is logged: the drain below must still run.
        await cancel_and_wait(self._follower, "the model repository follower")
        grace_s = self.config.drain_grace_s
        if self.registry_publisher is not None:
            self.registry_publisher.mark_draining()
            announce_s = min(self.config.heartbeat.drain_announce_s, grace_s / 2)
            await asyncio.sleep(announce_s)  # refused now, calls routed meanwhile were retried
            grace_s -= announce_s
        generation = (*self.models.generation, *self.models.unloading) if self.models else ()
        loop = asyncio.get_running_loop()
        drains = [
            loop.create_task(b.engine.drain(), name=f"drain {b.config.name} {b.version.version}")
            for b in generation
        ]
        if self.batching is not None:
            drains.append(loop.create_task(self.batching.drain(), name=BATCHING_DRAIN))
        try:
            await drain_within(drains, grace_s, self._drain_state)
        finally:
            # Whatever the drain did, leave the registry and close (a stale entry draws calls)
            await self._close()

    def _drain_state(self, drain: str) -> str:
        if drain != BATCHING_DRAIN or self.batching is None:
            return ""
        executing = "a batch executing" if self.batching.is_executing else "none executing"
        return f" ({self.batching.num_in_flight} rows unanswered, {executing})"

    async def _close(self) -> None:
        if self.registry_publisher is not None:
            await self.registry_publisher.close()
        # Answered everything admitted: the streams end too, as routers half-close them.
        self.servicer.streams.close()
        await self.server.stop(grace=1.0)
        if self.health_listener is not None:
            await self.health_listener.stop(grace=None)


async def create_worker(config: WorkerConfig, engine_dir: Path | None = None) -> Worker:
    """Builds and starts the gRPC server (NOT_SERVING until `load` completes). With
    `engine_dir` (a worker with fronts: services.gpu_worker.fronts) it serves only on the
    engine's Unix socket there, and its fronts serve the worker's port (`Worker.port` is 0
    until the caller sets it)."""
    # A stream is a channel for many requests, each traced on its own: not a span itself.
    server = new_server(
        [Tracing(untraced_methods=(STREAM_METHOD,))],
        is_internal=True,
        max_message_bytes=config.max_message_bytes,
        # Behind fronts, each front holds its callers to the limit: the engine takes all they
        # pass on, and their health polls, which a full engine would refuse (NOT_SERVING).
        max_concurrent_rpcs=0 if engine_dir is not None else config.max_concurrent_rpcs,
    )
    servicer = WorkerServicer(device=str(select_device()))
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_servicer = await add_health_and_reflection(server, (SERVICE_NAME,))
    if engine_dir is None:
        port = add_port(server, f"{config.host}:{config.grpc_port}", config.tls)
    else:
        server.add_insecure_port(engine_grpc_target(engine_dir))
        port = 0
    await server.start()
    health_listener = None
    if engine_dir is None:  # else the fronts serve the health port
        listening = start_health_listener(health_servicer, config.host, config.tls, server)
        health_listener = await listening
    registry = tier_registry("worker")
    metrics = WorkerMetrics(registry)
    return Worker(
        generation_metrics=GenerationMetrics(
            registry,
            watchdog_expired_total=metrics.watchdog_expired_total,
            charge_tenant=metrics.charge_tenant,
            device_busy_seconds_total=metrics.device_busy_seconds_total,
        ),
        config=config,
        server=server,
        port=port,
        health=health_servicer,
        servicer=servicer,
        metrics=metrics,
        health_listener=health_listener,
    )
