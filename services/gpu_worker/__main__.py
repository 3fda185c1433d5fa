"""`python -m services.gpu_worker`: read configuration, build the worker, serve until SIGTERM."""

from __future__ import annotations

import signal
import sys

# Until serve() installs its own handlers (importing torch and the model code takes seconds),
# SIGTERM means "exit now, cleanly": nothing has been admitted yet.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))

import argparse
import asyncio
import logging
import os
import socket
from pathlib import Path

import torch

from services.common.lifecycle import (
    add_listener_arguments,
    configure_logging,
    start_metrics,
    stop_event,
    write_ready_file,
)
from services.common.tracing import configure_tracing
from services.gpu_worker.batching.driver import DriverConfig
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.server import create_worker

log = logging.getLogger("services.gpu_worker")


def parse_config(argv: list[str] | None = None) -> WorkerConfig:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="python -m services.gpu_worker",
        description="GPU worker: serves the models of a model repository with dynamic batching.",
    )
    parser.add_argument(
        "--model-repository",
        type=Path,
        default=Path(env.get("WORKER_MODEL_REPOSITORY", "models")),
        help="model repository directory (env WORKER_MODEL_REPOSITORY)",
    )
    parser.add_argument(
        "--drain-grace-s", type=float, default=float(env.get("WORKER_DRAIN_GRACE_S", 30.0))
    )
    parser.add_argument(
        "--torch-threads", type=int, default=int(env.get("WORKER_TORCH_THREADS", 0))
    )
    parser.add_argument(
        "--upstream-budget-ms",
        type=float,
        default=float(env.get("WORKER_UPSTREAM_BUDGET_MS", 40.0)),
        help="part of each SLO reserved for gateway, router and hops",
    )
    parser.add_argument(
        "--max-wait-cap-ms",
        type=float,
        default=float(env.get("WORKER_MAX_WAIT_CAP_MS", 50.0)),
        help="upper bound on the derived linger",
    )
    parser.add_argument(
        "--redis-url",
        default=env.get("WORKER_REDIS_URL"),
        help="Redis of the router registry; without it the worker runs standalone",
    )
    parser.add_argument(
        "--worker-id", default=env.get("WORKER_ID", ""), help="registry id (default: hostname-pid)"
    )
    parser.add_argument(
        "--advertise-address",
        default=env.get("WORKER_ADVERTISE_ADDRESS", ""),
        help="host:port routers dial (default: --host and the bound port)",
    )
    parser.add_argument("--registry-prefix", default=env.get("FABRIC_REGISTRY_PREFIX", "fabric"))
    add_listener_arguments(parser, env, env_prefix="WORKER", grpc_port=8201, metrics_port=8202)
    args = parser.parse_args(argv)
    return WorkerConfig(
        model_repository=args.model_repository,
        host=args.host,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        drain_grace_s=args.drain_grace_s,
        torch_threads=args.torch_threads,
        ready_file=args.ready_file,
        redis_url=args.redis_url,
        worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        advertise_address=args.advertise_address,
        registry_prefix=args.registry_prefix,
        batching=DriverConfig(
            upstream_budget_s=args.upstream_budget_ms / 1000.0,
            max_wait_cap_s=args.max_wait_cap_ms / 1000.0,
        ),
    )


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
    loading.cancel()
    await worker.stop()
    log.info("worker stopped")
    return 0


def main() -> None:
    configure_logging()
    configure_tracing("gpu_worker")
    config = parse_config()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    raise SystemExit(asyncio.run(serve(config)))


if __name__ == "__main__":
    main()
