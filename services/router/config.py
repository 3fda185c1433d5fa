"""The router's configuration, read once in `__main__`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.router.routing import RoutingConfig


@dataclass(frozen=True)
class RouterConfig:
    #: Redis holding the worker registry.
    redis_url: str
    host: str = "127.0.0.1"
    #: gRPC port; 0 picks a free one.
    grpc_port: int = 8101
    #: Prometheus `/metrics` port; 0 picks a free one.
    metrics_port: int = 8102
    registry_prefix: str = "fabric"
    #: How often the registry snapshot is re-read from Redis (one pipelined read, not per call).
    refresh_period_s: float = 0.5
    #: Deadline applied to calls that arrive without one.
    default_timeout_s: float = 30.0
    #: Attempts per request beyond the first, when a worker fails or vanishes mid-call.
    max_retries: int = 2
    ready_file: Path | None = None
    routing: RoutingConfig = field(default_factory=RoutingConfig)
