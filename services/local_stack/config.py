"""The launcher's settings: what to run, where, on which ports."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.common.redis_acl import (
    password_file_name,
)
from services.common.redis_server import find_free_port
from services.common.settings import parse_seconds

HOST = "127.0.0.1"
# For the banner's grpcurl example: the gateway's own Predict on the default model.
EXAMPLE_PREDICT = '{"model_name": "minilm", "inputs": [{"text": "hello world"}]}'
PREDICT_RPC = "inference.v1.InferenceService/Predict"
#: Every tier the launcher starts, by the name `--cpus` uses.
TIERS = ("redis", "router", "worker", "gateway", "jobs")


@dataclass(frozen=True)
class StackConfig:
    #: Directory for every tier's log, ready file and Redis's files.
    state_dir: Path
    #: Number of GPU worker processes, with ids worker-0, worker-1, ...
    num_workers: int
    #: Model repository served by the workers and read by the gateway (absolute).
    model_repository: Path
    #: True: every tier on port 0 (a free port, reported in its ready file). For tests.
    is_ephemeral: bool
    #: Redis's port (Redis cannot report a port it picked, so a free one is chosen up front).
    redis_port: int
    #: When set, JSON describing every tier is written here once all of them are ready.
    ready_file: Path | None
    #: Appended to every worker's command line.
    extra_worker_args: tuple[str, ...]
    #: Appended to the gateway's command line (with an --api-keys-file the gateway
    #: authenticates; without one it serves everyone as tenant "local").
    extra_gateway_args: tuple[str, ...]
    #: Seconds one tier may take to become ready (workers load and warm up their models).
    ready_timeout_s: float
    #: Seconds one tier may take to exit after SIGTERM before it gets SIGKILL.
    stop_timeout_s: float
    #: Keep running when a tier exits after startup (tests that kill tiers on purpose).
    tolerate_exits: bool
    #: Appended to the job runner's command line (its --api-key-file when the gateway
    #: authenticates: the runner's tenant must be granted the batch class).
    extra_jobs_args: tuple[str, ...] = ()
    #: CPUs each tier's processes may run on (tiers not named: any). On one machine this
    #: stands in for the deployment's separate nodes: GPU workers apart from the CPU tiers.
    cpus: Mapping[str, frozenset[int]] = field(default_factory=dict)
    #: Routers (router-0, router-1, ... when more than one); the gateway spreads its calls
    #: over all of them.
    num_routers: int = 1
    #: The state dir is a new tmp dir made for this run (no --state-dir): removed once the
    #: stack stopped cleanly, so runs do not pile their logs and Redis files up in /tmp.
    is_state_temporary: bool = False

    @property
    def redis_url(self) -> str:
        return f"redis://{HOST}:{self.redis_port}/0"

    @property
    def redis_acl_dir(self) -> Path:
        """The ACL file and each role's password file (services.common.redis_acl)."""
        return self.state_dir / "redis-acl"

    def redis_password_file(self, role: str) -> str:
        return str(self.redis_acl_dir / password_file_name(role))

    def ports(self, grpc_port: int) -> tuple[str, str]:
        """(gRPC, metrics) ports as arguments: the default pair, or (0, 0) when ephemeral."""
        return ("0", "0") if self.is_ephemeral else (str(grpc_port), str(grpc_port + 1))


