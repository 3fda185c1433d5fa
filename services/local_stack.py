"""`python -m services.local_stack`: the whole fabric on loopback — redis, router, workers, gateway.

Each tier runs as its own child process, as in production. The launcher owns them: it starts them
in dependency order (redis → router → workers → gateway), waits until each is ready, and stops
them front to back (gateway first, so no new request enters while the tiers behind it drain).

Redis runs with the fabric's ACL (services.common.redis_acl) and new random passwords on every
start, kept in `<state-dir>/redis-acl/`: the router and the workers get their role's password
file (`--redis-password-file`, never the password itself on a command line); `admin-password`
there is for you (`redis-cli --user admin --pass "$(cat .../admin-password)"`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.metric_names import ROUTER_LIVE_WORKERS
from services.common.processes import (
    ChildProcess,
    ProcessError,
    launch,
    request_stop,
    wait_or_kill,
    wait_ready,
)
from services.common.redis_acl import (
    ADMIN,
    GATEWAY,
    ROUTER,
    WORKER,
    new_passwords,
    password_file_name,
    write_acl_files,
)
from services.common.redis_server import find_free_port, ping, redis_command

HOST = "127.0.0.1"
# SIGINT/SIGTERM ask the launcher to stop; SIGCHLD says a child exited. All three stay blocked and
# are taken with sigtimedwait, so none can arrive between a check and the wait that follows it.
WAKE_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGCHLD}
# Shutdown order: a tier stops only after every tier that sends it requests has stopped.
STOP_ORDER = ("gateway", "worker", "router", "redis")
# For the banner's grpcurl example: the gateway's own Predict on the default model.
EXAMPLE_PREDICT = '{"model_name": "minilm", "inputs": [{"text": "hello world"}]}'
PREDICT_RPC = "inference.v1.InferenceService/Predict"


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


@dataclass
class Child(ChildProcess):
    """One tier's process. Its ready file holds {grpc_port, metrics_port}; Redis has none (it is
    ready on PONG)."""

    tier: str = ""
    #: Ports as reported once ready ({"port"} for Redis).
    ports: dict[str, int] = field(default_factory=dict)


#: A tier failed to start or exited on its own; the message names it and quotes its log.
StackError = ProcessError


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: stop every tier and exit 0."""


def parse_config(argv: list[str] | None = None) -> StackConfig:
    parser = argparse.ArgumentParser(
        prog="python -m services.local_stack",
        description="Run redis, router, GPU workers and gateway on loopback until Ctrl-C.",
    )
    parser.add_argument("--num-workers", type=int, default=1, help="ids worker-0, worker-1, ...")
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="logs and ready files (default: a new tmp dir)"
    )
    parser.add_argument("--ready-file", type=Path, default=None, help="JSON of every tier's ports")
    parser.add_argument(
        "--ephemeral-ports", action="store_true", help="free ports everywhere instead of 8001..."
    )
    parser.add_argument(
        "--redis-port", type=int, default=6379, help="ignored with --ephemeral-ports"
    )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra worker argument, repeatable; write --worker-arg=--flag=value",
    )
    parser.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="extra gateway argument, repeatable; write --gateway-arg=--flag=value",
    )
    parser.add_argument(
        "--ready-timeout-s", type=float, default=180.0, help="per tier; workers load models"
    )
    parser.add_argument(
        "--stop-timeout-s", type=float, default=60.0, help="per tier, after SIGTERM, then SIGKILL"
    )
    parser.add_argument(
        "--tolerate-exits", action="store_true", help="keep running if a tier exits once up"
    )
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error("--num-workers must be at least 1")
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
    )


def spawn(config: StackConfig, name: str, tier: str, argv: list[str], *, has_ready: bool) -> Child:
    """Starts one tier with its output in `<state_dir>/<name>.log`."""
    launched = launch(
        name,
        argv,
        log_path=config.state_dir / f"{name}.log",
        ready_file=config.state_dir / f"{name}.ready.json" if has_ready else None,
        # Own session: Ctrl-C in the terminal reaches only the launcher, which then stops the
        # tiers in order; otherwise every tier would get SIGINT at once.
        own_session=True,
        # SIGTERM every tier when the launcher dies, even by SIGKILL. The launcher forks only
        # from its main thread, which lives as long as it.
        dies_with_parent=True,
    )
    ports = {} if has_ready else {"port": config.redis_port}
    return Child(**vars(launched), tier=tier, ports=ports)


