"""The router's configuration: its settings table and the frozen config `__main__` builds from
it once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from services.common.event_loop import EVENT_LOOPS
from services.common.lifecycle import MAX_MESSAGE_BYTES, check_internal_limits, limit_settings
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
from services.router.routing_config import RoutingConfig
from services.router.worker_networks import DEFAULT_WORKER_NETWORKS, WorkerNetworks


@dataclass(frozen=True)
class RouterConfig:
    #: Redis holding the worker registry.
    redis_url: str
    #: File holding the password of Redis user `router` (or the URL's user); None: the URL's
    #: credentials, if any. Re-read on every new connection.
    redis_password_file: Path | None = None
    #: Where worker addresses must be: records advertising any other address are ignored.
    worker_networks: WorkerNetworks = field(
        default_factory=lambda: WorkerNetworks.parse(DEFAULT_WORKER_NETWORKS)
    )
    #: Interface for the gRPC and metrics listeners.
    host: str = "127.0.0.1"
    #: gRPC port; 0 picks a free one.
    grpc_port: int = 8101
    #: Prometheus `/metrics` port; 0 picks a free one.
    metrics_port: int = 8102
    #: Registry key prefix (one prefix per fabric sharing a Redis; the workers' must match).
    registry_prefix: str = "fabric"
    #: How often the registry snapshot is re-read from Redis (one pipelined read, not per call).
    refresh_period_s: float = 0.5
    #: Deadline applied to calls that arrive without one.
    default_timeout_s: float = 30.0
    #: Attempts per request beyond the first, when a worker fails or vanishes mid-call.
    max_retries: int = 2
    #: Seconds in-flight calls may take to finish after SIGTERM before they are cancelled.
    drain_grace_s: float = 10.0
    #: When set, a JSON line {grpc_port, metrics_port} is written here once the router is ready.
    ready_file: Path | None = None
    logging: LogConfig = field(default_factory=LogConfig)
    #: The process's event loop (services.common.event_loop): uvloop or asyncio.
    event_loop: str = EVENT_LOOPS[0]
    #: Largest request message received, bytes: internal calls carry whole batches and
    #: multiplexed streams, so the cap is far above the gateway's.
    max_message_bytes: int = MAX_MESSAGE_BYTES
    #: Most calls served at once (streams included); 0 means no limit: callers are our own
    #: tiers, already capped at the gateway, and admission control bounds the work itself.
    max_concurrent_rpcs: int = 0
    #: Routing and admission (services.router.routing).
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    #: TLS of the gRPC port (services.common.tls); a client CA makes gateways' certificates
    #: required (mTLS).
    tls: ServerTls = field(default_factory=ServerTls)
    #: How workers are dialled: the CA of their certificates, the router's client certificate,
    #: and the name their certificate carries (they are dialled by pod IP).
    worker_tls: ClientTls = field(default_factory=ClientTls)

    def __post_init__(self) -> None:
        check_internal_limits(self.max_message_bytes, self.max_concurrent_rpcs)
        check_distinct_ports(
            grpc_port=self.grpc_port,
            metrics_port=self.metrics_port,
            health_port=self.tls.health_port,
        )
        # Below 0 no attempt at all is made: every call failed UNAVAILABLE with its rows left
        # reserved, and a generation ended OK with no token. A period of 0 spins the registry
        # loop.
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("refresh_period_s", "default_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        # A snapshot ages up to a period (and a read) before the next: a bound within two
        # refused every call for part of each period (settings review).
        if self.routing.max_snapshot_age_s < 2 * self.refresh_period_s:
            raise ValueError(
                f"max_snapshot_age_s ({self.routing.max_snapshot_age_s} s) must be at least two "
                f"registry refresh periods ({self.refresh_period_s} s)"
            )


SETTINGS = SettingsTable(
    prog="python -m services.router",
    description="Router: picks the worker that will serve each request soonest.",
    env_prefix="ROUTER",
    settings=(
        Setting("redis_url", str, "redis://127.0.0.1:6379/0", "Redis holding the worker registry"),
        Setting(
            "redis_password_file",
            Path,
            None,
            "file with the Redis password of user `router` (or the URL's user); unset: the URL's",
        ),
        Setting(
            "worker_networks",
            WorkerNetworks.parse,
            WorkerNetworks.parse(DEFAULT_WORKER_NETWORKS),
            "comma-separated CIDRs (and .hostname.suffixes) worker addresses must be in; "
            "registry records advertising any other address are ignored",
        ),
        Setting(
            "registry_prefix",
            str,
            RouterConfig.registry_prefix,
            "registry key prefix; must match the workers' --registry-prefix",
        ),
        Setting(
            "refresh_period_s",
            float,
            RouterConfig.refresh_period_s,
            "how often the worker registry is re-read from Redis",
            "s",
        ),
        Setting(
            "default_timeout_s",
            float,
            RouterConfig.default_timeout_s,
            "deadline of calls that arrive without one",
            "s",
        ),
        Setting(
            "max_retries",
            int,
            RouterConfig.max_retries,
            "attempts on other workers after one fails or vanishes",
            "attempts",
        ),
        Setting(
            "stale_after_s",
            float,
            RoutingConfig.stale_after_s,
            "a worker whose heartbeat is older than this is dead; keep it above the workers' "
            "--heartbeat-period-s",
            "s",
            field="routing.stale_after_s",
        ),
        Setting(
            "max_snapshot_age_s",
            float,
            RoutingConfig.max_snapshot_age_s,
            "past this without a registry refresh (Redis unreachable), every request is "
            "refused; at least two --refresh-period-s",
            "s",
            field="routing.max_snapshot_age_s",
        ),
        Setting(
            "eject_s",
            float,
            RoutingConfig.eject_s,
            "how long a worker whose call failed with UNAVAILABLE is skipped",
            "s",
            field="routing.eject_s",
        ),
        Setting(
            "timeouts_to_eject",
            int,
            RoutingConfig.timeouts_to_eject,
            "consecutive timeouts, with no success between, that eject a worker; 0 never does",
            "calls",
            field="routing.timeouts_to_eject",
        ),
        Setting(
            "timeout_eject_s",
            float,
            RoutingConfig.timeout_eject_s,
            "first ejection period of a worker whose calls only time out; each repeat doubles it",
            "s",
            field="routing.timeout_eject_s",
        ),
        Setting(
            "max_timeout_eject_s",
            float,
            RoutingConfig.max_timeout_eject_s,
            "longest ejection period of a worker whose calls only time out",
            "s",
            field="routing.max_timeout_eject_s",
        ),
        Setting(
            "deadline_margin_s",
            float,
            RoutingConfig.deadline_margin_s,
            "margin kept between a worker's predicted completion and the deadline",
            "s",
            field="routing.deadline_margin_s",
        ),
        Setting(
            "explore_share",
            float,
            RoutingConfig.explore_share,
            "share of routes that try one other worker at random, taken if idle, so a worker "
            "whose estimates look slow (warmed up on a busy machine) still gets traffic to "
            "correct them",
            "share",
            field="routing.explore_share",
        ),
        Setting(
            "power_of_two_threshold",
            int,
            RoutingConfig.power_of_two_threshold,
            "past this many candidate workers, sample two instead of scanning all",
            "workers",
            field="routing.power_of_two_threshold",
        ),
        *limit_settings(RouterConfig),
        *server_tls_settings(),
        *client_tls_settings("worker", "worker_tls"),
        *listener_settings(RouterConfig),
    ),
)


#: The config from the values `SETTINGS` parsed (by setting name).
config_from_settings = config_builder(RouterConfig, SETTINGS)

#: The router's config from argv and the environment (see ConfigParser).
parse_config = ConfigParser(SETTINGS, config_from_settings)
