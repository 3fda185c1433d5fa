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
from services.gateway.throttle import ThrottleConfig

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
    parser.add_argument(
        "--throttle-accepts-multiplier",
        type=float,
        default=float(env.get("GATEWAY_THROTTLE_ACCEPTS_MULTIPLIER", 1.5)),
        help="adaptive throttling: requests sent per request downstream accepted before the "
        "gateway refuses locally (SRE book's K; 0 disables) (env "
        "GATEWAY_THROTTLE_ACCEPTS_MULTIPLIER, default %(default)s)",
    )
    parser.add_argument(
        "--throttle-memory-s",
        type=float,
        default=float(env.get("GATEWAY_THROTTLE_MEMORY_S", 0.25)),
        help="adaptive throttling: time constant of its decaying counts, seconds (env "
        "GATEWAY_THROTTLE_MEMORY_S, default %(default)s)",
    )
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
        throttle=ThrottleConfig(
            accepts_multiplier=args.throttle_accepts_multiplier,
            memory_s=args.throttle_memory_s,
        ),
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
