"""The worker's configuration, read once in `__main__` from the command line (env fallbacks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.gpu_worker.batching.driver import DriverConfig


@dataclass(frozen=True)
class HeartbeatConfig:
    period_s: float = 1.0
    #: TTL of the record key (a safety net; routers judge liveness by the zset score).
    ttl_s: float = 3.0
    #: Longest pause between attempts while Redis is unreachable.
    max_backoff_s: float = 5.0


@dataclass(frozen=True)
class WorkerConfig:
    #: Directory of the model repository (`<model>/config.toml`, `<model>/<version>/`).
    model_repository: Path
    #: Interface for the gRPC and metrics listeners.
    host: str = "127.0.0.1"
    #: gRPC port; 0 picks a free one (the bound port is logged and written to `ready_file`).
    grpc_port: int = 8201
    #: Prometheus `/metrics` port; 0 picks a free one.
    metrics_port: int = 8202
    #: Seconds that in-flight work may take to finish after SIGTERM.
    drain_grace_s: float = 30.0
    #: Intra-op threads for torch on the CPU (0 keeps torch's default).
    torch_threads: int = 0
    #: When set, a JSON line {grpc_port, metrics_port} is written here once the worker is ready.
    ready_file: Path | None = None
    batching: DriverConfig = field(default_factory=DriverConfig)
    #: Redis holding the worker registry; None runs the worker standalone (direct calls only).
    redis_url: str | None = None
    #: Registry key prefix (one prefix per fabric sharing a Redis).
    registry_prefix: str = "fabric"
    #: This worker's id in the registry; unique per process.
    worker_id: str = ""
    #: host:port routers dial; defaults to host and the bound gRPC port.
    advertise_address: str = ""
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
