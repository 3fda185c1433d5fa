"""The worker's configuration: its settings table and the frozen config `__main__` builds from
it once."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.event_loop import EVENT_LOOPS
from services.common.lifecycle import MAX_MESSAGE_BYTES, check_internal_limits, limit_settings
from services.common.logs import LogConfig
from services.common.settings import (
    ConfigParser,
    Setting,
    SettingsTable,
    config_builder,
    listener_settings,
    parse_weights,
)
from services.common.tls import ServerTls, check_distinct_ports, server_tls_settings
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.load_options import LoadOptions


@dataclass(frozen=True)
class HeartbeatConfig:
    """How the worker publishes itself in the registry."""

    #: Seconds between heartbeats; keep well under the routers' --stale-after-s.
    period_s: float = 1.0
    #: TTL of the record key (a safety net; routers judge liveness by the zset score), seconds.
    ttl_s: float = 3.0
    #: Longest pause between attempts while Redis is unreachable, seconds.
    max_backoff_s: float = 5.0
    #: After SIGTERM, seconds the worker keeps taking calls once it has published its draining
    #: mark, before it refuses new work: routers read the registry every 0.5 s, so they stop
    #: choosing it first. Spent out of the drain grace (at most half of it).
    drain_announce_s: float = 1.0

    def __post_init__(self) -> None:
        if min(self.period_s, self.ttl_s, self.max_backoff_s) <= 0:
            raise ValueError("heartbeat period, TTL and max backoff must be > 0 seconds")
        if self.drain_announce_s < 0:
            raise ValueError(f"drain_announce_s must be >= 0, got {self.drain_announce_s}")
        # A record that expires between two heartbeats leaves routing for part of each period
        # (routers skip a member whose record is gone); under 1 ms it is `PX 0`, which Redis
        # refuses, and every heartbeat would fail.
        if self.ttl_s <= self.period_s or self.ttl_s < 0.001:
            raise ValueError(
                f"heartbeat TTL ({self.ttl_s} s) must exceed its period ({self.period_s} s) "
                "and be at least 0.001 s"
            )


#: Most front processes one worker starts.
MAX_FRONT_PROCESSES = 64


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
    #: Run the forward of the models written here (BERT embeddings) through `torch.compile`
    #: (inductor; needs a C++ compiler on a CPU): faster batches, a longer warm-up.
    compile_models: bool = False
    #: Serve every embedding model as a GPU-speed stand-in timed by this measured device curve
    #: (services/gpu_worker/backends/stand_in.py; curves in services/sim/curves/): on a machine
    #: without the GPU, the CPU tiers become the bottleneck as they are on a GPU box.
    stand_in_curve: Path | None = None
    #: When set, a JSON line {grpc_port, metrics_port} is written here once the worker is ready.
    ready_file: Path | None = None
    logging: LogConfig = field(default_factory=LogConfig)
    #: The process's event loop (services.common.event_loop): uvloop or asyncio.
    event_loop: str = EVENT_LOOPS[0]
    #: Largest request message received, bytes: internal calls carry whole batches and
    #: multiplexed streams, so the cap is far above the gateway's.
    max_message_bytes: int = MAX_MESSAGE_BYTES
    #: Most calls served at once (streams included), by each front with `front_processes`;
    #: 0 means no limit: callers are our own tiers, already capped at the gateway, and
    #: admission control bounds the work itself.
    max_concurrent_rpcs: int = 0
    #: gRPC front processes (services.gpu_worker.front) relaying calls to this process, the
    #: engine, which then serves gRPC only on a Unix socket of its own; 0: it serves the port.
    front_processes: int = 0
    #: Worker-wide batching settings (per-model ones come from the model repository).
    batching: DriverConfig = field(default_factory=DriverConfig)
    #: Redis holding the worker registry; None runs the worker standalone (direct calls only).
    redis_url: str | None = None
    #: File holding the password of Redis user `worker` (or the URL's user); None: the URL's
    #: credentials, if any. Re-read on every new connection.
    redis_password_file: Path | None = None
    #: Registry key prefix (one prefix per fabric sharing a Redis).
    registry_prefix: str = "fabric"
    #: The models this worker serves (its model pool); empty: every model in the repository.
    models: tuple[str, ...] = ()
    #: This worker's id in the registry; unique per process.
    worker_id: str = ""
    #: host:port routers dial; defaults to host and the bound gRPC port.
    advertise_address: str = ""
    #: Registry heartbeats (used only with `redis_url`).
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    #: TLS of the gRPC port (services.common.tls); a client CA makes routers' certificates
    #: required (mTLS).
    tls: ServerTls = field(default_factory=ServerTls)

    def __post_init__(self) -> None:
        if not 0 <= self.front_processes <= MAX_FRONT_PROCESSES:
            raise ValueError(
                f"front_processes must be in [0, {MAX_FRONT_PROCESSES}], got {self.front_processes}"
            )
        if self.torch_threads < 0:  # torch refuses it at start, past the settings' checks
            raise ValueError(
                f"torch_threads must be >= 0 (0: torch's default), got {self.torch_threads}"
            )
        check_internal_limits(self.max_message_bytes, self.max_concurrent_rpcs)
        check_distinct_ports(
            grpc_port=self.grpc_port,
            metrics_port=self.metrics_port,
            health_port=self.tls.health_port,
        )

    @property
    def load_options(self) -> LoadOptions:
        """How this worker loads its versions (the thread count generation engines choose
        up to is resolved at start: server.serve)."""
        return LoadOptions(
            self.compile_models,
            self.stand_in_curve,
            failing_steps_to_mark=self.batching.failing_batches_to_mark,
        )


def _ms(seconds: float) -> float:
    return seconds * 1000.0


_BATCHING = (
    Setting(
        "upstream_budget_ms",
        float,
        _ms(DriverConfig.upstream_budget_s),
        "part of each model's SLO reserved for gateway, router and the hops",
        "ms",
        field="batching.upstream_budget_s",
        scale=0.001,
    ),
    Setting(
        "safety_margin_ms",
        float,
        _ms(DriverConfig.safety_margin_s),
        "margin kept between a batch's predicted completion and its rows' deadlines",
        "ms",
        field="batching.safety_margin_s",
        scale=0.001,
    ),
    Setting(
        "prediction_spreads",
        float,
        DriverConfig.prediction_spreads,
        "spreads of the batch times' learned scale that each batch-time prediction adds (the "
        "slow end of a batch's likely times); 0 predicts by the scale alone",
        "spreads",
        field="batching.prediction_spreads",
    ),
    Setting(
        "slo_prediction_spreads",
        float,
        DriverConfig.slo_prediction_spreads,
        "spreads a row bound by its model's SLO is predicted with against that bound (its "
        "budget is cut to the share predictions with --prediction-spreads may fill); a row "
        "bound by its deadline alone keeps --prediction-spreads",
        "spreads",
        field="batching.slo_prediction_spreads",
    ),
    Setting(
        "max_wait_cap_ms",
        float,
        _ms(DriverConfig.max_wait_cap_s),
        "upper bound on the linger derived from each model's SLO",
        "ms",
        field="batching.max_wait_cap_s",
        scale=0.001,
    ),
    Setting(
        "min_expected_arrivals",
        float,
        DriverConfig.min_expected_arrivals,
        "with the executor idle, linger only if this many more rows are expected in time and "
        "the next one soon enough to be worth waiting for; 0 always lingers",
        "rows",
        field="batching.min_expected_arrivals",
    ),
    Setting(
        "tenant_weights",
        parse_weights,
        {},
        "fair-share weights per tenant as name=weight,... (unlisted tenants weigh 1)",
        field="batching.tenant_weights",
    ),
    Setting(
        "backfill_torch_threads",
        int,
        DriverConfig.backfill_threads,
        "torch threads of the short backfill batches of `batch` rows beside online traffic; "
        "-1: half of torch's threads on a CPU (the rest stay free for the online path), 0: all",
        "threads",
        field="batching.backfill_threads",
    ),
    Setting(
        "failing_batches_to_mark",
        int,
        DriverConfig.failing_batches_to_mark,
        "batches of a version in a row, over a second or more, each failed in every row, that "
        "mark it failing in the heartbeat (routers then send its calls to other workers while "
        "any serves it); 0 never marks one",
        "batches",
        field="batching.failing_batches_to_mark",
    ),
    Setting(
        "watchdog_s",
        float,
        DriverConfig.watchdog_s,
        "longest a model call may run before the worker declares itself wedged and stops "
        "serving (raised to 10x the costliest warm-up batch when that is larger)",
        "s",
        field="batching.watchdog_s",
    ),
)

_REGISTRY = (
    Setting(
        "redis_url", str, None, "Redis of the router registry; unset runs the worker standalone"
    ),
    Setting(
        "redis_password_file",
        Path,
        None,
        "file with the Redis password of user `worker` (or the URL's user); unset: the URL's",
    ),
    Setting(
        "registry_prefix",
        str,
        WorkerConfig.registry_prefix,
        "registry key prefix; must match the routers' --registry-prefix",
    ),
    # WORKER_ID, not WORKER_WORKER_ID: deployments set it from the pod name.
    Setting("worker_id", str, "", "registry id; unset means hostname-pid", env="WORKER_ID"),
    Setting(
        "advertise_address",
        str,
        WorkerConfig.advertise_address,
        "host:port routers dial; unset means --host and the bound gRPC port",
    ),
    Setting(
        "heartbeat_period_s",
        float,
        HeartbeatConfig.period_s,
        "time between registry heartbeats; keep well under the routers' --stale-after-s",
        "s",
        field="heartbeat.period_s",
    ),
    Setting(
        "heartbeat_ttl_s",
        float,
        HeartbeatConfig.ttl_s,
        "expiry of the registry record, a safety net for a worker that dies silently",
        "s",
        field="heartbeat.ttl_s",
    ),
    Setting(
        "heartbeat_max_backoff_s",
        float,
        HeartbeatConfig.max_backoff_s,
        "longest pause between heartbeat attempts while Redis is unreachable",
        "s",
        field="heartbeat.max_backoff_s",
    ),
    Setting(
        "drain_announce_s",
        float,
        HeartbeatConfig.drain_announce_s,
        "after SIGTERM, time the worker keeps taking calls once its draining mark is published, "
        "so routers stop choosing it before it refuses any (out of --drain-grace-s, at most half)",
        "s",
        field="heartbeat.drain_announce_s",
    ),
)


def parse_model_names(text: str) -> tuple[str, ...]:
    """`a,b` -> ("a", "b"); blanks dropped, duplicates refused."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if len(set(names)) != len(names):
        raise ValueError(f"a model is named twice in {text!r}")
    return names


