"""The gateway's configuration: its settings table and the frozen config `__main__` builds from
it once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.common.door_config import DoorConfig, door_settings
from services.common.event_loop import EVENT_LOOPS
from services.common.lifecycle import check_limits, limit_settings
from services.common.logs import LogConfig
from services.common.settings import (
    ConfigParser,
    Setting,
    SettingsTable,
    config_builder,
    listener_settings,
)
from services.common.tls import (
    ClientTls,
    ServerTls,
    check_distinct_ports,
    client_tls_settings,
    server_tls_settings,
)
from services.gateway.bundle_clock import BundleClock
from services.gateway.quota_sync import QuotaSyncConfig
from services.gateway.throttle import ThrottleConfig


@dataclass(frozen=True)
class GatewayConfig:
    #: Model repository (configs and tokenizers; weights are not loaded here).
    model_repository: Path
    #: host:port of the routers (a DNS name: every address it resolves to), or comma-separated
    #: IPv4 ip:port entries; calls are spread over all of them (round robin).
    router_address: str = "127.0.0.1:8101"
    #: Interface for the gRPC and metrics listeners.
    host: str = "127.0.0.1"
    #: gRPC port (Triton's convention: 8001); 0 picks a free one.
    grpc_port: int = 8001
    #: Prometheus `/metrics` port (Triton's convention: 8002); 0 picks a free one.
    metrics_port: int = 8002
    #: KServe v2 REST and OpenAI-compatible HTTP port (Triton's convention: 8000); 0 picks a
    #: free one; -1 serves no HTTP.
    http_port: int = 8000
    #: TOML file of hashed API keys (re-read when it changes). Without one the gateway refuses
    #: to start unless `allow_unauthenticated` is set.
    api_keys_file: Path | None = None
    #: Local development only: without a keys file, serve every caller as tenant "local".
    allow_unauthenticated: bool = False
    #: Largest request message received, bytes. Public requests are a few rows of text or
    #: tensors; anything larger is refused by grpc before the gateway parses or authenticates.
    max_message_bytes: int = 4 * 1024 * 1024
    #: Most calls served at once (streams included) before grpc answers RESOURCE_EXHAUSTED;
    #: 0 means no limit.
    max_concurrent_rpcs: int = 4096
    #: Calls grpc holds before this process's Python picks them up, past which it
    #: starts to drop arrivals (all of them at twice it), CANCELLED (services.common.lifecycle.
    #: pending_call_options); 0: grpc's defaults (every call kept up to 1,000). Off by default:
    #: a count cannot tell a burst from a flood, and a burst past it loses calls (128 cut the
    #: e2e's burst of 200); for gateways whose loop, not the model, binds, and whose callers
    #: send a dropped call again (the slim client and the job runners do). 128 measured best.
    max_pending_calls: int = 0
    #: Most inputs one Predict / ModelInfer call may carry.
    max_inputs_per_request: int = 256
    #: The embedding model TEI's `/embed` and `/info` serve (TEI serves one model per server);
    #: empty: the repository's only text embedding model.
    tei_model: str = ""
    #: How often the fleet's served versions are re-read from the router, seconds.
    catalog_refresh_s: float = 1.0
    #: Seconds in-flight calls may take to finish after SIGTERM before they are cancelled.
    drain_grace_s: float = 10.0
    #: Each process's adaptive concurrency limit on model calls (services.common.door).
    door: DoorConfig = field(default_factory=DoorConfig)
    #: When a bundle of concurrent calls leaves for the router (services.gateway.bundle_clock).
    bundle_clock: BundleClock = field(default_factory=BundleClock)
    #: Adaptive throttling of what downstream refuses (services.gateway.throttle).
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    #: TLS of the public port (services.common.tls); optional client certificates (mTLS).
    tls: ServerTls = field(default_factory=ServerTls)
    #: How the router is dialled: TLS with the CA that signed its certificate, and the
    #: gateway's own client certificate where routers require one.
    router_tls: ClientTls = field(default_factory=ClientTls)
    #: When set, a JSON line {grpc_port, metrics_port, http_port} is written here once the
    #: gateway is ready (http_port -1 without HTTP).
    ready_file: Path | None = None
    logging: LogConfig = field(default_factory=LogConfig)
    #: The process's event loop (services.common.event_loop): uvloop or asyncio.
    event_loop: str = EVENT_LOOPS[0]
    #: Where tenants' fleet-wide quotas are shared with the other gateways.
    quota_sync: QuotaSyncConfig = field(default_factory=QuotaSyncConfig)
    #: Gateway processes serving the same ports (process_group.py: SO_REUSEPORT, one event
    #: loop per core); 0: one per CPU this process may run on. Above 1 needs Redis
    #: (`quota_sync.redis_url`), so tenants' quotas hold across the processes.
    processes: int = 1

    def __post_init__(self) -> None:
        # Fail closed: serving everyone as one tenant must be asked for, never a default.
        if self.api_keys_file is None and not self.allow_unauthenticated:
            raise ValueError(
                "no API keys file: give --api-keys-file (GATEWAY_API_KEYS_FILE), or, for local "
                "development only, --allow-unauthenticated (GATEWAY_ALLOW_UNAUTHENTICATED=true)"
            )
        check_limits(self.max_message_bytes, self.max_concurrent_rpcs, self.max_pending_calls)
        check_distinct_ports(
            grpc_port=self.grpc_port,
            metrics_port=self.metrics_port,
            http_port=self.http_port,
            health_port=self.tls.health_port,
        )
        if self.max_inputs_per_request < 1:  # every call would be refused, blaming its caller
            raise ValueError(
                f"max_inputs_per_request must be >= 1, got {self.max_inputs_per_request}"
            )
        if not self.catalog_refresh_s > 0:
            # 0 read the router's model list back to back, for good.
            raise ValueError(f"catalog_refresh_s must be > 0, got {self.catalog_refresh_s}")
        if self.processes < 0:
            raise ValueError(
                f"processes must be >= 0 (0: one per CPU it may use), got {self.processes}"
            )
        if self.processes != 1 and not self.quota_sync.redis_url:
            raise ValueError(
                "several gateway processes need --redis-url (GATEWAY_REDIS_URL): each process"
                " is a gateway of its own, and tenants' quotas hold across them only through"
                " Redis"
            )


SETTINGS = SettingsTable(
    prog="python -m services.gateway",
    description="Gateway: authenticates, validates and tokenizes, then forwards to a router.",
    env_prefix="GATEWAY",
    settings=(
        Setting("model_repository", Path, Path("models"), "model repository directory"),
        Setting(
            "router_address",
            str,
            GatewayConfig.router_address,
            "host:port of the routers (a DNS name balances over all its addresses), or "
            "comma-separated IPv4 ip:port entries",
        ),
        Setting(
            "api_keys_file",
            Path,
            None,
            "TOML of hashed API keys, re-read when it changes; required unless "
            "--allow-unauthenticated",
        ),
        Setting(
            "allow_unauthenticated",
            bool,
            False,
            "local development only: without a keys file, serve every caller as tenant 'local'",
        ),
        Setting(
            "http_port",
            int,
            GatewayConfig.http_port,
            "KServe v2 REST and OpenAI-compatible HTTP port; 0 picks a free one, -1 serves no HTTP",
            "port",
        ),
        Setting(
            "max_inputs_per_request",
            int,
            GatewayConfig.max_inputs_per_request,
            "most inputs one Predict / ModelInfer call may carry",
            "inputs",
        ),
        Setting(
            "tei_model",
            str,
            GatewayConfig.tei_model,
            "the embedding model TEI's /embed and /info serve; empty: the only text embedding "
            "model in the repository",
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
            "gateway refuses locally (the SRE book's K, at least 1; 0 disables the throttle)",
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
        Setting(
            "redis_url",
            str,
            QuotaSyncConfig.redis_url,
            "Redis where gateways share tenants' quota demand, so limits hold fleet-wide; "
            "empty: each gateway enforces whole limits on its own",
            field="quota_sync.redis_url",
        ),
        Setting(
            "redis_password_file",
            Path,
            None,
            "file with the Redis password of user `gateway` (or the URL's user)",
            field="quota_sync.redis_password_file",
        ),
        Setting(
            "registry_prefix",
            str,
            QuotaSyncConfig.key_prefix,
            "Redis key prefix (the fabric's registry prefix); quota keys are <prefix>:quota:*",
            field="quota_sync.key_prefix",
        ),
        Setting(
            "quota_sync_period_s",
            float,
            QuotaSyncConfig.period_s,
            "how often quota demand is shared and each gateway's share recomputed",
            "s",
            field="quota_sync.period_s",
        ),
        Setting(
            "processes",
            int,
            GatewayConfig.processes,
            "gateway processes serving the same ports (SO_REUSEPORT), one event loop each, "
            "under a supervisor that serves their merged /metrics and restarts any that exits; "
            "0: one per CPU; any value but 1 needs --redis-url",
            "processes",
        ),
        Setting(
            "bundle_max_out",
            int,
            BundleClock.max_out,
            "bundles of one key (model version, priority class and deadline class) a process "
            "keeps at the router, not answered, before the next waits for an answer and "
            "gathers more calls meanwhile; 0: never waits",
            "bundles",
            field="bundle_clock.max_out",
        ),
        Setting(
            "bundle_max_hold_s",
            float,
            BundleClock.max_hold_s,
            "longest a ready bundle waits for an answer (never over a tenth of its earliest "
            "caller's time left when it begins); keys whose workers hold their bundles longer "
            "(as they report it) do not wait",
            "s",
            field="bundle_clock.max_hold_s",
        ),
        *limit_settings(GatewayConfig),
        Setting(
            "max_pending_calls",
            int,
            GatewayConfig.max_pending_calls,
            "calls grpc holds before a process picks them up; past it, arrivals "
            "are dropped (CANCELLED) with a chance growing to one at twice it, bursts included; "
            "0: grpc's defaults; 128 suits a gateway whose loop binds and whose callers resend",
            "calls",
        ),
        *door_settings(),
        *server_tls_settings(),
        *client_tls_settings("router", "router_tls"),
        *listener_settings(GatewayConfig),
    ),
)


#: The config from the values `SETTINGS` parsed (by setting name).
config_from_settings = config_builder(GatewayConfig, SETTINGS)

#: The gateway's config from argv and the environment (see ConfigParser).
parse_config = ConfigParser(SETTINGS, config_from_settings)
