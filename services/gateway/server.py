"""gRPC wiring of the gateway: both public APIs, auth, health, reflection, catalog refresh."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import grpc
from grpc_health.v1 import health

from services.common.door import Door
from services.common.door_handlers import MethodShape
from services.common.lifecycle import (
    NOT_SERVING,
    SERVING,
    add_health_and_reflection,
    new_server,
    set_serving,
    sleep_unless_stopped,
)
from services.common.model_repository import ModelConfigError, load_repository
from services.common.settings import unusable_file
from services.common.sparse_log import SparseLog
from services.common.telemetry import tier_registry
from services.common.tls import HealthListener, add_port, open_channel, start_health_listener
from services.common.tracing import Tracing
from services.gateway.admission import TenantAdmission
from services.gateway.auth import LOCAL_PRINCIPAL, Authentication, KeyStore, door_caller
from services.gateway.catalog import ModelCatalog
from services.gateway.config import GatewayConfig
from services.gateway.http.server import HttpListener, start_http
from services.gateway.jobs_api import add_job_service
from services.gateway.kserve_api import KServeServicer
from services.gateway.metrics import GatewayMetrics
from services.gateway.predictor import Predictor
from services.gateway.public_api import InferenceServicer
from services.gateway.quota_sync import QuotaSync
from services.gateway.repository_control import RepositoryControl, start_repository_control
from services.gateway.router_retry import ROUTER_CHANNEL_OPTIONS, router_target
from services.gateway.routing_sync import RoutingSync
from services.gateway.tenants import TenantLabels, TenantPolicy
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)
_sparse = SparseLog(log)

SERVICE_NAMES = (
    api.DESCRIPTOR.services_by_name["InferenceService"].full_name,
    kserve.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    "inference.v1.JobService",
)

#: The calls the door's concurrency limit counts: one model call each, answered at once.
#: Streams (ModelStreamInfer) live for many calls and generation has its own first-token
#: admission, so neither holds a place under the limit.
DOOR_METHODS = {
    "/inference.v1.InferenceService/Predict": MethodShape(),
    "/inference.GRPCInferenceService/ModelInfer": MethodShape(),
    "/inference.v1.InferenceService/Generate": MethodShape(response_streaming=True, shed_only=True),
    "/inference.GRPCInferenceService/ModelStreamInfer": MethodShape(
        response_streaming=True, shed_only=True
    ),
}


@dataclass
class Gateway:
    config: GatewayConfig
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    metrics: GatewayMetrics
    catalog: ModelCatalog
    router: grpc.aio.Channel
    predictor: Predictor
    #: Re-reads the API keys file when it changes (None without one).
    keys_watch: asyncio.Task[None] | None = None
    #: Plaintext health-only listener for probes (None unless `tls.health_port` is set).
    health_listener: HealthListener | None = None
    #: Shares tenants' fleet-wide quotas with the other gateways (None without Redis).
    quota_sync: QuotaSync | None = None
    #: KServe v2 REST and OpenAI-compatible listener (None when `http_port` is -1).
    http: HttpListener | None = None
    #: Applies runtime labels and traffic weights from Redis (None without Redis).
    routing_sync: RoutingSync | None = None
    #: Writes the fleet's desired model state (None without Redis).
    repository: RepositoryControl | None = None
    #: The concurrency limit on model calls (None when disabled).
    door: Door | None = None
    #: Models `inference_gateway_model_ready_versions` was last exported for.
    _exported_models: set[str] = field(default_factory=set)

    async def refresh_catalog(self) -> None:
        """Keeps the fleet view fresh; SERVING once the router has answered at least once."""
        list_models = self.router.unary_unary(
            "/inference.v1.WorkerService/ListModels",
            request_serializer=pb.ListWorkerModelsRequest.SerializeToString,
            response_deserializer=pb.ListWorkerModelsResponse.FromString,
        )
        is_serving = False
        while True:
            try:
                listing = await list_models(pb.ListWorkerModelsRequest(), timeout=2.0)
                self.catalog.update_served(listing.versions, listing.load_failures)
                self._export_ready_versions()
                if self.door is not None:  # models added since: the tightest SLO may change
                    self.door.follow_slo(self.catalog.tightest_slo_s())
                if not is_serving:
                    is_serving = True
                    await set_serving(self.health, SERVICE_NAMES, SERVING)
            except grpc.aio.AioRpcError as error:
                # Keep the last view: the router may be restarting; calls to it will tell.
                _sparse.warning("refresh", "catalog refresh failed: %s", error.code().name)
            await sleep_unless_stopped(self.config.catalog_refresh_s)

    def _export_ready_versions(self) -> None:
        """`inference_gateway_model_ready_versions` per model of the repository; a model gone
        from it is no longer exported (its last 0 would fire FabricModelUnserved for good), nor
        one unloaded on purpose (RepositoryModelUnload: no worker is meant to serve it)."""
        counts, gauge = self.catalog.ready_versions(), self.metrics.model_ready_versions
        if self.repository is not None:
            for model in self.repository.unloaded():
                counts.pop(model, None)
        for model in self._exported_models - counts.keys():
            gauge.remove(model)
        for model, count in counts.items():
            gauge.labels(model).set(count)
        self._exported_models = set(counts)

    async def stop(self) -> None:
        if self.door is not None:
            await self.door.stop()
        if self.keys_watch is not None:
            self.keys_watch.cancel()
        if self.routing_sync is not None:
            await self.routing_sync.stop()
        if self.repository is not None:
            await self.repository.close()
        await set_serving(self.health, SERVICE_NAMES, NOT_SERVING)
        self.predictor.draining.set()  # open streams end once their requests are answered
        # Both listeners stop taking calls at once and drain within the one grace (before,
        # gRPC took new calls until the HTTP drain, unbounded by the grace, had ended).
        stopping = [self.server.stop(grace=self.config.drain_grace_s)]
        if self.http is not None:
            stopping.append(self.http.stop())
        await asyncio.gather(*stopping)
        # Only now: its entry tells the other gateways of the calls it still drains (the
        # tenants' calls in flight); gone before the drain, they took its share back while
        # those calls ran on (review finding).
        if self.quota_sync is not None:
            await self.quota_sync.stop()
        if self.health_listener is not None:
            await self.health_listener.stop(grace=None)
        await self.predictor.close()
        await self.router.close()


@contextlib.asynccontextmanager
async def _stopped_on_failure(
    server: grpc.aio.Server, door: Door | None
) -> AsyncIterator[list[Callable[[], Awaitable[object]]]]:
    """Stops `server`, `door` (removing its probe's socket directory) and what the block
    started (the stops it adds to the list it is given) when the block fails."""
    started: list[Callable[[], Awaitable[object]]] = []
    try:
        yield started
    except BaseException:
        for stop in reversed(started):
            await stop()
        await server.stop(grace=None)
        if door is not None:
            await door.stop()
        raise


def _not_read(model: str, error: Exception) -> None:
    """A model (or a version's tokenizer) that does not read at start-up (its files still
    being copied) is left out; the repository control reads it once it does (with Redis)."""
    log.error("model %s not read; not served until it reads: %s", model, error)


def _load_keys(config: GatewayConfig) -> KeyStore | None:
    keys = None
    if config.api_keys_file:
        try:
            keys = KeyStore.from_file(config.api_keys_file)
        except (OSError, ValueError) as error:  # a reload keeps the old keys; none at start
            raise unusable_file("the API keys file", config.api_keys_file, error) from error
    if keys is None:  # GatewayConfig refuses this unless allow_unauthenticated is set
        log.warning(
            "AUTHENTICATION IS OFF (--allow-unauthenticated): every caller is tenant 'local' "
            "and may use every model; for local development only"
        )
    return keys


def _start_redis_loops(
    config: GatewayConfig,
    catalog: ModelCatalog,
    admission: TenantAdmission,
    tenants: Mapping[str, TenantPolicy],
) -> tuple[QuotaSync | None, RoutingSync | None]:
    """Fleet-wide quotas and runtime model routing, both from the gateway's Redis (none
    without one)."""
    if not config.quota_sync.redis_url:
        return None, None
    quota_sync = QuotaSync(config.quota_sync, admission, tenants)
    routing_sync = RoutingSync(
        catalog,
        redis_url=config.quota_sync.redis_url,
        password_file=config.quota_sync.redis_password_file,
        key_prefix=config.quota_sync.key_prefix,
    )
    quota_sync.start()  # both made first: a failure to make one starts neither
    routing_sync.start()
    return quota_sync, routing_sync


def _watch_keys(
    keys: KeyStore | None, admission: TenantAdmission, quota_sync: QuotaSync | None
) -> asyncio.Task[None] | None:
    """Re-reads the keys file when it changes; tenants' labels and quotas follow."""
    if keys is None:
        return None

    def on_reload(store: KeyStore) -> None:
        admission.labels.update(store.tenants)
        if quota_sync is not None:
            quota_sync.tenants = store.tenants

    return asyncio.create_task(keys.watch(on_reload=on_reload), name="api-keys")


