"""`python -m services.router`: read configuration, build the router, serve until SIGTERM."""

from __future__ import annotations

import signal
import sys

# Until serve() installs its own handlers (imports and start-up take a second or two), SIGTERM
# means "exit now, cleanly": nothing has been admitted yet. Without a handler, a process that
# is PID 1 in its container would ignore it and start serving anyway.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))

import asyncio
import logging

from services.common import event_loop
from services.common.lifecycle import (
    bound_stop,
    exit_stopped,
    freeze_startup_heap,
    start_metrics,
    stop_event,
    write_ready_file,
)
from services.common.logs import configure_logging
from services.common.redis_acl import redacted_url
from services.common.tls import health_port_field
from services.common.tracing import configure_tracing
from services.router.config import RouterConfig, parse_config
from services.router.server import create_router

log = logging.getLogger("services.router")


async def serve(config: RouterConfig) -> int:
    router = await create_router(config)
    freeze_startup_heap()
    stopping = stop_event()
    metrics_port = start_metrics(config.metrics_port, config.host, router.metrics.registry)
    sync_task = asyncio.create_task(router.sync.run(), name="registry-sync")
    log.info(
        "router on %s:%d, metrics on %d, registry %s",
        config.host,
        router.port,
        metrics_port,
        redacted_url(config.redis_url),
    )
    write_ready_file(
        config.ready_file, router.port, metrics_port, **health_port_field(router.health_listener)
    )
    await stopping.wait()
    log.info(
        "SIGTERM: draining (new calls refused as not started; grace %.1f s)", config.drain_grace_s
    )
    bound_stop(config.drain_grace_s)
    await router.stop()
    log.info("drained")
    sync_task.cancel()
    exit_stopped(0)


def main() -> None:
    config = parse_config()  # a bad setting exits here (status 2), before anything starts
    configure_logging("router", config.logging)
    configure_tracing("router")
    with parse_config.startup_errors():  # a file a setting names, unusable: status 2
        raise SystemExit(event_loop.run(serve(config), config.event_loop))


if __name__ == "__main__":
    main()
