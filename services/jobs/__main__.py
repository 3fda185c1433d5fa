"""`python -m services.jobs`: read configuration, run a job runner until SIGTERM.

The runner has no gRPC server of its own: it reads the job queue from Redis, calls the gateway's
`InferenceService.Predict`, and serves Prometheus metrics. Its ready file says
{grpc_port: 0, metrics_port}.
"""

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
import socket

from services.common.channel_options import channel_options
from services.common.job_store import JobStore, connect_jobs_redis
from services.common.lifecycle import (
    bound_stop,
    exit_stopped,
    start_metrics,
    stop_event,
    write_ready_file,
)
from services.common.logs import configure_logging
from services.common.redis_acl import JOBS, redacted_url, role_credentials
from services.common.settings import unusable_file
from services.common.telemetry import tier_registry
from services.common.tls import open_channel
from services.jobs.config import RunnerConfig, parse_config
from services.jobs.metrics import RunnerMetrics
from services.jobs.runner import JobRunner, PredictFn
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc

log = logging.getLogger("services.jobs")
#: Socket timeout of the runner's Redis calls; above XREADGROUP's block time.
REDIS_TIMEOUT_S = 5.0


def _predict_fn(stub: api_grpc.InferenceServiceStub, config: RunnerConfig) -> PredictFn:
    metadata: tuple[tuple[str, str], ...] = ()
    if config.api_key_file is not None:
        try:
            key = config.api_key_file.read_text().strip()
            if not key:
                raise ValueError("empty")
        except (OSError, ValueError) as error:  # ValueError: empty, or not UTF-8
            raise unusable_file("the API key file", config.api_key_file, error) from error
        metadata = (("authorization", f"Bearer {key}"),)

    async def predict(request: api.PredictRequest) -> api.PredictResponse:
        return await stub.Predict(request, timeout=config.call_timeout_s, metadata=metadata)

    return predict


#: The runner's keepalive towards the gateway, seconds: the public gateway keeps grpc's own ping
#: policy (one a 5 min without data, GOAWAY "too_many_pings" past two strikes), and the 10 s of
#: the tiers' internal channels got every call on the connection failed whenever the gateway
#: answered nothing for 40 s (review finding).
PUBLIC_KEEPALIVE_S = 300.0


async def serve(config: RunnerConfig) -> int:
    credentials = role_credentials(JOBS, config.redis_url, config.redis_password_file)
    client = connect_jobs_redis(
        config.redis_url, timeout_s=REDIS_TIMEOUT_S, credentials=credentials
    )
    store = JobStore(client, prefix=config.key_prefix, retention_s=config.retention_s)
    channel = open_channel(
        config.gateway_address, config.gateway_tls, channel_options(PUBLIC_KEEPALIVE_S)
    )
    metrics = RunnerMetrics(tier_registry("jobs"))
    consumer = config.consumer or f"{socket.gethostname()}-{os.getpid()}"
    runner = JobRunner(
        store,
        _predict_fn(api_grpc.InferenceServiceStub(channel), config),
        metrics,
        consumer=consumer,
        retry=config.retry,
        max_in_flight_chunks=config.max_in_flight_chunks,
        claim_timeout_s=config.claim_timeout_s,
        fleet_patience_s=config.fleet_patience_s,
    )
    stopping = stop_event()
    metrics_port = start_metrics(config.metrics_port, config.host, metrics.registry)
    log.info(
        "job runner %s: queue %s, gateway %s, metrics on %d",
        consumer,
        redacted_url(config.redis_url),
        config.gateway_address,
        metrics_port,
    )
    write_ready_file(config.ready_file, 0, metrics_port)
    await runner.run(stopping)
    log.info("SIGTERM: draining (grace %.1f s)", config.drain_grace_s)
    bound_stop(config.drain_grace_s)
    await runner.drain(config.drain_grace_s)
    await channel.close()
    await client.aclose()
    log.info("job runner stopped")
    exit_stopped(0)


def main() -> None:
    config = parse_config()  # a bad setting exits here (status 2), before anything starts
    configure_logging("jobs", config.logging)
    with parse_config.startup_errors():  # a file a setting names, unusable: status 2
        raise SystemExit(asyncio.run(serve(config)))


if __name__ == "__main__":
    main()
