"""gRPC wiring of the gateway: both public APIs, auth, health, reflection, catalog refresh."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from services.common.lifecycle import (
    NOT_SERVING,
    SERVING,
    add_health_and_reflection,
    new_server,
    set_serving,
)
from services.common.model_repository import load_repository
from services.common.multiplex import CHANNEL_OPTIONS
from services.common.telemetry import tier_registry
from services.common.tracing import TracingInterceptor
from services.gateway.auth import AuthInterceptor, KeyStore
from services.gateway.catalog import ModelCatalog
from services.gateway.config import GatewayConfig
from services.gateway.kserve_api import KServeServicer
from services.gateway.metrics import GatewayMetrics
from services.gateway.predictor import Predictor
from services.gateway.public_api import InferenceServicer
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    api.DESCRIPTOR.services_by_name["InferenceService"].full_name,
    kserve.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
)


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
                self.catalog.update_served(listing.versions)
                if not is_serving:
                    is_serving = True
                    await set_serving(self.health, SERVICE_NAMES, SERVING)
            except grpc.aio.AioRpcError as error:
                # Keep the last view: the router may be restarting; calls to it will tell.
                log.warning("catalog refresh failed: %s", error.code().name)
            await asyncio.sleep(self.config.catalog_refresh_s)

    async def stop(self) -> None:
        await set_serving(self.health, SERVICE_NAMES, NOT_SERVING)
        await self.server.stop(grace=self.config.drain_grace_s)
        await self.predictor.close()
        await self.router.close()


async def create_gateway(config: GatewayConfig) -> Gateway:
    keys = KeyStore.from_file(config.api_keys_file) if config.api_keys_file else None
    if keys is None:
        log.warning("no API keys configured: local mode, every caller is tenant 'local'")
    catalog = ModelCatalog(load_repository(config.model_repository))
    metrics = GatewayMetrics(tier_registry("gateway"))
    router = grpc.aio.insecure_channel(config.router_address, options=CHANNEL_OPTIONS)
    predictor = Predictor(
        catalog,
        router,
        metrics,
        max_inputs=config.max_inputs_per_request,
        throttle=config.throttle,
    )
    # Tracing outside auth: a refused call still gets its span.
    server = new_server([TracingInterceptor(), AuthInterceptor(keys)])
    api_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(predictor, metrics), server)
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(
        KServeServicer(predictor, metrics), server
    )
    health_servicer = await add_health_and_reflection(server, SERVICE_NAMES)
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    await server.start()
    return Gateway(config, server, port, health_servicer, metrics, catalog, router, predictor)
