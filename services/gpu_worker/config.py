"""The worker's configuration, read once in `__main__` from the command line (env fallbacks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.gpu_worker.scheduler import SchedulerConfig


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
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