def parse_config(argv: list[str] | None = None) -> StackConfig:
    parser = argparse.ArgumentParser(
        prog="python -m services.local_stack",
        description="Run redis, router, GPU workers and gateway on loopback until Ctrl-C.",
    )
    parser.add_argument("--num-workers", type=int, default=1, help="ids worker-0, worker-1, ...")
    parser.add_argument(
        "--num-routers", type=int, default=1, help="router-0, router-1, ... when more than one"
    )
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="logs and ready files (default: a new tmp dir, removed at a clean stop)",
    )
    parser.add_argument("--ready-file", type=Path, default=None, help="JSON of every tier's ports")
    parser.add_argument(
        "--ephemeral-ports", action="store_true", help="free ports everywhere instead of 8001..."
    )
    parser.add_argument(
        "--redis-port", type=int, default=6379, help="ignored with --ephemeral-ports"
    )
    for tier in ("worker", "gateway", "jobs"):
        parser.add_argument(
            f"--{tier}-arg",
            action="append",
            default=[],
            help=f"extra {tier} argument, repeatable; write --{tier}-arg=--flag=value",
        )
    parser.add_argument(
        "--ready-timeout-s", type=parse_seconds, default=180.0, help="per tier; workers load models"
    )
    parser.add_argument(
        "--stop-timeout-s",
        type=parse_seconds,
        default=60.0,
        help="per tier, after SIGTERM, then SIGKILL",
    )
    parser.add_argument(
        "--tolerate-exits", action="store_true", help="keep running if a tier exits once up"
    )
    parser.add_argument(
        "--cpus",
        action="append",
        default=[],
        metavar="TIERS=CPUS",
        help="pin tiers to CPUs, repeatable: --cpus worker=1 --cpus gateway,router,redis,jobs=0"
        f" (tiers: {', '.join(TIERS)}; CPUs: ids and ranges such as 0-3,6)",
    )
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error("--num-workers must be at least 1")
    if not 1 <= args.num_routers <= 9:
        parser.error("--num-routers must be 1 to 9 (their default ports lie below the workers')")
    try:
        cpus = parse_cpus(args.cpus, available=frozenset(os.sched_getaffinity(0)))
    except ValueError as error:
        parser.error(f"--cpus: {error}")
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="inference-fabric-"))
    return StackConfig(
        state_dir=state_dir.resolve(),
        num_workers=args.num_workers,
        model_repository=args.model_repository.resolve(),
        is_ephemeral=args.ephemeral_ports,
        redis_port=find_free_port() if args.ephemeral_ports else args.redis_port,
        ready_file=args.ready_file,
        extra_worker_args=tuple(args.worker_arg),
        extra_gateway_args=tuple(args.gateway_arg),
        ready_timeout_s=args.ready_timeout_s,
        stop_timeout_s=args.stop_timeout_s,
        tolerate_exits=args.tolerate_exits,
        extra_jobs_args=tuple(args.jobs_arg),
        cpus=cpus,
        num_routers=args.num_routers,
        is_state_temporary=args.state_dir is None,
    )


def parse_cpus(specs: list[str], *, available: frozenset[int]) -> dict[str, frozenset[int]]:
    """`TIERS=CPUS` entries -> {tier: CPUs}. Raises ValueError naming the entry at fault: an
    unknown tier, a tier named twice, or a CPU this process may not run on."""
    pinned: dict[str, frozenset[int]] = {}
    for spec in specs:
        tiers, _, cpu_list = spec.partition("=")
        cpus = frozenset(_cpu_ids(cpu_list, spec))
        if not cpus <= available:
            raise ValueError(f"{spec!r}: CPUs {sorted(cpus - available)} are not available"
                             f" (this machine offers {sorted(available)})")  # fmt: skip
        for tier in (t.strip() for t in tiers.split(",")):
            if tier not in TIERS:
                raise ValueError(f"{spec!r}: unknown tier {tier!r} (tiers: {', '.join(TIERS)})")
            if tier in pinned:
                raise ValueError(f"{spec!r}: tier {tier!r} is pinned twice")
            pinned[tier] = cpus
    return pinned


def _cpu_ids(cpu_list: str, spec: str) -> list[int]:
    ids: list[int] = []
    for part in cpu_list.split(","):
        low, _, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(
                f"{spec!r}: expected TIERS=CPUS such as worker=1 or gateway=0-1"
            ) from None
        if first < 0 or last < first:
            raise ValueError(f"{spec!r}: {part!r} is not a CPU range")
        ids.extend(range(first, last + 1))
    return ids
