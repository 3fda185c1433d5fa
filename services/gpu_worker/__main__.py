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

import torch

from services.common.lifecycle import (
    bound_stop,
    exit_stopped,
    start_metrics,
    stop_event,
    write_ready_file,
)
from services.common.logs import configure_logging
from services.common.tracing import configure_tracing
from services.gpu_worker.config import WorkerConfig, parse_config
from services.gpu_worker.server import create_worker

log = logging.getLogger("services.gpu_worker")


async def serve(config: WorkerConfig) -> int:
    worker = await create_worker(config)
    stopping = stop_event()
    metrics_port = start_metrics(config.metrics_port, config.host, worker.metrics.registry)
    log.info(
        "worker listening on %s:%d, metrics on %d; loading models from %s",
        config.host,
        worker.port,
        metrics_port,
        config.model_repository,
    )
    loading = asyncio.create_task(worker.load())
    stop_wait = asyncio.create_task(stopping.wait())
    await asyncio.wait({loading, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        log.error("model loading failed: %s", loading.exception())
        await worker.server.stop(grace=None)
        return 1
    if not loading.done():
        # Stopped while loading: nothing was admitted, so there is nothing to drain. Exit now
        # rather than wait for the loader thread, which may be inside torch for a while (and
        # tearing the interpreter down under it aborts the process).
        log.info("SIGTERM while loading models: exiting")
        await worker.server.stop(grace=None)
        logging.shutdown()
        os._exit(0)
    if not stopping.is_set():
        write_ready_file(config.ready_file, worker.port, metrics_port)
        await stopping.wait()
    log.info("SIGTERM: draining")
    bound_stop(config.drain_grace_s)
    loading.cancel()
    await worker.stop()
    log.info("worker stopped")
    exit_stopped(0)


def main() -> None:
    config = parse_config()  # a bad setting exits here (status 2), before anything starts
    configure_logging("gpu_worker", config.logging)
    configure_tracing("gpu_worker")
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    raise SystemExit(asyncio.run(serve(config)))


if __name__ == "__main__":
    main()
