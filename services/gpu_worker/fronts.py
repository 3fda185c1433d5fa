"""The engine's front processes (`--front-processes N`; services.gpu_worker.front).

The engine reserves the worker's gRPC port (and its plaintext health port, if any) with
sockets bound with SO_REUSEPORT that never listen, so port 0 picks one port for all fronts,
and starts N fronts bound to it. It restarts a front that exits, after a backoff that doubles
while fronts keep failing fast, kills (to restart) a front whose beats stop for HUNG_S (hung),
and stops them once its own drain is done (a front then tells its routers `closing` and ends
its streams). A worker none of whose fronts has listened for NONE_LISTENING_S stops serving,
as for a fatal error (its registry entry draining). A front dies with the engine (SIGTERM
from the kernel), so a worker never outlives its engine. The worker's `/metrics` carries each
ready front's series, labelled `worker_front="<i>"` (services.common.group_metrics).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from services.common import metric_names as names
from services.common.beats import beat_file
from services.common.lifecycle import STOP_OVERRUN_S
from services.common.processes import (
    Restarts,
    Supervised,
    request_stop,
    reserve_port,
    shared_ports_env,
    wait_or_kill,
)
from services.gpu_worker.config import WorkerConfig

log = logging.getLogger(__name__)

#: The label that tells the fronts apart in the worker's /metrics.
FRONT_LABEL = "worker_front"
#: How often the engine looks at its fronts, and at their ready files while it waits for them.
WATCH_S = 0.2
READY_POLL_S = 0.05
#: How long the fronts may take to listen once the engine has loaded (a few may restart).
READY_TIMEOUT_S = 60.0
#: How long they may take to see the engine SERVING: 10 s, 20 of their health polls.
SERVING_TIMEOUT_S = 10.0
#: How long the worker may go with no front listening (each failing at start, or killed over
#: and over) before it stops serving: nothing listens on its port, while its registry entry
#: still drew routers' calls.
NONE_LISTENING_S = 30.0
#: What the engine keeps of its own stop bound (lifecycle.bound_stop) once it stops waiting for
#: its fronts: to SIGKILL and reap the last of them, and remove its directory.
STOP_MARGIN_S = 3.0


def front_wait_s(drain_grace_s: float, elapsed_s: float) -> float:
    """How long the engine waits for its fronts to stop, `elapsed_s` into its own stop, before
    it SIGKILLs them: their drain grace and 5 s, but no later than its own stop bound
    (`drain_grace_s` + STOP_OVERRUN_S) less STOP_MARGIN_S. The fronts are stopped after the
    engine's drain, its link closed: nothing is left for them to drain, and a front slow to stop
    (a router that no longer reads its answers) had the engine's bound end the engine first,
    exit 1 with its stacks on an ordinary stop, its directory left behind and the fronts alive
    for up to 20 s after it, holding the port (review finding). 0 once the bound is that
    near: they are SIGKILLed at once."""
    left_s = drain_grace_s + STOP_OVERRUN_S - STOP_MARGIN_S - elapsed_s
    return max(0.0, min(drain_grace_s + 5.0, left_s))


@dataclass
class Silence:
    """How long none of a supervisor's children has listened (pure: the caller's clock)."""

    lost_after_s: float
    since_s: float | None = None
    is_lost: bool = False

    def update(self, is_any_listening: bool, now_s: float) -> bool:
        """True once: the first time none has listened for `lost_after_s`."""
        if is_any_listening:
            self.since_s = None
            return False
        if self.since_s is None:
            self.since_s = now_s
        if self.is_lost or now_s - self.since_s < self.lost_after_s:
            return False
        self.is_lost = True
        return True


@dataclass
class _Front(Supervised):
    #: Whether it has seen the engine SERVING (it says so in its ready file).
    saw_engine_serving: bool = False

    def exited(self) -> None:
        super().exited()
        self.saw_engine_serving = False


class Fronts:
    """Starts, watches, restarts and stops the worker's fronts."""

    def __init__(
        self,
        config: WorkerConfig,
        argv: list[str],
        engine_dir: Path,
        registry: CollectorRegistry,
    ) -> None:
        self._config = config
        self._argv = argv
        self._engine_dir = engine_dir
        self._fronts: dict[int, _Front] = {}
        self._reserved: list[socket.socket] = []
        self._watching: asyncio.Task[None] | None = None
        self.num_restarts = 0
        self._restarts = Restarts("worker front")
        self._restarts_total = Counter(
            names.WORKER_FRONT_RESTARTS_TOTAL.removesuffix("_total"),
            "Worker fronts restarted after exiting on their own",
            registry=registry,
        )
        host = config.host
        self.scrape_host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        #: The worker's gRPC port, and its health port when one is set, once reserved.
        self.port = 0
        self.health_port: int | None = None
        #: Told once no front has listened for NONE_LISTENING_S (the worker stops serving).
        self.on_none_listening: Callable[[Exception], None] = lambda _: None
        #: Counted once the fronts were all ready (`wait_ready`): at start, READY_TIMEOUT_S
        #: bounds how long they take.
        self._silence: Silence | None = None

    def reserve_ports(self) -> int:
        """Binds the worker's ports for the fronts to share; the gRPC port."""
        self.port = self._reserve(self._config.grpc_port)
        if self._config.tls.health_port is not None:
            self.health_port = self._reserve(self._config.tls.health_port)
        return self.port

    def _reserve(self, port: int) -> int:
        reserved = reserve_port(self._config.host, port)
        self._reserved.append(reserved)
        return int(reserved.getsockname()[1])

    def metrics_ports(self) -> dict[int, int]:
        """Each ready front's own /metrics port, by index."""
        fronts = list(self._fronts.values())
        return {f.index: f.metrics_port for f in fronts if f.metrics_port is not None}

    def start(self) -> None:
        """Starts every front, and the watch that restarts them (from the loop's thread: a
        front's SIGTERM on the engine's exit is tied to the thread that started it)."""
        for index in range(self._config.front_processes):
            self._start(index)
        self._watching = asyncio.get_running_loop().create_task(self._watch(), name="fronts")

    async def wait_ready(self) -> None:
        """Returns once every front listens (one that exits meanwhile is restarted);
        RuntimeError past READY_TIMEOUT_S."""
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while not all(self._is_listening(f) for f in self._fronts.values()):
            if time.monotonic() > deadline_s:
                raise RuntimeError(
                    f"the worker's fronts were not all ready within {READY_TIMEOUT_S:.0f}s "
                    f"({self.num_restarts} restarts; see their log lines)"
                )
            await asyncio.sleep(READY_POLL_S)
        self._silence = Silence(NONE_LISTENING_S)

    def stop_watching(self) -> None:
        """No more restarts: the worker is stopping."""
        if self._watching is not None:
            self._watching.cancel()

    async def stop(self, elapsed_s: float = 0.0) -> None:
        """SIGTERMs every front and waits for each, `elapsed_s` into the engine's own stop
        (SIGKILL past `front_wait_s`)."""
        self.stop_watching()
        running = [f for f in self._fronts.values() if f.process.poll() is None]
        for front in running:
            request_stop(front.process)
        grace_s = front_wait_s(self._config.drain_grace_s, elapsed_s)
        codes = await asyncio.gather(
            *(asyncio.to_thread(wait_or_kill, f.process, grace_s) for f in running)
        )
        for front, code in zip(running, codes, strict=True):
            if code != 0:
                log.error("worker front %d stopped with %s", front.index, code)
        for reserved in self._reserved:
            reserved.close()

    def _start(self, index: int) -> None:
        ready_file = self._engine_dir / f"front-{index}.ready.json"
        ready_file.unlink(missing_ok=True)
        beat_file(ready_file).unlink(missing_ok=True)
        overrides = [
            "--engine-dir", str(self._engine_dir),
            "--engine-pid", str(os.getpid()),
            "--front-processes", "0",
            "--grpc-port", str(self.port),
            "--metrics-port", "0",
            "--ready-file", str(ready_file),
        ]  # fmt: skip
        if self.health_port is not None:
            overrides += ["--health-port", str(self.health_port)]
        process = subprocess.Popen(
            [sys.executable, "-m", "services.gpu_worker.front", *self._argv, *overrides],
            env=shared_ports_env(),
            stdin=subprocess.DEVNULL,  # its output goes where the engine's goes
        )
        self._fronts[index] = _Front(index, process, ready_file, time.monotonic())
        log.info("worker front %d started (pid %d)", index, process.pid)

    async def wait_serving(self, give_up: Callable[[], bool]) -> bool:
        """Waits until every front has seen the engine SERVING (they ask twice a second), so
        that the worker is reported ready when its port says SERVING; False past
        SERVING_TIMEOUT_S, or as soon as `give_up()` (the engine failed)."""
        deadline_s = time.monotonic() + SERVING_TIMEOUT_S
        while not all(
            self._is_listening(f) and f.saw_engine_serving for f in self._fronts.values()
        ):
            if give_up() or time.monotonic() > deadline_s:
                return False
            await asyncio.sleep(READY_POLL_S)
        return True

    def _is_listening(self, front: _Front) -> bool:
        """Whether `front` has written its ready file; reads whether it says it saw the engine
        SERVING, until it does."""
        if front.saw_engine_serving:
            return True
        ready = front.read_ready()
        if ready is None:
            return False
        front.saw_engine_serving = bool(ready.get("serving"))
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            started = self._restarts.start_due(now, self._start)
            self._restarts_total.inc(started)
            self.num_restarts += started
            listening = False
            for front in list(self._fronts.values()):
                is_listening = self._is_listening(front)
                code = front.process.poll()
                listening = listening or (code is None and is_listening)
                if code is None and is_listening:  # one hung is killed: its exit read next
                    front.kill_if_hung("worker front", now)
                if code is None or self._restarts.is_pending(front.index):
                    continue
                front.exited()
                ran_s = now - front.started_s
                self._restarts.exited(front.index, front.process.pid, code, ran_s, now)
            if self._silence is not None and self._silence.update(listening, now):
                error = RuntimeError(
                    f"no worker front has listened for {NONE_LISTENING_S:.0f}s"
                    f" ({self.num_restarts} restarts; see their log lines)"
                )
                log.error("%s: the worker stops serving", error)
                self.on_none_listening(error)
