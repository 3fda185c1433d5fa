"""`python -m services.gateway`: read configuration, build the gateway, serve until SIGTERM."""

from __future__ import annotations

import signal
import sys

# Until serve() installs its own handlers (imports and start-up take a second or two), SIGTERM
# means "exit now, cleanly": nothing has been admitted yet. Without a handler, a process that
# is PID 1 in its container would ignore it and start serving anyway.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))

import asyncio
import logging
import os

from services.common import event_loop
from services.common.beats import beat, beat_file
from services.common.lifecycle import (
    bound_stop,
    exit_stopped,
    freeze_startup_heap,
    start_metrics,
    stop_event,
    write_ready_file,
)
from services.common.logs import configure_logging
from services.common.procfs import usable_cpus
from services.common.tls import health_port_field
from services.common.tracing import configure_tracing
from services.gateway.config import GatewayConfig, parse_config
from services.gateway.process_group import ProcessGroup
from services.gateway.server import create_gateway

log = logging.getLogger("services.gateway")


async def serve(config: GatewayConfig) -> int:
    gateway = await create_gateway(config)
    freeze_startup_heap()
    stopping = stop_event()
    metrics_port = start_metrics(config.metrics_port, config.host, gateway.metrics.registry)
    refresh = asyncio.create_task(gateway.refresh_catalog(), name="catalog")
    http_port = gateway.http.port if gateway.http is not None else -1
    log.info(
        "gateway on %s:%d, HTTP on %d, metrics on %d, router %s",
        config.host,
        gateway.port,
        http_port,
        metrics_port,
        config.router_address,
    )
    write_ready_file(
        config.ready_file, gateway.port, metrics_port, http_port=http_port,
        **health_port_field(gateway.health_listener),
    )  # fmt: skip
    # Beats to whoever supervises it: a gateway group kills one whose loop hangs.
    beating = None if config.ready_file is None else asyncio.create_task(
        beat(beat_file(config.ready_file)), name="beat"
    )  # fmt: skip
    await stopping.wait()
    log.info("SIGTERM: stopping")
    bound_stop(config.drain_grace_s)
    refresh.cancel()
    await gateway.stop()
    log.info("gateway stopped")
    if beating is not None:  # beat through the stop: a gateway draining is not hung
        beating.cancel()
    exit_stopped(0)


def main() -> None:
    config = parse_config()  # a bad setting exits here (status 2), before anything starts
    configure_logging("gateway", config.logging)
    # Tokenize on the event loop's thread: a bundle's few texts gain nothing from the Rust
    # tokenizer's thread pool, whose threads spin on cores that other gateway processes and
    # tiers need (with it, 64 callers of the stand-in stack ran 20% slower on 2 cores).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    num_processes = config.processes or usable_cpus()
    with parse_config.startup_errors():  # a file or port a setting names, unusable: status 2
        if num_processes > 1:
            # A supervisor of `num_processes` gateways on the same ports; it serves no calls.
            raise SystemExit(ProcessGroup(config, sys.argv[1:], num_processes).run())
        configure_tracing("gateway")
        raise SystemExit(event_loop.run(serve(config), config.event_loop))


if __name__ == "__main__":
    main()