def wait_event(children: list[Child], timeout_s: float | None) -> None:
    """Waits for a signal (up to `timeout_s`; None: forever); raises on SIGINT/SIGTERM or exit."""
    if timeout_s is None:
        info: signal.struct_siginfo | None = signal.sigwaitinfo(WAKE_SIGNALS)
    else:
        info = signal.sigtimedwait(WAKE_SIGNALS, timeout_s)
    if info is not None and info.si_signo != signal.SIGCHLD:
        raise Interrupted(signal.Signals(info.si_signo).name)
    # SIGCHLDs coalesce, so every child is checked, not only the one that signalled.
    for child in children:
        error = child.exit_error()
        if error is not None:
            raise error


def is_ready(child: Child) -> bool:
    if child.ready_file is None:
        return ping(child.ports["port"])
    ready = child.read_ready()
    if ready is None:
        return False
    # The gateway also reports its HTTP port (-1: none).
    child.ports = {key: int(ready[key]) for key in ("grpc_port", "metrics_port", "http_port")
                   if key in ready}  # fmt: skip
    return True


def sees_workers(router: Child, num_workers: int) -> bool:
    """True once the router's registry snapshot holds `num_workers` live workers. The router
    re-reads Redis periodically; before that, a first request would find no worker."""
    url = f"http://{HOST}:{router.ports['metrics_port']}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            lines = response.read().decode().splitlines()
    except OSError:
        return False
    live = [float(line.split()[1]) for line in lines if line.startswith(ROUTER_LIVE_WORKERS + " ")]
    return bool(live) and live[0] >= num_workers


def wait_tiers(
    config: StackConfig,
    waiting: list[Child],
    children: list[Child],
    is_done: Callable[[Child], bool] = is_ready,
    what: str = "ready",
) -> None:
    """Waits until `is_done` holds for every tier in `waiting`; between checks, wakes on signals
    (SIGINT/SIGTERM raise Interrupted) and on any child's exit (StackError)."""
    wait_ready(
        waiting,
        timeout_s=config.ready_timeout_s,
        is_ready=is_done,
        what=what,
        watched=children,
        pause=lambda timeout_s: wait_event(children, timeout_s),
    )


def start(config: StackConfig, children: list[Child]) -> None:
    """Starts every tier in dependency order, appending each to `children` as soon as it exists
    (so that the caller can stop whatever was started if a later tier fails)."""
    redis_dir = config.state_dir / "redis"
    redis_dir.mkdir(exist_ok=True)
    passwords = new_passwords()
    acl_file = write_acl_files(config.redis_acl_dir, passwords)
    try:
        redis_argv = redis_command(
            config.redis_port, appendonly=False, dir=redis_dir, acl_file=acl_file
        )
    except FileNotFoundError as error:
        raise StackError(str(error)) from None
    children.append(spawn(config, "redis", "redis", redis_argv, has_ready=False))
    admin = (ADMIN, passwords[ADMIN])
    wait_tiers(config, children[-1:], children, lambda c: ping(c.ports["port"], auth=admin))

    python = [sys.executable, "-m"]
    grpc_port, metrics_port = config.ports(8101)
    router_argv = [*python, "services.router", "--host", HOST,
                   "--grpc-port", grpc_port, "--metrics-port", metrics_port,
                   "--redis-url", config.redis_url,
                   "--redis-password-file", config.redis_password_file(ROUTER)]  # fmt: skip
    router = spawn(config, "router", "router", router_argv, has_ready=True)
    children.append(router)
    wait_tiers(config, [router], children)

    # Workers load models in parallel; each is waited for after all have started.
    workers: list[Child] = []
    for i in range(config.num_workers):
        grpc_port, metrics_port = config.ports(8201 + 10 * i)
        worker_argv = [*python, "services.gpu_worker", "--host", HOST,
                       "--grpc-port", grpc_port, "--metrics-port", metrics_port,
                       "--model-repository", str(config.model_repository),
                       "--redis-url", config.redis_url, "--worker-id", f"worker-{i}",
                       "--redis-password-file", config.redis_password_file(WORKER),
                       *config.extra_worker_args]  # fmt: skip
        workers.append(spawn(config, f"worker-{i}", "worker", worker_argv, has_ready=True))
        children.append(workers[-1])
    wait_tiers(config, workers, children)
    wait_tiers(config, [router], children, lambda r: sees_workers(r, config.num_workers),
               what=f"showing {config.num_workers} {ROUTER_LIVE_WORKERS}")  # fmt: skip

    grpc_port, metrics_port = config.ports(8001)
    gateway_argv = [*python, "services.gateway", "--host", HOST,
                    "--grpc-port", grpc_port, "--metrics-port", metrics_port,
                    "--http-port", "0" if config.is_ephemeral else "8000",
                    "--router-address", f"{HOST}:{router.ports['grpc_port']}",
                    "--model-repository", str(config.model_repository),
                    # Tenants' quotas hold across gateways through Redis.
                    "--redis-url", config.redis_url,
                    "--redis-password-file", config.redis_password_file(GATEWAY),
                    *config.extra_gateway_args]  # fmt: skip
    if not any(arg.startswith("--api-keys-file") for arg in config.extra_gateway_args):
        # A local development stack: no API keys, said out loud (fail-closed otherwise;
        # see services/gateway/config.py).
        gateway_argv.append("--allow-unauthenticated")
    children.append(spawn(config, "gateway", "gateway", gateway_argv, has_ready=True))
    wait_tiers(config, children[-1:], children)


