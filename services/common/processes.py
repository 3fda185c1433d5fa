"""Child processes for whoever starts the tiers: `services.local_stack`, the tests, the benchmark.

A tier is launched with its output in a log file and announces readiness by writing a ready file
(services.common.lifecycle.write_ready_file), which cannot be awaited, only looked for. Waiting
notices a child that exits instead and quotes the tail of its log. Stopping is SIGTERM, a bounded
wait, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from services.common.beats import HUNG_S, BeatWatch

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: How often a ready check is repeated while waiting.
READY_POLL_S = 0.1
#: Lines of a child's log quoted when it fails.
NUM_TAIL_LINES = 30


class ProcessError(Exception):
    """A child failed to start: it exited, or was not ready in time. The message names it and
    quotes its log."""


@dataclass
class ChildProcess:
    """A launched process, where its output goes, and where it announces readiness."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    #: Where the child writes its ready JSON; None for one ready by another sign (Redis: PONG).
    ready_file: Path | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, num_lines: int = NUM_TAIL_LINES) -> str:
        lines = self.log().splitlines()[-num_lines:]
        return "\n".join(f"  | {line}" for line in lines)

    def exit_error(self) -> ProcessError | None:
        """The error to raise if the child has exited; None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        return ProcessError(
            f"{self.name} exited with code {code}; {self.log_path}:\n{self.log_tail()}"
        )

    def read_ready(self) -> dict[str, Any] | None:
        """The ready file's JSON; None until it is written (or while it is half-written)."""
        if self.ready_file is None:
            raise ValueError(f"{self.name} has no ready file")
        try:
            return dict(json.loads(self.ready_file.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def terminate(self, timeout_s: float) -> int | None:
        """SIGTERM, wait up to `timeout_s`; SIGKILL past that. The exit code, or None when the
        child had to be killed."""
        request_stop(self.process)
        return wait_or_kill(self.process, timeout_s)


def launch(
    name: str,
    argv: Sequence[str],
    *,
    log_path: Path,
    ready_file: Path | None = None,
    cwd: Path | None = None,
    append_log: bool = False,
    own_session: bool = False,
    dies_with_parent: bool = False,
    cpus: frozenset[int] | None = None,
) -> ChildProcess:
    """Starts `argv` with stdout and stderr in `log_path`; with `ready_file`, appends
    `--ready-file <path>` to it (an old file there is removed first: it would read as ready).

    `own_session`: Ctrl-C in the terminal reaches only the caller, not the child.
    `dies_with_parent`: the child gets SIGTERM when the caller dies, even by SIGKILL; the caller
    must launch from its main thread (the kernel ties this to the forking thread).
    `cpus`: the child and every thread it starts run only on these CPUs (set before exec).
    """
    args = list(argv)
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)
        args += ["--ready-file", str(ready_file)]
    with log_path.open("ab" if append_log else "wb") as log_file:
        process = subprocess.Popen(
            args,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=own_session,
            preexec_fn=before_exec(os.getpid() if dies_with_parent else None, cpus),
        )
    return ChildProcess(name, process, log_path, ready_file)


def before_exec(parent_pid: int | None, cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """What a child does between fork and exec (`Popen`'s preexec_fn): get SIGTERM when
    `parent_pid` dies (fork from the main thread: the kernel ties this to the forking thread),
    run on `cpus`."""
    if parent_pid is None and cpus is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True) if parent_pid is not None else None

    def hook() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if libc is None:
            return
        # A blocked signal mask survives exec; the child must see its own SIGTERM.
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return hook


def has_written_ready_file(child: ChildProcess) -> bool:
    return child.read_ready() is not None


Child = TypeVar("Child", bound=ChildProcess)


def wait_ready(
    waiting: Sequence[Child],
    *,
    timeout_s: float,
    is_ready: Callable[[Child], bool] = has_written_ready_file,
    what: str = "ready",
    watched: Sequence[ChildProcess] = (),
    pause: Callable[[float], None] = time.sleep,
    poll_s: float = READY_POLL_S,
) -> None:
    """Returns once `is_ready` holds for every child in `waiting`, all within `timeout_s`.

    Raises ProcessError when one of `waiting` or `watched` exits, or time runs out. Checks are
    `poll_s` apart; `pause(s)` waits between them (a launcher passes one that also wakes on its
    signals).
    """
    deadline = time.monotonic() + timeout_s
    checked: list[ChildProcess] = [*waiting, *watched]
    for child in waiting:
        while not is_ready(child):
            for other in checked:
                error = other.exit_error()
                if error is not None:
                    raise error
            if time.monotonic() > deadline:
                raise ProcessError(f"{child.name} not {what} within {timeout_s:.0f} s; "
                                   f"{child.log_path}:\n{child.log_tail()}")  # fmt: skip
            pause(poll_s)


def start_and_wait(
    name: str,
    argv: Sequence[str],
    *,
    log_path: Path,
    ready_file: Path,
    timeout_s: float,
    cwd: Path | None = None,
) -> tuple[ChildProcess, dict[str, Any]]:
    """Launches a child that writes `ready_file`, waits for it, returns the child and the file's
    JSON. On failure the child is killed and ProcessError raised."""
    child = launch(name, argv, log_path=log_path, ready_file=ready_file, cwd=cwd)
    try:
        wait_ready([child], timeout_s=timeout_s)
    except BaseException:
        child.process.kill()
        child.process.wait()
        raise
    ready = child.read_ready()
    if ready is None:  # cannot happen: wait_ready saw the file, and it is only ever replaced whole
        raise ProcessError(f"{name}: {ready_file} vanished")
    return child, ready


#: Restart backoff of a supervisor's children: doubles from the first to the cap while they
#: fail within `HEALTHY_RUN_S` of starting; one that ran longer restarts after the first.
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
HEALTHY_RUN_S = 60.0


def restart_backoff(ran_s: float, previous_s: float) -> float:
    """How long to wait before restarting a child that exited after `ran_s`, whose previous
    backoff was `previous_s` (0 for none)."""
    if ran_s >= HEALTHY_RUN_S or previous_s == 0:
        return FIRST_BACKOFF_S
    return min(MAX_BACKOFF_S, previous_s * 2)


@dataclass
class Supervised:
    """One child of a supervisor (a gateway group's process, a worker engine's front)."""

    index: int
    process: subprocess.Popen[bytes]
    ready_file: Path
    started_s: float
    #: Its own /metrics port once it is ready; None before.
    metrics_port: int | None = None
    #: What its supervisor has seen of its beats (services.common.beats).
    beats: BeatWatch = field(default_factory=BeatWatch)

    def kill_if_hung(self, what: str, now_s: float) -> None:
        """Kills it (to be restarted once its exit is read) if it has not beaten for HUNG_S;
        ask only once it listens. `what` names it in the log ("gateway process")."""
        if not self.beats.is_hung(self.ready_file, now_s):
            return
        log.error(
            "%s %d (pid %d) has not beaten for %.0fs (its event loop hung, or stopped): "
            "killed, to be restarted", what, self.index, self.process.pid, HUNG_S,
        )  # fmt: skip
        self.process.kill()
        self.beats.killed(now_s)

    def read_ready(self) -> dict[str, Any] | None:
        """Its ready file, recording its metrics port; None until it is written (whole, by
        rename)."""
        try:
            ready = dict(json.loads(self.ready_file.read_text()))
        except FileNotFoundError:
            return None
        self.metrics_port = int(ready["metrics_port"])
        return ready

    def exited(self) -> None:
        """Forgets its ready file, which its restart writes anew: a dead child is not ready."""
        self.metrics_port = None
        self.ready_file.unlink(missing_ok=True)


class Restarts:
    """When a supervisor restarts its children that exit: each after its own backoff
    (`restart_backoff`), logged. Children are known by index; the clock is the caller's
    (`now_s`, monotonic)."""

    def __init__(self, what: str) -> None:
        #: How the log names a child: "gateway process", "worker front".
        self._what = what
        self._backoff_s: dict[int, float] = {}
        self._at_s: dict[int, float] = {}

    def exited(self, index: int, pid: int, code: int, ran_s: float, now_s: float) -> None:
        """Child `index` exited after running `ran_s`: schedules its restart."""
        backoff_s = self._schedule(index, ran_s, now_s)
        log.error(
            "%s %d (pid %d) exited with code %d after %.1f s; restarting in %.1f s",
            self._what,
            index,
            pid,
            code,
            ran_s,
            backoff_s,
        )

    def start_due(self, now_s: float, start: Callable[[int], None]) -> int:
        """Starts (`start(index)`) every child whose restart time has come; one that cannot be
        started (an OSError: no memory, no file descriptors, its files gone) is logged and
        tried again after the next backoff, instead of ending the supervisor's loop. Returns
        how many were started."""
        started = 0
        for index in self.due(now_s):
            try:
                start(index)
            except OSError as error:
                backoff_s = self._schedule(index, 0.0, now_s)
                log.error(
                    "%s %d could not be started (%s); trying again in %.1f s",
                    self._what,
                    index,
                    error,
                    backoff_s,
                )
            else:
                started += 1
        return started

    def _schedule(self, index: int, ran_s: float, now_s: float) -> float:
        """Schedules child `index`'s next start after its backoff; returns the backoff."""
        backoff_s = restart_backoff(ran_s, self._backoff_s.get(index, 0.0))
        self._backoff_s[index] = backoff_s
        self._at_s[index] = now_s + backoff_s
        return backoff_s

    def is_pending(self, index: int) -> bool:
        return index in self._at_s

    def due(self, now_s: float) -> list[int]:
        """The children whose restart time has come (no longer pending once returned)."""
        indexes = [index for index, at_s in self._at_s.items() if at_s <= now_s]
        for index in indexes:
            del self._at_s[index]
        return indexes

    def next_in_s(self, now_s: float) -> float | None:
        """Seconds until the next restart is due; None when none is pending."""
        return min((at_s - now_s for at_s in self._at_s.values()), default=None)


#: Set by a supervisor in the environment of the processes it starts on one set of ports (a
#: gateway group's, a worker's fronts): only they bind a port another process holds.
SHARED_PORTS_ENV = "FABRIC_SHARED_PORTS"


def shares_ports() -> bool:
    """Whether this process binds its ports beside others (SO_REUSEPORT): a member of a
    supervisor's group. A process on its own does not: with grpc's default (on), a second
    router or worker started on a port another one holds bound it too, silently, and the
    kernel split connections between them (review finding)."""
    return os.environ.get(SHARED_PORTS_ENV) == "1"


def shared_ports_env() -> dict[str, str]:
    """The environment of a process a supervisor starts on its ports (`shares_ports`)."""
    return {**os.environ, SHARED_PORTS_ENV: "1"}


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to `port` (0: a free one) with SO_REUSEPORT that never listens: the
    kernel hands connections only to listeners, so processes started later bind the same
    port and share its connections. Keep it open while they run."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reserved = socket.socket(family, socket.SOCK_STREAM)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind((host, port))
    return reserved


def request_stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, unless the process has already exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)


def wait_or_kill(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """Waits up to `timeout_s` for the exit code; SIGKILLs past that and returns None."""
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None
