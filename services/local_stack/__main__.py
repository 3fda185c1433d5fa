"""`python -m services.local_stack`: starts every tier in dependency order, announces them,
and stops them front to back (see the package docstring)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TextIO

from services.common.metric_names import ROUTER_LIVE_WORKERS
from services.common.redis_acl import (
    ADMIN,
    GATEWAY,
    JOBS,
    ROUTER,
    WORKER,
    new_passwords,
    write_acl_files,
)
from services.common.redis_server import ping, redis_command
from services.local_stack.children import (
    WAKE_SIGNALS,
    Child,
    Interrupted,
    StackError,
    sees_workers,
    spawn,
    stop_all,
    wait_event,
    wait_tiers,
)
from services.local_stack.config import (
    EXAMPLE_PREDICT,
    HOST,
    PREDICT_RPC,
    StackConfig,
    parse_config,
)


def start(config: StackConfig, children: list[Child]) -> None:
    """Starts every tier in dependency order, appending each to `children` as soon as it exists
    (so that the caller can stop whatever was started if a later tier fails)."""
    start_redis(config, children)
    routers = start_router_and_workers(config, children)
    gateway = start_gateway(config, children, routers)
    start_job_runner(config, children, gateway)


def start_redis(config: StackConfig, children: list[Child]) -> None:
    redis_dir = config.state_dir / "redis"
    redis_dir.mkdir(exist_ok=True)
    passwords = new_passwords()
    acl_file = write_acl_files(config.redis_acl_dir, passwords)
    try:
        # AOF on, fsync once a second: durable batch jobs survive a Redis restart, losing at
        # most the last second of writes on a crash (README "Durable batch jobs").
        redis_argv = redis_command(
            config.redis_port, appendonly=True, dir=redis_dir, acl_file=acl_file
        )
    except FileNotFoundError as error:
        raise StackError(str(error)) from None
    children.append(spawn(config, "redis", "redis", redis_argv, has_ready=False))
    admin = (ADMIN, passwords[ADMIN])
    wait_tiers(config, children[-1:], children, lambda c: ping(c.ports["port"], auth=admin))


def start_router_and_workers(config: StackConfig, children: list[Child]) -> list[Child]:
    """The routers, then the workers (loading in parallel); returns the routers once each
    sees every worker."""
    python = [sys.executable, "-m"]
    routers: list[Child] = []
    for i in range(config.num_routers):
        grpc_port, metrics_port = config.ports(8101 + 10 * i)
        router_argv = [*python, "services.router", "--host", HOST,
                       "--grpc-port", grpc_port, "--metrics-port", metrics_port,
                       "--redis-url", config.redis_url,
                       "--redis-password-file", config.redis_password_file(ROUTER)]  # fmt: skip
        name = "router" if config.num_routers == 1 else f"router-{i}"
        routers.append(spawn(config, name, "router", router_argv, has_ready=True))
        children.append(routers[-1])
    wait_tiers(config, routers, children)

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
    wait_tiers(config, routers, children, lambda r: sees_workers(r, config.num_workers),
               what=f"showing {config.num_workers} {ROUTER_LIVE_WORKERS}")  # fmt: skip
    return routers


def start_gateway(config: StackConfig, children: list[Child], routers: list[Child]) -> Child:
    """The gateway, spreading its calls over every router."""
    python = [sys.executable, "-m"]
    grpc_port, metrics_port = config.ports(8001)
    gateway_argv = [*python, "services.gateway", "--host", HOST,
                    "--grpc-port", grpc_port, "--metrics-port", metrics_port,
                    "--http-port", "0" if config.is_ephemeral else "8000",
                    "--router-address",
                    ",".join(f"{HOST}:{r.ports['grpc_port']}" for r in routers),
                    "--model-repository", str(config.model_repository),
                    # Tenants' quotas hold across gateways through Redis.
                    "--redis-url", config.redis_url,
                    "--redis-password-file", config.redis_password_file(GATEWAY),
                    *config.extra_gateway_args]  # fmt: skip
    if not any(arg.startswith("--api-keys-file") for arg in config.extra_gateway_args):
        # A local development stack: no API keys, said out loud (fail-closed otherwise;
        # see services/gateway/config.py).
        gateway_argv.append("--allow-unauthenticated")
    gateway = spawn(config, "gateway", "gateway", gateway_argv, has_ready=True)
    children.append(gateway)
    wait_tiers(config, children[-1:], children)
    return gateway


def start_job_runner(config: StackConfig, children: list[Child], gateway: Child) -> None:
    python = [sys.executable, "-m"]
    _, metrics_port = config.ports(8300)  # the runner serves only metrics: 8301
    jobs_argv = [*python, "services.jobs", "--host", HOST, "--metrics-port", metrics_port,
                 "--gateway-address", f"{HOST}:{gateway.ports['grpc_port']}",
                 "--redis-url", config.redis_url,
                 "--redis-password-file", config.redis_password_file(JOBS),
                 *config.extra_jobs_args]  # fmt: skip
    children.append(spawn(config, "jobs", "jobs", jobs_argv, has_ready=True))
    wait_tiers(config, children[-1:], children)


def describe(config: StackConfig, children: list[Child]) -> dict[str, object]:
    """The launcher's ready-file contents: every tier's ports and pid."""
    by_tier = {c.tier: {**c.ports, "pid": c.process.pid} for c in children}
    routers = [(c.name, {**c.ports, "pid": c.process.pid}) for c in children
               if c.tier == "router"]  # fmt: skip
    return {
        "gateway": by_tier["gateway"],
        # The first router alone, for readers of a one-router stack; "routers" has them all.
        "router": routers[0][1],
        "routers": [{"name": name, **router} for name, router in routers],
        "jobs": by_tier["jobs"],
        "workers": [
            {"worker_id": c.name, **c.ports, "pid": c.process.pid}
            for c in children
            if c.tier == "worker"
        ],
        "redis": {**by_tier["redis"], "acl_dir": str(config.redis_acl_dir)},
        "state_dir": str(config.state_dir),
    }


def interpreter() -> str:
    """This Python as a command that works from where the stack was started (the venv's
    `.venv/bin/python` under `make run`, not a bare `python` that may lack the packages)."""
    path = Path(sys.executable)
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


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
            # The job runner serves no gRPC: it only calls the gateway.
            address = f"{HOST}:{c.ports['grpc_port']}" if c.tier != "jobs" else "(no gRPC port)"
            metrics = f"http://{HOST}:{c.ports['metrics_port']}/metrics"
            lines.append(f"  {c.name:<10} {address:<28} pid {c.process.pid:<8} {metrics}")
    gateway_ports = next(c for c in children if c.tier == "gateway").ports
    gateway = f"{HOST}:{gateway_ports['grpc_port']}"
    rest = f"http://{HOST}:{gateway_ports.get('http_port', -1)}"
    lines += [
        f"  {'REST':<10} {rest:<28} KServe v2 REST (/v2) and OpenAI-compatible API (/v1)",
        f"logs: {config.state_dir}/<name>.log",
        "try:",
        f'  {interpreter()} -m services.client --address {gateway} embed "hello world"',
        f"  curl -s {rest}/v2/models/minilm",
        "and, with grpcurl installed:",
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


#: What the tiers read from the environment (services.common.settings: `<TIER>_<NAME>`).
TIER_VARIABLE_PREFIXES = ("GATEWAY_", "ROUTER_", "WORKER_", "JOBS_")


def say(text: str, file: TextIO | None = None) -> None:
    """Prints `text`, unless the terminal is gone (a hang-up: SIGHUP stops the stack, and a
    print then raised EIO past the stop's clean-up, leaving its state dir: review finding)."""
    with contextlib.suppress(OSError):
        print(text, file=file or sys.stdout, flush=True)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    config.state_dir.mkdir(parents=True, exist_ok=True)
    removed = " (removed at a clean stop)" if config.is_state_temporary else ""
    say(f"state (logs, ready files, redis files){removed}: {config.state_dir}")
    # The tiers read these too: one left in the shell (GATEWAY_API_KEYS_FILE turned the
    # gateway's keys on, every call of the banner's then UNAUTHENTICATED) is said (review).
    if inherited := sorted(v for v in os.environ if v.startswith(TIER_VARIABLE_PREFIXES)):
        say(f"note: the tiers also read from your environment: {', '.join(inherited)}")
    signal.pthread_sigmask(signal.SIG_BLOCK, WAKE_SIGNALS)
    children: list[Child] = []
    exit_code = 1
    try:
        start(config, children)
        announce(config, children)
        run_until_stopped(config, children)
    except Interrupted as interrupt:
        say(f"{interrupt}: stopping job runner, gateway, workers, router, redis")
        exit_code = 0
    except StackError as error:
        say(f"error: {error}\nstopping every tier", sys.stderr)
    except Exception as error:  # a bug, or a file it cannot write (--ready-file): the stop runs
        say(f"error: {type(error).__name__}: {error}\nstopping every tier", sys.stderr)
    finally:
        problems = stop_all(config, children)
    for problem in problems:
        say(f"error: {problem}", sys.stderr)
    code = 1 if problems else exit_code
    keep_or_remove_state(config, is_clean=code == 0)
    raise SystemExit(code)


def keep_or_remove_state(config: StackConfig, *, is_clean: bool) -> None:
    """A tmp state dir made for the run is removed after a clean stop (each run made one, and
    they piled up in /tmp: review finding); after a failure its logs are kept, and said so."""
    if not config.is_state_temporary:
        return
    if is_clean:
        shutil.rmtree(config.state_dir, ignore_errors=True)
    else:
        say(f"logs kept in {config.state_dir}", sys.stderr)


if __name__ == "__main__":
    main()