def describe(config: StackConfig, children: list[Child]) -> dict[str, object]:
    """The launcher's ready-file contents: every tier's ports and pid."""
    by_tier = {c.tier: {**c.ports, "pid": c.process.pid} for c in children}
    return {
        "gateway": by_tier["gateway"],
        "router": by_tier["router"],
        "workers": [
            {"worker_id": c.name, **c.ports, "pid": c.process.pid}
            for c in children
            if c.tier == "worker"
        ],
        "redis": {**by_tier["redis"], "acl_dir": str(config.redis_acl_dir)},
        "state_dir": str(config.state_dir),
    }


def announce(config: StackConfig, children: list[Child]) -> None:
    if config.ready_file is not None:
        # Written whole and renamed, so a reader never sees half a file.
        partial = config.ready_file.with_name(config.ready_file.name + ".partial")
        partial.write_text(json.dumps(describe(config, children), indent=2))
        os.replace(partial, config.ready_file)
    lines = ["", "inference-fabric is up on loopback:"]
    for c in children:
        if c.tier == "redis":
            admin = f"user admin, password in {config.redis_password_file(ADMIN)}"
            lines.append(f"  {c.name:<10} {config.redis_url:<28} pid {c.process.pid:<8} {admin}")
        else:
            address = f"{HOST}:{c.ports['grpc_port']}"
            metrics = f"http://{HOST}:{c.ports['metrics_port']}/metrics"
            lines.append(f"  {c.name:<10} {address:<28} pid {c.process.pid:<8} {metrics}")
    gateway_ports = next(c for c in children if c.tier == "gateway").ports
    gateway = f"{HOST}:{gateway_ports['grpc_port']}"
    rest = f"http://{HOST}:{gateway_ports.get('http_port', -1)}"
    lines += [
        f"  {'REST':<10} {rest:<28} KServe v2 REST (/v2) and OpenAI-compatible API (/v1)",
        f"logs: {config.state_dir}/<name>.log",
        "try:",
        f'  python -m services.client --address {gateway} embed "hello world"',
        f"  curl -s {rest}/v2/models/minilm",
        f"  grpcurl -plaintext -d '{EXAMPLE_PREDICT}' {gateway} {PREDICT_RPC}",
        f"  grpcurl -plaintext {gateway} list",
        "Ctrl-C stops every tier, gateway first.",
    ]
    print("\n".join(lines), flush=True)


def run_until_stopped(config: StackConfig, children: list[Child]) -> None:
    """Never returns: raises Interrupted, or StackError once a tier exits (unless tolerated)."""
    watched = list(children)
    while True:
        try:
            wait_event(watched, timeout_s=None)
        except StackError as error:
            if not config.tolerate_exits:
                raise
            print(f"warning: {error}\ngoing on without it (--tolerate-exits)", file=sys.stderr,
                  flush=True)  # fmt: skip
            watched = [c for c in watched if c.process.poll() is None]


def stop_all(config: StackConfig, children: list[Child]) -> list[str]:
    """SIGTERMs the tiers front to back, each tier's processes together; SIGKILLs any that outlast
    `stop_timeout_s`. Returns a line for each process that did not exit cleanly."""
    problems = []
    for tier in STOP_ORDER:
        running = [c for c in children if c.tier == tier and c.process.poll() is None]
        for child in running:
            request_stop(child.process)
        for child in running:
            code = wait_or_kill(child.process, config.stop_timeout_s)
            if code is None:
                problems.append(f"{child.name} killed after {config.stop_timeout_s:.0f} s")
            elif code != 0:
                problems.append(f"{child.name} exited with code {code} after SIGTERM")
    return problems


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    config.state_dir.mkdir(parents=True, exist_ok=True)
    print(f"state (logs, ready files, redis files): {config.state_dir}", flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, WAKE_SIGNALS)
    children: list[Child] = []
    exit_code = 1
    try:
        start(config, children)
        announce(config, children)
        run_until_stopped(config, children)
    except Interrupted as interrupt:
        print(f"{interrupt}: stopping gateway, workers, router, redis", flush=True)
        exit_code = 0
    except StackError as error:
        print(f"error: {error}\nstopping every tier", file=sys.stderr, flush=True)
    finally:
        problems = stop_all(config, children)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr, flush=True)
    raise SystemExit(1 if problems else exit_code)


if __name__ == "__main__":
    main()
