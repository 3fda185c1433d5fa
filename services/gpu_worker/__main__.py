"""`python -m services.gpu_worker`: read configuration, build the worker, serve until SIGTERM."""

from __future__ import annotations

import signal
import sys

# Until serve() installs its own handlers (importing torch and the model code takes seconds),
# SIGTERM means "exit now, cleanly": nothing has been admitted yet.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))

import asyncio
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from services.common import event_loop
from services.common.group_metrics import GroupMetrics, RegistryCollector
from services.common.lifecycle import (
    bound_stop,
    exit_stopped,
    start_metrics,
    stop_event,
    write_ready_file,
)
from services.common.logs import configure_logging
from services.common.settings import StartupError
from services.common.tls import health_port_field
from services.common.tracing import configure_tracing
from services.gpu_worker.config import WorkerConfig, parse_config
from services.gpu_worker.engine_link import EngineLink
from services.gpu_worker.front import ENGINE_LINK_SOCKET
from services.gpu_worker.fronts import FRONT_LABEL, Fronts
from services.gpu_worker.server import create_worker

log = logging.getLogger("services.gpu_worker")


async def serve(config: WorkerConfig) -> int:
    if not config.front_processes:
        return await _serve(config, None)
    engine_dir = Path(tempfile.mkdtemp(prefix="worker-engine-"))
    try:
        return await _serve(config, engine_dir)
    finally:
        _remove(engine_dir)


async def _serve(config: WorkerConfig, engine_dir: Path | None) -> int:
    worker = await create_worker(config, engine_dir)
    fronts: Fronts | None = None
    link: EngineLink | None = None
    served_metrics: CollectorRegistry = worker.metrics.registry
    if engine_dir is not None:
        fronts = Fronts(config, sys.argv[1:], engine_dir, worker.metrics.registry)
        fronts.on_none_listening = worker.on_fatal
        worker.port = fronts.reserve_ports()
        link = EngineLink(
            worker.servicer.streams, engine_dir / ENGINE_LINK_SOCKET, config.max_message_bytes
        )
        await link.start()
        fronts.start()  # they serve NOT_SERVING, as the engine does, until it has loaded
        served_metrics = GroupMetrics(fronts, FRONT_LABEL)
        served_metrics.register(RegistryCollector(worker.metrics.registry))
    stopping = stop_event()
    try:
        metrics_port = start_metrics(config.metrics_port, config.host, served_metrics)
    except StartupError:  # its port taken: exits 2 (startup_errors), its listeners stopped
        await worker.server.stop(grace=None)
        await _stop_fronts(fronts, link)
        raise
    log.info(
        "worker listening on %s:%d, metrics on %d; loading models from %s",
        config.host,
        worker.port,
        metrics_port,
        config.model_repository,
    )
    # With fronts, the worker turns SERVING (and joins the registry) once they listen.
    loading = asyncio.create_task(
        worker.load(before_serving=fronts.wait_ready if fronts is not None else None)
    )
    stop_wait = asyncio.create_task(stopping.wait())
    await asyncio.wait({loading, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        log.error("the worker failed to start: %s", loading.exception())
        await worker.server.stop(grace=None)
        await _stop_fronts(fronts, link)
        return 1
    if not loading.done():
        # Stopped while loading: nothing was admitted, so there is nothing to drain. Exit now
        # rather than wait for the loader thread, which may be inside torch for a while (and
        # tearing the interpreter down under it aborts the process).
        log.info("SIGTERM while loading models: exiting")
        await worker.server.stop(grace=None)
        logging.shutdown()
        _remove(engine_dir)
        os._exit(0)
    if fronts is not None and not stopping.is_set():
        serving = asyncio.create_task(fronts.wait_serving(lambda: worker.fatal_error is not None))
        await asyncio.wait({serving, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        serving.cancel()
        if serving.done() and not serving.cancelled() and not serving.result():
            if worker.fatal_error is None:
                log.warning("not every front saw the engine SERVING in time; reporting ready")
            else:  # logged where it failed; health says NOT_SERVING
                log.warning("the engine failed while its fronts came up; reporting ready")
    if not stopping.is_set():
        # With fronts, they serve the health port (the engine has no listener of its own).
        health = worker.health_listener if fronts is None else fronts.health_port
        write_ready_file(config.ready_file, worker.port, metrics_port, **health_port_field(health))
        await stopping.wait()
    log.info("SIGTERM: draining")
    bound_stop(config.drain_grace_s)
    stop_started_s = time.monotonic()
    loading.cancel()
    if fronts is not None:  # a front that exits now (a signal to the whole group) stays down
        fronts.stop_watching()
    # A worker that stopped serving on a fault (a serving loop died, a model call past the
    # watchdog: on_fatal) exits 1 however cleanly it drains, so that its pod's or stack's
    # record shows the failure (its liveness probe had it stopped); 0 is an ordinary stop.
    status = 0 if worker.fatal_error is None else 1
    try:
        await worker.stop()
    except Exception:  # its drain failed (it deregistered all the same): the fronts still stop
        log.exception("the worker's stop failed")
        status = 1
    # The link's streams were told `closing` by worker.stop.
    await _stop_fronts(fronts, link, stop_started_s)
    log.info("worker stopped")
    _remove(engine_dir)
    exit_stopped(status)


async def _stop_fronts(
    fronts: Fronts | None, link: EngineLink | None, stop_started_s: float | None = None
) -> None:
    """Ends the link's streams, then stops the fronts (within the engine's stop bound, from
    `stop_started_s` on the monotonic clock: None, not bounded by one)."""
    if link is not None:
        await link.close()
    if fronts is not None:
        elapsed_s = 0.0 if stop_started_s is None else time.monotonic() - stop_started_s
        await fronts.stop(elapsed_s)


def _remove(engine_dir: Path | None) -> None:
    """The engine's sockets and its fronts' ready files (exit_stopped skips `finally`)."""
    if engine_dir is not None:
        shutil.rmtree(engine_dir, ignore_errors=True)


def main() -> None:
    config = parse_config()  # a bad setting exits here (status 2), before anything starts
    configure_logging("gpu_worker", config.logging)
    configure_tracing("gpu_worker")
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    with parse_config.startup_errors():  # a port a setting names, unusable: status 2
        raise SystemExit(event_loop.run(serve(config), config.event_loop))


if __name__ == "__main__":
    main()
