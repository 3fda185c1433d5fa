"""The gateway's configuration: its settings table and the frozen config `__main__` builds from
it once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.common.settings import (
    ConfigParser,
    Setting,
    SettingsTable,
    config_builder,
    listener_settings,
)
from services.gateway.throttle import ThrottleConfig


@dataclass(frozen=True)
class GatewayConfig:
    #: Model repository (configs and tokenizers; weights are not loaded here).
    model_repository: Path
    #: host:port of a router.
    router_address: str = "127.0.0.1:8101"
    #: Interface for the gRPC and metrics listeners.
    host: str = "127.0.0.1"
    #: gRPC port (Triton's convention: 8001); 0 picks a free one.
    grpc_port: int = 8001
    #: Prometheus `/metrics` port (Triton's convention: 8002); 0 picks a free one.
    metrics_port: int = 8002
    #: TOML file of hashed API keys; None runs in local mode without authentication.
    api_keys_file: Path | None = None
    #: Most inputs one Predict / ModelInfer call may carry.
    max_inputs_per_request: int = 256
    #: How often the fleet's served versions are re-read from the router, seconds.
    catalog_refresh_s: float = 1.0
    #: Seconds in-flight calls may take to finish after SIGTERM before they are cancelled.
    drain_grace_s: float = 10.0
    #: Adaptive throttling of what downstream refuses (services.gateway.throttle).
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    #: When set, a JSON line {grpc_port, metrics_port} is written here once the gateway is ready.
    ready_file: Path | None = None


SETTINGS = SettingsTable(
    prog="python -m services.gateway",
    description="Gateway: authenticates, validates and tokenizes, then forwards to a router.",
    env_prefix="GATEWAY",
    settings=(
        Setting("model_repository", Path, Path("models"), "model repository directory"),
        Setting("router_address", str, GatewayConfig.router_address, "host:port of a router"),
        Setting(
            "api_keys_file",
            Path,
            None,
            "TOML of hashed API keys; unset runs in local mode without authentication",
        ),
        Setting(
            "max_inputs_per_request",
            int,
            GatewayConfig.max_inputs_per_request,
            "most inputs one Predict / ModelInfer call may carry",
            "inputs",
        ),
        Setting(
            "catalog_refresh_s",
            float,
            GatewayConfig.catalog_refresh_s,
            "how often the served model versions are re-read from the router",
            "s",
        ),
        Setting(
            "throttle_accepts_multiplier",
            float,
            ThrottleConfig.accepts_multiplier,
            "adaptive throttling: requests sent per request downstream accepted before the "
            "gateway refuses locally (the SRE book's K; 0 disables the throttle)",
            field="throttle.accepts_multiplier",
        ),
        Setting(
            "throttle_max_reject_probability",
            float,
            ThrottleConfig.max_reject_probability,
            "adaptive throttling: cap on the local refusal probability, in [0, 1)",
            field="throttle.max_reject_probability",
        ),
        Setting(
            "throttle_memory_s",
            float,
            ThrottleConfig.memory_s,
            "adaptive throttling: time constant of its decaying counts",
            "s",
            field="throttle.memory_s",
        ),
        Setting(
            "throttle_default_retry_after_s",
            float,
            ThrottleConfig.default_retry_after_s,
            "adaptive throttling: retry hint of a local refusal before downstream sent any",
            "s",
            field="throttle.default_retry_after_s",
        ),
        *listener_settings(GatewayConfig),
    ),
)


#: The config from the values `SETTINGS` parsed (by setting name).
config_from_settings = config_builder(GatewayConfig, SETTINGS)

#: The gateway's config from argv and the environment (see ConfigParser).
parse_config = ConfigParser(SETTINGS, config_from_settings)
