"""`python -m services.gateway`: read configuration, build the gateway, serve until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from services.common.lifecycle import (
    add_listener_arguments,
    configure_logging,
    start_metrics,
    stop_event,
    write_ready_file,
)
from services.common.tracing import configure_tracing
from services.gateway.config import GatewayConfig
from services.gateway.server import create_gateway

log = logging.getLogger("services.gateway")


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="python -m services.gateway",
        description="Gateway: authenticates, validates and tokenizes, then forwards to a router.",
    )
    parser.add_argument(
        "--model-repository", type=Path, default=Path(env.get("GATEWAY_MODEL_REPOSITORY", "models"))
    )
    parser.add_argument(
        "--router-address", default=env.get("GATEWAY_ROUTER_ADDRESS", "127.0.0.1:8101")
    )
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        default=env.get("GATEWAY_API_KEYS_FILE"),
        help="TOML of hashed API keys; without it the gateway runs in local mode",
    )
    parser.add_argument("--max-inputs-per-request", type=int, default=256)
    add_listener_arguments(parser, env, env_prefix="GATEWAY", grpc_port=8001, metrics_port=8002)
    args = parser.parse_args(argv)
    return GatewayConfig(
        model_repository=args.model_repository,
        router_address=args.router_address,
        host=args.host,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        api_keys_file=Path(args.api_keys_file) if args.api_keys_file else None,
        max_inputs_per_request=args.max_inputs_per_request,
        ready_file=args.ready_file,
    )


async def serve(config: GatewayConfig) -> int:
    gateway = await create_gateway(config)
    stopping = stop_event()
    metrics_port = start_metrics(config.metrics_port, config.host, gateway.metrics.registry)
    refresh = asyncio.create_task(gateway.refresh_catalog(), name="catalog")
    log.info(
        "gateway on %s:%d, metrics on %d, router %s",
        config.host,
        gateway.port,
        metrics_port,
        config.router_address,
    )
    write_ready_file(config.ready_file, gateway.port, metrics_port)
    await stopping.wait()
    log.info("SIGTERM: stopping")
    refresh.cancel()
    await gateway.stop()
    return 0


def main() -> None:
    configure_logging()
    configure_tracing("gateway")
    raise SystemExit(asyncio.run(serve(parse_config())))


if __name__ == "__main__":
    main()
