"""The gateway's configuration, read once in `__main__`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.throttle import ThrottleConfig


@dataclass(frozen=True)
class GatewayConfig:
    #: Model repository (configs and tokenizers; weights are not loaded here).
    model_repository: Path
    #: host:port of a router.
    router_address: str = "127.0.0.1:8101"
    host: str = "127.0.0.1"
    #: gRPC port (Triton's convention: 8001); 0 picks a free one.
    grpc_port: int = 8001
    #: Prometheus `/metrics` port (Triton's convention: 8002); 0 picks a free one.
    metrics_port: int = 8002
    #: TOML file of hashed API keys; None runs in local mode without authentication.
    api_keys_file: Path | None = None
    #: Most inputs one Predict / ModelInfer call may carry.
    max_inputs_per_request: int = 256
    #: How often the fleet's served versions are re-read from the router.
    catalog_refresh_s: float = 1.0
    #: Adaptive throttling of what downstream refuses (services.gateway.throttle).
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    ready_file: Path | None = None