SETTINGS = SettingsTable(
    prog="python -m services.gpu_worker",
    description="GPU worker: serves the models of a model repository with dynamic batching.",
    env_prefix="WORKER",
    settings=(
        Setting("model_repository", Path, Path("models"), "model repository directory"),
        Setting(
            "models",
            parse_model_names,
            (),
            "comma-separated models to serve (a model pool); empty: every model in the repository",
        ),
        Setting(
            "compile_models",
            bool,
            WorkerConfig.compile_models,
            "run embedding models' forward through torch.compile (inductor: on this project's "
            "CPU 1.1-1.2x faster batches of 8 or more rows, 10-35 s more warm-up; needs a C++ "
            "compiler, else they run uncompiled with a warning)",
        ),
        Setting(
            "stand_in_curve",
            Path,
            None,
            "serve embedding models as GPU-speed stand-ins: batches take the time this device "
            "curve gives (services/sim/curves/*.json), asleep, with the real tokenizer; outputs "
            "are unit vectors, not embeddings (benchmarks of the CPU tiers without a GPU)",
        ),
        Setting(
            "torch_threads",
            int,
            WorkerConfig.torch_threads,
            "torch intra-op threads on the CPU; 0 keeps torch's default (generation steps "
            "run on one, all but one or all of them, whichever measures cheapest per step size)",
            "threads",
        ),
        Setting(
            "front_processes",
            int,
            WorkerConfig.front_processes,
            "gRPC front processes sharing the worker's port, relaying calls to this process "
            "(the engine: models, batcher, device) over a Unix socket; 0: it serves the port",
            "processes",
        ),
        *_BATCHING,
        *_REGISTRY,
        *limit_settings(WorkerConfig),
        *server_tls_settings(),
        *listener_settings(WorkerConfig),
    ),
)


_build = config_builder(WorkerConfig, SETTINGS)


def config_from_settings(values: Mapping[str, Any]) -> WorkerConfig:
    """The config from the values `SETTINGS` parsed (by setting name); an unset worker id
    becomes hostname-pid."""
    config = _build(values)
    if config.worker_id:
        return config
    return dataclasses.replace(config, worker_id=f"{socket.gethostname()}-{os.getpid()}")


#: The worker's config from argv and the environment (see ConfigParser).
parse_config = ConfigParser(SETTINGS, config_from_settings)
