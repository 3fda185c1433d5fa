"""gRPC wiring of the router: forwarding, the fleet catalog, health, reflection."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health

from services.common.lifecycle import (
    NOT_SERVING,
    SERVING,
    add_health_and_reflection,
    new_server,
    set_serving,
)
from services.common.multiplex import STREAM_METHOD
from services.common.multiplex_server import MultiplexServer
from services.common.redis_acl import ROUTER, role_credentials
from services.common.registry_schema import RegistryKeys, connect
from services.common.telemetry import tier_registry
from services.common.tls import HealthListener, add_port, start_health_listener
from services.common.tracing import Tracing
from services.pb.inference.v1 import worker_pb2 as pb
from services.router.catalog import Catalog
from services.router.config import RouterConfig
from services.router.drain import DrainGate
from services.router.forwarder import Forwarder
from services.router.metrics import RouterMetrics
from services.router.registry_reader import RegistrySync
from services.router.routing import RetryBudget, RouteTable

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
#: Health service name that reports NOT_SERVING while Redis is unreachable. The overall ("")
#: status stays SERVING then: routing continues from the last snapshot, and a liveness probe
#: must not restart routers because Redis is down.
REGISTRY_HEALTH_NAME = "fabric.registry"


@dataclass
class Router:
    config: RouterConfig
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    metrics: RouterMetrics
    sync: RegistrySync
    forwarder: Forwarder
    streams: MultiplexServer
    #: Plaintext health-only listener for probes (None unless `tls.health_port` is set).
    health_listener: HealthListener | None = None
    #: Refuses new calls once draining (replaced by create_router with the handlers' gate).
    drain: DrainGate = field(default_factory=DrainGate)

    async def stop(self) -> None:
        """Drains: calls already running finish (within `drain_grace_s`); every later one is
        refused UNAVAILABLE marked not started, which gateways resend to another router."""
        # First, so that the GOAWAY it sends reaches gateways as the refusals below start: a
        # gateway resending a refused call opens its next stream on another router, not on
        # this one again (its channel still took this router as ready a moment later).
        stopping = asyncio.create_task(self.server.stop(grace=self.config.drain_grace_s))
        await asyncio.sleep(0)
        self.drain.start()
        self.streams.close()  # gateways' streams end once their calls are answered and
        # the gateway, told, half-closes (MultiplexServer)
        await set_serving(self.health, (SERVICE_NAME,), NOT_SERVING)
        await stopping
        if self.health_listener is not None:
            await self.health_listener.stop(grace=None)
        await self.forwarder.close()


async def create_router(config: RouterConfig) -> Router:
    """Builds and starts the router; the registry sync task is the caller's to run."""
    metrics = RouterMetrics(tier_registry("router"))
    table = RouteTable(config.routing, random.Random())
    forwarder = Forwarder(
        table,
        RetryBudget(),
        metrics,
        default_timeout_s=config.default_timeout_s,
        max_retries=config.max_retries,
        tls=config.worker_tls,
    )
    catalog = Catalog(table)
    # ListModels is the gateways' catalog poll, not a request, and a stream is a channel for
    # many requests, each traced on its own: both left out of traces.
    untraced = (f"/{SERVICE_NAME}/ListModels", STREAM_METHOD)
    server = new_server(
        [Tracing(untraced_methods=untraced)],
        is_internal=True,
        max_message_bytes=config.max_message_bytes,
        max_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    drain = DrainGate()
    streams = add_worker_service(server, forwarder, catalog, drain)
    health_servicer = await add_health_and_reflection(
        server, (SERVICE_NAME, REGISTRY_HEALTH_NAME), status=SERVING
    )
    on_degraded_change = await ready_after_first_read(health_servicer, drain)
    credentials = role_credentials(ROUTER, config.redis_url, config.redis_password_file)
    sync = RegistrySync(
        connect(config.redis_url, credentials=credentials),
        RegistryKeys(config.registry_prefix),
        table,
        metrics,
        period_s=config.refresh_period_s,
        worker_networks=config.worker_networks,
        on_degraded_change=on_degraded_change,
        on_refresh=forwarder.links.prune,
    )
    port = add_port(server, f"{config.host}:{config.grpc_port}", config.tls)
    await server.start()
    health_listener = await start_health_listener(health_servicer, config.host, config.tls, server)
    return Router(
        config,
        server,
        port,
        health_servicer,
        metrics,
        sync,
        forwarder,
        streams,
        health_listener,
        drain=drain,
    )


def add_worker_service(
    server: grpc.aio.Server, forwarder: Forwarder, catalog: Catalog, drain: DrainGate
) -> MultiplexServer:
    """Registers WorkerService (calls forwarded, refused once `drain` starts); returns the
    InferStream server, which Router.stop closes."""
    infer = drain.guard_unary(forwarder.infer)
    # Bodies stay bytes here too: each call is forwarded as it arrived.
    streams = MultiplexServer(infer, deserialize=bytes, serialize=bytes)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE_NAME,
                {
                    # No (de)serializers: the body is forwarded as the bytes it arrived as.
                    "Infer": grpc.unary_unary_rpc_method_handler(infer),
                    "InferStream": grpc.stream_stream_rpc_method_handler(
                        streams.serve,
                        request_deserializer=pb.InferStreamRequest.FromString,
                        response_serializer=pb.InferStreamResponse.SerializeToString,
                    ),
                    "Generate": grpc.unary_stream_rpc_method_handler(
                        drain.guard_stream(forwarder.generate)
                    ),
                    "ListModels": grpc.unary_unary_rpc_method_handler(
                        catalog.list_models,
                        request_deserializer=pb.ListWorkerModelsRequest.FromString,
                        response_serializer=pb.ListWorkerModelsResponse.SerializeToString,
                    ),
                },
            ),
        )
    )
    return streams


async def ready_after_first_read(
    health_servicer: health.aio.HealthServicer, drain: DrainGate
) -> Callable[[bool], Awaitable[None]]:
    """Turns the router NOT_SERVING until its first registry read; returns the registry
    sync's `on_degraded_change`.

    Not ready before the first read: an empty route table would refuse every call. Overall
    ("", liveness) stays SERVING; the registry's own name is NOT_SERVING until that read too
    (a router started while Redis is down has no registry), and after it, Redis outages flip
    only the registry name, as routing goes on from the last snapshot. A router draining
    (`drain`) before its first read stays NOT_SERVING: its health listener still answers
    probes through the drain, and a first read then turned it ready (router review)."""
    await health_servicer.set(SERVICE_NAME, NOT_SERVING)
    await health_servicer.set(REGISTRY_HEALTH_NAME, NOT_SERVING)
    has_read = False

    async def on_degraded_change(is_degraded: bool) -> None:
        nonlocal has_read
        await health_servicer.set(REGISTRY_HEALTH_NAME, NOT_SERVING if is_degraded else SERVING)
        if not is_degraded and not has_read:
            has_read = True
            if not drain.is_draining:
                await health_servicer.set(SERVICE_NAME, SERVING)

    return on_degraded_change
