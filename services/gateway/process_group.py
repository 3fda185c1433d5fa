"""Several gateway processes on one set of ports (`--processes N`): one event loop per core.

A gateway is one Python event loop, so one core: on this project's machines one process
handles about 3k tiny calls/s, and refuses at most about 900 calls/s of a flood. With N > 1,
`python -m services.gateway` becomes a supervisor that starts N ordinary gateways bound to the
same gRPC and HTTP ports with SO_REUSEPORT, and the kernel spreads incoming connections over
them (grpc sets the option on every listener; the HTTP listener asks for it). The supervisor:

- reserves the ports first with sockets that are bound but never listen (the kernel hands
  connections only to listeners), so port 0 picks one port for the whole group;
- serves the group's `/metrics` on the metrics port: every process's series labelled
  `gateway_process="<i>"`, so sums over the label are the pod's, plus its own restarts
  counter;
- restarts a process that exits, after a backoff that doubles while processes keep failing
  fast; a process that fails before the group is first ready fails the group (a bad setting
  would fail every restart the same way);
- kills, to restart it, a ready process that has not beaten for HUNG_S (services.common.beats:
  its event loop hung or stopped, while its share of the ports' connections hung with it);
- passes SIGTERM on and waits for every process to drain. Each process dies with the
  supervisor, even if it is killed.

Each process is a gateway in its own right: tenants' fleet-wide quotas are shared through
Redis as between gateways on different hosts (so `--processes` > 1 needs `--redis-url`), and
`--max-concurrent-rpcs` holds per process. The supervisor runs no gRPC and no event loop; it
forks only from its main thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import Counter

from services.common import metric_names as names
from services.common.beats import beat_file
from services.common.group_metrics import GroupMetrics
from services.common.lifecycle import start_metrics, write_ready_file
from services.common.processes import (
    Restarts,
    Supervised,
    before_exec,
    request_stop,
    reserve_port,
    shared_ports_env,
    wait_or_kill,
)
from services.gateway.config import GatewayConfig

log = logging.getLogger(__name__)

#: SIGINT/SIGTERM stop the group; SIGCHLD says a process exited. All three stay blocked and
#: are taken with sigtimedwait, so none arrives between a check and the wait after it.
WAKE_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGCHLD}
#: The label that tells the group's processes apart in its /metrics.
PROCESS_LABEL = "gateway_process"
#: How long the group may take to become ready.
READY_TIMEOUT_S = 120.0


class _StopRequested(Exception):
    """SIGTERM or SIGINT arrived before the group was ready: stop it, cleanly."""


class ProcessGroup:
    """The supervisor: starts, watches, restarts and stops the group's gateway processes."""

    def __init__(self, config: GatewayConfig, argv: list[str], num_processes: int) -> None:
        self.config = config
        self._argv = argv
        self._num_processes = num_processes
        self._reserved: list[socket.socket] = []
        self._members: dict[int, Supervised] = {}
        self._state_dir = Path(tempfile.mkdtemp(prefix="gateway-group-"))
        self._registry = GroupMetrics(self, PROCESS_LABEL)
        self._restarts_total = Counter(
            names.GATEWAY_PROCESS_RESTARTS_TOTAL.removesuffix("_total"),
            "Gateway processes of this group restarted after exiting on their own",
            registry=self._registry,
        )
        host = config.host
        self.scrape_host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        self.ports: dict[str, int] = {}

    def metrics_ports(self) -> dict[int, int]:
        """Each ready process's own /metrics port, by index."""
        members = list(self._members.values())
        return {m.index: m.metrics_port for m in members if m.metrics_port is not None}

    def run(self) -> int:
        """Serves until SIGTERM/SIGINT; the exit status (0: every process stopped cleanly)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, WAKE_SIGNALS)
        try:
            # First: a port taken fails the start before any process serves (StartupError).
            metrics_port = start_metrics(self.config.metrics_port, self.config.host, self._registry)
            self._reserve_ports()
            for index in range(self._num_processes):
                self._start(index)
            try:
                if (failed := self._wait_first_ready()) is not None:
                    return self._stop_all(status=failed)
            except _StopRequested:
                return self._stop_all(status=0)
            log.info(
                "gateway group of %d processes on %s:%d, HTTP on %d, metrics on %d",
                self._num_processes,
                self.config.host,
                self.ports["grpc_port"],
                self.ports["http_port"],
                metrics_port,
            )
            write_ready_file(self.config.ready_file, metrics_port=metrics_port, **self.ports)
            return self._supervise()
        finally:
            for reserved in self._reserved:
                reserved.close()
            shutil.rmtree(self._state_dir, ignore_errors=True)

    # -- ports ------------------------------------------------------------------------------

    def _reserve_ports(self) -> None:
        config = self.config
        self.ports["grpc_port"] = self._reserve(config.grpc_port)
        self.ports["http_port"] = -1 if config.http_port == -1 else self._reserve(config.http_port)
        if config.tls.health_port is not None:
            self.ports["health_port"] = self._reserve(config.tls.health_port)

    def _reserve(self, port: int) -> int:
        reserved = reserve_port(self.config.host, port)
        self._reserved.append(reserved)
        return int(reserved.getsockname()[1])

    # -- processes --------------------------------------------------------------------------

    def _start(self, index: int) -> None:
        ready_file = self._state_dir / f"gateway-{index}.ready.json"
        ready_file.unlink(missing_ok=True)
        beat_file(ready_file).unlink(missing_ok=True)
        overrides = [
            "--processes", "1",
            "--grpc-port", str(self.ports["grpc_port"]),
            "--http-port", str(self.ports["http_port"]),
            "--metrics-port", "0",
            "--ready-file", str(ready_file),
        ]  # fmt: skip
        if "health_port" in self.ports:
            overrides += ["--health-port", str(self.ports["health_port"])]
        process = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", *self._argv, *overrides],
            env=shared_ports_env(),
            stdin=subprocess.DEVNULL,
            # Output goes where the supervisor's goes: one log stream for the container.
            preexec_fn=before_exec(os.getpid(), None),
        )
        self._members[index] = Supervised(index, process, ready_file, time.monotonic())
        log.info("gateway process %d started (pid %d)", index, process.pid)

    def _read_ready(self, member: Supervised) -> bool:
        """True once `member` has written its ready file (its metrics port recorded)."""
        return member.metrics_port is not None or member.read_ready() is not None

    def _wait_first_ready(self) -> int | None:
        """Waits for every process's ready file; None once all wrote theirs, else the group's
        exit status: 2 if a process exited 2 first (a setting it could not use, which it
        named: settings.StartupError), else 1 (one exited otherwise, or time ran out).
        Raises _StopRequested on SIGTERM/SIGINT."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(self._read_ready(m) for m in self._members.values()):
            for member in self._members.values():
                if (code := member.process.poll()) is not None:
                    log.error(
                        "gateway process %d exited with code %d before the group was ready",
                        member.index,
                        code,
                    )
                    return 2 if code == 2 else 1
            if time.monotonic() > deadline:
                log.error("the gateway group was not ready within %.0f s", READY_TIMEOUT_S)
                return 1
            info = signal.sigtimedwait(WAKE_SIGNALS, 0.05)
            if info is not None and info.si_signo != signal.SIGCHLD:
                raise _StopRequested
        return None

    def _supervise(self) -> int:
        """Restarts processes that exit until a stop is asked for, then stops the group."""
        restarts = Restarts("gateway process")
        while True:
            now = time.monotonic()
            self._restarts_total.inc(restarts.start_due(now, self._start))
            for member in list(self._members.values()):
                is_ready = self._read_ready(member)
                code = member.process.poll()
                if code is None and is_ready:  # one hung is killed: its exit read next
                    member.kill_if_hung("gateway process", now)
                if code is None or restarts.is_pending(member.index):
                    continue
                member.exited()
                ran_s = now - member.started_s
                restarts.exited(member.index, member.process.pid, code, ran_s, now)
            next_in_s = restarts.next_in_s(now)
            wait_s = 1.0 if next_in_s is None else next_in_s
            info = signal.sigtimedwait(WAKE_SIGNALS, max(0.01, min(1.0, wait_s)))
            if info is not None and info.si_signo != signal.SIGCHLD:
                log.info("%s: stopping the gateway group", signal.Signals(info.si_signo).name)
                return self._stop_all(status=0)

    def _stop_all(self, status: int) -> int:
        """SIGTERMs every process, waits for each to drain (SIGKILL past its grace); `status`,
        or 1 if one did not stop cleanly."""
        running = [m for m in self._members.values() if m.process.poll() is None]
        for member in running:
            self._read_ready(member)  # whether it was ready (a failing start reads in order)
            request_stop(member.process)
        is_failing_start = status == 2
        for member in running:
            code = wait_or_kill(member.process, self.config.drain_grace_s + 15.0)
            # A process still starting has no handler yet: SIGTERM itself ends it, cleanly. In
            # a group failing at start-up (2: a setting it could not use), one not yet ready
            # that exited 2 before its stop was read met the same setting, and named it itself.
            if code in (0, -signal.SIGTERM) or (
                is_failing_start and code == 2 and member.metrics_port is None
            ):
                continue
            log.error("gateway process %d stopped with %s", member.index, code)
            status = 1
        return status
