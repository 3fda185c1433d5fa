"""The job runner's configuration: its settings table and the frozen config `__main__` builds
from it once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.common.job_policy import FLEET_PATIENCE_S, RetryPolicy
from services.common.job_store import RETENTION_S
from services.common.logs import LogConfig
from services.common.settings import (
    ConfigParser,
    Setting,
    SettingsTable,
    config_builder,
    parse_seconds,
)
from services.common.tls import ClientTls, check_distinct_ports, client_tls_settings


@dataclass(frozen=True)
class RunnerConfig:
    #: Redis holding the jobs (the fabric's Redis).
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: File with the password of Redis user `jobs` (or the URL's user); None: the URL's.
    redis_password_file: Path | None = None
    #: Key prefix of the job keys (services.common.job_store); the gateways' must match.
    key_prefix: str = "fabric"
    #: The gateway whose InferenceService.Predict runs the items (host:port).
    gateway_address: str = "127.0.0.1:8001"
    #: How the gateway is dialled (plaintext unless a CA is set).
    gateway_tls: ClientTls = field(default_factory=ClientTls)
    #: File with the runner's API key (its tenant must be granted the batch class); None:
    #: no key (a gateway in local mode).
    api_key_file: Path | None = None
    #: This runner's consumer name in the group; "" means `<hostname>-<pid>`.
    consumer: str = ""
    #: Queue entries (chunks) run at once; each is one Predict call in flight.
    max_in_flight_chunks: int = 4
    #: An entry claimed by a runner and idle this long is taken over (the runner died).
    claim_timeout_s: float = 30.0
    #: Deadline of each Predict call.
    call_timeout_s: float = 20.0
    #: How long a chunk the fleet cannot serve (UNAVAILABLE, RESOURCE_EXHAUSTED, CANCELLED,
    #: DEADLINE_EXCEEDED through its retries) waits, from its first such round and for
    #: FLEET_ROUNDS rounds at least, before its items fail with the fleet's status.
    fleet_patience_s: float = FLEET_PATIENCE_S
    #: Retries of failed items (attempts, capped exponential backoff with full jitter).
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    #: Interface of the metrics listener.
    host: str = "127.0.0.1"
    #: Prometheus `/metrics` port; 0 picks a free one.
    metrics_port: int = 8301
    #: When set, {grpc_port: 0, metrics_port} is written here once the runner is ready.
    ready_file: Path | None = None
    #: How long a finished job (record, items, results, idempotency key) is kept; 0: for good.
    retention_s: float = RETENTION_S
    #: Seconds running chunks may take to finish after SIGTERM; the rest are left pending
    #: and another runner reclaims them after `claim_timeout_s`.
    drain_grace_s: float = 10.0
    logging: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if self.max_in_flight_chunks < 1 or self.claim_timeout_s <= 0 or self.call_timeout_s <= 0:
            raise ValueError("max_in_flight_chunks, claim_timeout_s and call_timeout_s must be > 0")
        if not 0 <= self.retention_s < float("inf"):
            raise ValueError("retention_s must be finite and >= 0 (0: keep jobs for good)")
        if not 0 <= self.fleet_patience_s < float("inf"):
            raise ValueError("fleet_patience_s must be finite and >= 0")
        check_distinct_ports(metrics_port=self.metrics_port)  # its range, as every tier's
        if self.claim_timeout_s <= self.call_timeout_s:
            # Otherwise a live runner's entry is taken over while its call is still running.
            raise ValueError("claim_timeout_s must exceed call_timeout_s")


_D = RunnerConfig
SETTINGS = SettingsTable(
    prog="python -m services.jobs",
    description="Job runner: runs durable batch jobs through the gateway at batch priority.",
    env_prefix="JOBS",
    settings=(
        Setting("redis_url", str, _D.redis_url, "Redis holding the jobs"),
        Setting("redis_password_file", Path, None,
                "file with the Redis password of user `jobs` (or the URL's user)"),
        Setting("key_prefix", str, _D.key_prefix, "job key prefix; must match the gateways'"),
        Setting("gateway_address", str, _D.gateway_address, "gateway host:port that runs items"),
        *client_tls_settings("gateway", "gateway_tls"),
        Setting("api_key_file", Path, None, "file with the runner's API key (unset: none)"),
        Setting("consumer", str, "", "consumer name in the group (default <hostname>-<pid>)"),
        Setting("max_in_flight_chunks", int, _D.max_in_flight_chunks,
                "chunks (Predict calls) in flight at once", "chunks"),
        Setting("claim_timeout_s", float, _D.claim_timeout_s,
                "an entry idle this long in another runner's hands is taken over", "s"),
        Setting("call_timeout_s", float, _D.call_timeout_s, "deadline of each Predict call", "s"),
        Setting("fleet_patience_s", float, _D.fleet_patience_s,
                "how long a chunk the fleet cannot serve waits (from its first such round, and "
                "10 rounds at least) before its items fail", "s"),
        Setting("max_attempts", int, RetryPolicy.max_attempts, "attempts per item",
                "attempts", field="retry.max_attempts"),
        Setting("retry_base_delay_s", float, RetryPolicy.base_delay_s,
                "backoff after the first failure (doubling, full jitter)", "s",
                field="retry.base_delay_s"),
        Setting("retry_max_delay_s", float, RetryPolicy.max_delay_s, "largest backoff", "s",
                field="retry.max_delay_s"),
        Setting("host", str, _D.host, "interface the metrics listener binds"),
        Setting("metrics_port", int, _D.metrics_port, "Prometheus /metrics port; 0: free", "port"),
        Setting("ready_file", Path, None, "once ready, write {grpc_port: 0, metrics_port} here"),
        Setting("retention_s", parse_seconds, _D.retention_s,
                "how long a finished job is kept (its results, its idempotency key); 0: for good",
                "s"),
        Setting("drain_grace_s", parse_seconds, _D.drain_grace_s,
                "time running chunks may take to finish after SIGTERM", "s"),
        Setting("log_level", str, "info", "lowest level logged", field="logging.level"),
        Setting("log_format", str, "json", "log lines as json or text", field="logging.format"),
    ),
)  # fmt: skip

config_from_settings = config_builder(RunnerConfig, SETTINGS)

#: The runner's config from argv and the environment (see ConfigParser).
parse_config = ConfigParser(SETTINGS, config_from_settings)