def _add_services(
    server: grpc.aio.Server,
    config: GatewayConfig,
    predictor: Predictor,
    metrics: GatewayMetrics,
    door: Door | None,
    keys: KeyStore | None,
) -> RepositoryControl | None:
    """The public services on `server`; returns the repository control (None without Redis)."""
    api_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(predictor, metrics), server)
    repository = start_repository_control(predictor.catalog, config)
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(
        KServeServicer(
            predictor,
            metrics,
            max_inputs=config.max_inputs_per_request,
            repository=repository,
            door=door,
            keys=keys,
        ),
        server,
    )
    # Durable jobs, with Redis.
    add_job_service(server, predictor.catalog, config.quota_sync, config.max_message_bytes,
                    config.max_inputs_per_request)  # fmt: skip
    return repository


async def create_gateway(config: GatewayConfig) -> Gateway:
    keys = _load_keys(config)
    try:
        versions = load_repository(config.model_repository, on_error=_not_read)
    except ModelConfigError as error:  # the repository itself (a model's goes to _not_read)
        raise unusable_file("the model repository", config.model_repository, error) from None
    catalog = ModelCatalog(versions, on_error=_not_read)
    metrics = GatewayMetrics(tier_registry("gateway"))
    if keys is not None:
        keys.on_refused = lambda reason: metrics.unauthenticated_total.labels(reason).inc()
        metrics.keys_file_refused.set_function(lambda: int(keys.is_refused))
    router = open_channel(
        router_target(config.router_address), config.router_tls, ROUTER_CHANNEL_OPTIONS
    )
    tenants = keys.tenants if keys is not None else {LOCAL_PRINCIPAL.tenant: LOCAL_PRINCIPAL.policy}
    admission = TenantAdmission(metrics, TenantLabels(tenants))
    door = None
    if config.door.is_enabled:
        door = Door(DOOR_METHODS, config.door, metrics.registry, caller=door_caller(keys))
        door.follow_slo(catalog.tightest_slo_s())
    predictor = Predictor(
        catalog,
        router,
        metrics,
        max_inputs=config.max_inputs_per_request,
        throttle=config.throttle,
        admission=admission,
        clock=config.bundle_clock,
        pickup_delay_s=door.pickup_delay_s if door is not None else lambda: 0.0,
    )
    # Tracing outside auth: a refused call still gets its span.
    server = new_server(
        [Tracing(), Authentication(keys, admission)],
        max_message_bytes=config.max_message_bytes,
        max_concurrent_rpcs=config.max_concurrent_rpcs,
        max_pending_calls=config.max_pending_calls,
        door=door,
    )
    repository = _add_services(server, config, predictor, metrics, door, keys)
    health_servicer = await add_health_and_reflection(server, SERVICE_NAMES)
    port = add_port(server, f"{config.host}:{config.grpc_port}", config.tls)
    if door is not None:
        door.listen(server)
    # A start that fails from here stops the gRPC server and removes the probe's socket
    # directory (the process exits: the rest goes with it).
    async with _stopped_on_failure(server, door) as started:
        await server.start()
        if door is not None:
            door.start()
        health_listener = await start_health_listener(
            health_servicer, config.host, config.tls, server
        )
        if health_listener is not None:  # a port taken below leaves nothing behind
            started.append(partial(health_listener.stop, grace=None))
        http = None
        if config.http_port >= 0:
            http = await start_http(
                host=config.host,
                port=config.http_port,
                tls=config.tls,
                keys=keys,
                predictor=predictor,
                metrics=metrics,
                max_inputs=config.max_inputs_per_request,
                max_body_bytes=config.max_message_bytes,
                repository=repository,
                tei_model=config.tei_model,
                drain_grace_s=config.drain_grace_s,
                door=door,
            )
            started.append(http.stop)
        # Last: a quota entry written, then left by a start failing, would count a gateway
        # that never served in every other gateway's shares.
        quota_sync, routing_sync = _start_redis_loops(config, catalog, admission, tenants)
        keys_watch = _watch_keys(keys, admission, quota_sync)
        return Gateway(
            config,
            server,
            port,
            health_servicer,
            metrics,
            catalog,
            router,
            predictor,
            keys_watch,
            health_listener,
            quota_sync,
            http,
            routing_sync,
            repository,
            door,
        )
