"""The executor watchdog: a bound on how long one model call may hold the executor thread.

A model call that never returns (a deadlocked kernel, a hung device, an infinite loop in user
code) leaves the worker alive but useless: its heartbeat goes on while every row queues behind
the call. The driver awaits each call for at most the watchdog bound; past it, the call's rows
fail UNAVAILABLE and the worker stops serving (NOT_SERVING, draining in the registry, overall
health too, so the liveness probe has the process replaced).

A Python thread cannot be killed, so the wedged call keeps its thread: the executor runs on a
daemon thread (`DaemonExecutor`), which neither drain nor interpreter exit waits for.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor, Future
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: The bound in force is at least this many times the costliest warm-up batch: a model whose
#: largest batch takes 5 s is never declared wedged at 30 s under ordinary contention.
WARMUP_MULTIPLE = 10.0


def watchdog_bound_s(watchdog_s: float, slowest_warmup_s: float) -> float:
    """The bound on one model call, seconds: the configured `watchdog_s`, raised to
    `WARMUP_MULTIPLE` x the costliest warm-up batch when that is larger."""
    return max(watchdog_s, WARMUP_MULTIPLE * slowest_warmup_s)


class Warmed(Protocol):
    #: The costliest warm-up batch's seconds (batching.lane.Lane's).
    slowest_warmup_s: float


def bound_for_lanes(watchdog_s: float, lanes: Iterable[Warmed]) -> float:
    """The bound on one model call while `lanes` batch: `watchdog_bound_s` for the slowest
    warm-up among them, so that it is lowered again once a slow version's lane is gone (it
    only grew: review finding)."""
    return watchdog_bound_s(watchdog_s, max((lane.slowest_warmup_s for lane in lanes), default=0))


class Calls(Protocol):
    #: Model calls ended so far, and when the last one did (DeviceBusy's, time.monotonic).
    num_calls: int
    last_end_s: float


class CallProgress:
    """`Calls` of work that makes its model calls itself (a hot load's warm-up): `ended`
    after each, on the thread that made it."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.last_end_s = time.monotonic()

    def ended(self) -> None:  # the end first: a reader seeing the new count sees its end
        self.last_end_s = time.monotonic()
        self.num_calls += 1


#: A bound on a work's model calls, seconds, and the calls it makes.
Watch = tuple[float, Calls]


class WatchdogExpired(TimeoutError):
    """A model call ran past the watchdog's bound (a TimeoutError the model raised is not)."""


async def within_watchdog(batch: Awaitable[R], bound_s: float, calls: Calls) -> R:
    """Awaits `batch` (on the executor: one model call, or 2n - 1 while a failing batch of n
    rows is bisected) while each of its model calls ends within `bound_s` of the one before
    (the first, of the batch's start); raises WatchdogExpired (and stops awaiting) once one has
    not: a call that never returns. Bounding the whole batch instead would take a failing
    batch's bisection for a wedged call."""
    running = asyncio.ensure_future(batch)
    try:
        num_ended, since_s = calls.num_calls, time.monotonic()
        while True:
            wait_s = since_s + bound_s - time.monotonic()
            if wait_s <= 0:
                raise WatchdogExpired(f"a model call ran past {bound_s:.1f}s")
            if (await asyncio.wait({running}, timeout=wait_s))[0]:
                return running.result()
            if calls.num_calls != num_ended:
                num_ended, since_s = calls.num_calls, calls.last_end_s
    finally:
        running.cancel()  # a no-op once done; the call itself cannot be stopped


def wedged_message(labels: tuple[str, str], bound_s: float) -> str:
    """What the rows of a call that ran past the bound are told (UNAVAILABLE: retry elsewhere)."""
    return (
        f"the model call of {'/'.join(labels)} exceeded the watchdog ({bound_s:.1f}s); "
        "this worker stopped serving, retry elsewhere"
    )


class DaemonExecutor(Executor):
    """Runs submitted calls one at a time, in order, on one daemon thread.

    Unlike `ThreadPoolExecutor`, whose threads the interpreter joins at exit, a call that never
    returns does not keep the process from exiting: `shutdown(wait=False)` and process exit
    leave the thread behind."""

    def __init__(self, thread_name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._is_shut_down = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Queues `fn(*args, **kwargs)`; raises RuntimeError after `shutdown`."""
        with self._lock:
            if self._is_shut_down:
                raise RuntimeError("cannot schedule new calls after shutdown")
            future: Future[T] = Future()
            self._calls.put((future, lambda: fn(*args, **kwargs)))
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuses new calls; queued ones still run (or are cancelled with `cancel_futures`).
        With `wait`, returns once the thread has finished them: never pass it while a call
        may be wedged."""
        with self._lock:
            if not self._is_shut_down:
                self._is_shut_down = True
                if cancel_futures:
                    self._cancel_queued()
                self._calls.put(None)
        if wait:
            self._thread.join()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as error:  # delivered to the awaiting caller
                future.set_exception(error)
            else:
                future.set_result(result)
