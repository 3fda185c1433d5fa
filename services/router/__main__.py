"""`python -m services.router`: read configuration, build the router, serve until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from services.common.lifecycle import (
    add_listener_arguments,
    configure_logging,
    start_metrics,
    stop_event,
    write_ready_file,
)
from services.common.tracing import configure_tracing
from services.router.config import RouterConfig
from services.router.server import create_router

log = logging.getLogger("services.router")


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="python -m services.router",
        description="Router: picks the worker that will serve each request soonest.",
    )
    parser.add_argument(
        "--redis-url", default=env.get("ROUTER_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--registry-prefix", default=env.get("FABRIC_REGISTRY_PREFIX", "fabric"))
    parser.add_argument(
        "--refresh-period-s",
        type=float,
        default=0.5,
        help="how often the worker registry is re-read from Redis",
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="attempts on other workers after one fails or vanishes",
    )
    add_listener_arguments(parser, env, env_prefix="ROUTER", grpc_port=8101, metrics_port=8102)
    args = parser.parse_args(argv)
    return RouterConfig(
        redis_url=args.redis_url,
        host=args.host,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        registry_prefix=args.registry_prefix,
        refresh_period_s=args.refresh_period_s,
        max_retries=args.max_retries,
        ready_file=args.ready_file,
    )


async def serve(config: RouterConfig) -> int:
    router = await create_router(config)
    stopping = stop_event()
    metrics_port = start_metrics(config.metrics_port, config.host, router.metrics.registry)
    sync_task = asyncio.create_task(router.sync.run(), name="registry-sync")
    log.info(
        "router on %s:%d, metrics on %d, registry %s",
        config.host,
        router.port,
        metrics_port,
        config.redis_url,
    )
    write_ready_file(config.ready_file, router.port, metrics_port)
    await stopping.wait()
    log.info("SIGTERM: stopping")
    await router.stop()
    sync_task.cancel()
    return 0


def main() -> None:
    configure_logging()
    configure_tracing("router")
    raise SystemExit(asyncio.run(serve(parse_config())))


if __name__ == "__main__":
    main()
