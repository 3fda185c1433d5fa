"""The launcher's child processes: starting one, waiting for them, stopping them in order."""

from __future__ import annotations

import signal
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.metric_names import ROUTER_LIVE_WORKERS
from services.common.processes import (
    ChildProcess,
    ProcessError,
    launch,
    request_stop,
    wait_or_kill,
    wait_ready,
)
from services.common.redis_server import ping
from services.local_stack.config import HOST, StackConfig

# SIGINT/SIGTERM ask the launcher to stop, and SIGHUP (the terminal closed: it used to kill the
# launcher at once, its tiers then stopped by their parent-death signal, out of order), unless
# it was started ignoring SIGHUP (nohup); SIGCHLD says a child exited. All stay blocked and are
# taken with sigtimedwait, so none can arrive between a check and the wait that follows it.
WAKE_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGCHLD} | (
    set() if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else {signal.SIGHUP}
)
# Shutdown order: a tier stops only after every tier that sends it requests has stopped.
STOP_ORDER = ("jobs", "gateway", "worker", "router", "redis")


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
        cpus=config.cpus.get(tier),
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


#: Opens loopback URLs directly: urllib sends them through `http_proxy` unless `no_proxy` lists
#: them, and behind a proxy `make run` waited out its ready timeout for a healthy router
#: (review finding).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def sees_workers(router: Child, num_workers: int) -> bool:
    """True once the router's registry snapshot holds `num_workers` live workers. The router
    re-reads Redis periodically; before that, a first request would find no worker."""
    url = f"http://{HOST}:{router.ports['metrics_port']}/metrics"
    try:
        with _DIRECT.open(url, timeout=1.0) as response:
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
