"""The thread the generation engine's model steps run on, and the watchdog bounding each step.

A step's forward runs off the event loop, one at a time, on one daemon thread
(`batching.watchdog.DaemonExecutor`). A forward that never returns (a deadlocked kernel, a hung
device) would leave every stream of the model waiting for tokens while the worker still looks
alive; the engine awaits each step for at most the watchdog bound, the same one the batching
driver applies to fixed-cost model calls (`watchdog_s`, raised for a model whose warm-up steps
are slow). Past it, the step raises and `is_wedged` is set: the engine stops for good (the
thread cannot be killed), and drain leaves the thread behind instead of waiting for it.

A version loaded while serving warms up on that thread too, before its engine starts: every
forward of its warm-up (its steps, the attention kernels' timed steps, the decode graphs'
captures) must end within WARMUP_MULTIPLE x the watchdog of the one before
(`warm_up_within`), as a fixed-cost version's warm-up calls must; past it the thread counts as
wedged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import torch

from services.common import metric_names as names
from services.common.errors import Unavailable
from services.common.wakeup import settle
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.watchdog import (
    WARMUP_MULTIPLE,
    CallProgress,
    DaemonExecutor,
    WatchdogExpired,
    watchdog_bound_s,
    within_watchdog,
)
from services.gpu_worker.device_busy import DeviceBusy
from services.gpu_worker.execution import intra_op_threads
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.generation.model_runner import ModelRunner, SequenceBatchItem
from services.gpu_worker.generation.step_inputs import StepItem, is_decode

log = logging.getLogger(__name__)

T = TypeVar("T")
#: A step's items, of whatever type the caller schedules (the engine's ScheduledSequence).
T_Item = TypeVar("T_Item", bound=StepItem)

#: The bound on one step where the worker's `watchdog_s` is not given (an engine on its own).
DEFAULT_WATCHDOG_S = DriverConfig.watchdog_s


class StepExecutor:
    """Runs one model version's steps on its own daemon thread, each bounded by the watchdog."""

    def __init__(
        self,
        runner: ModelRunner,
        metrics: GenerationMetrics,
        labels: tuple[str, str],
        has_sent: Callable[[Any], bool],
    ) -> None:
        """`has_sent(item)`: whether the sequence of a step's item has sent tokens (a failed
        step runs those again: `decodes_again`)."""
        self._runner = runner
        self._has_sent = has_sent
        self._metrics = metrics
        self._labels = labels
        busy = metrics.device_busy_seconds_total
        self._device_busy = None if busy is None else busy.labels(*labels, names.WORK_ONLINE)
        self._executor = DaemonExecutor(f"generation-{'/'.join(labels)}")
        #: The costliest warm-up step (seconds): the bound in force is at least a multiple of it.
        self.slowest_warmup_s = 0.0
        #: The bound on one step in force (seconds); see `set_watchdog`.
        self.watchdog_s = DEFAULT_WATCHDOG_S
        #: Set once a step ran past the bound: its thread may never be free again.
        self.is_wedged = False
        #: The forwards ended so far on the thread, for `warm_up_within`.
        self._forwards = CallProgress()
        runner.on_forward = self._forwards.ended

    def set_watchdog(self, watchdog_s: float) -> None:
        """Bounds each step by `watchdog_s`, raised to the warm-up multiple of the costliest
        warm-up step (as the batching driver does for fixed-cost calls)."""
        if watchdog_s <= 0:
            raise ValueError("watchdog_s must be > 0")
        self.watchdog_s = watchdog_bound_s(watchdog_s, self.slowest_warmup_s)
        log.info(
            "generation watchdog of %s: %.1fs (costliest warm-up step %.3fs)",
            "/".join(self._labels),
            self.watchdog_s,
            self.slowest_warmup_s,
        )

    def warm_up(self, steps: Sequence[Sequence[SequenceBatchItem]]) -> None:
        """Runs `steps` in order on the executor thread (the thread that will run serving
        steps), timing each. Blocking: call it from a thread before serving."""
        self._executor.submit(self._run_timed, steps).result()

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the executor thread (the thread that runs serving steps: CUDA graphs are
        captured there). Blocking: call it from a thread before serving."""
        return self._executor.submit(fn).result()

    async def warm_up_within(self, warm_up: Awaitable[None], watchdog_s: float) -> None:
        """Awaits `warm_up` (a hot load's: its `warm_up` and `call`s, from a thread) while each
        of its forwards ends within WARMUP_MULTIPLE x `watchdog_s` of the one before (the
        first, of the warm-up's start: a new version's first steps may be slower than any
        served). Past it, as a serving step past the bound: `is_wedged` set, counted,
        Unavailable raised (the thread is left held)."""
        bound_s = WARMUP_MULTIPLE * watchdog_s
        try:
            await within_watchdog(warm_up, bound_s, self._forwards)
        except WatchdogExpired:
            raise self._wedged("a warm-up step", bound_s) from None

    def _run_timed(self, steps: Sequence[Sequence[SequenceBatchItem]]) -> None:
        for items in steps:
            started = time.monotonic()
            self._runner.execute(items)
            self.slowest_warmup_s = max(self.slowest_warmup_s, time.monotonic() - started)

    async def execute(
        self,
        items: Sequence[StepItem],
        *,
        threads: int = 0,
        while_running: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The step's logits (`ModelRunner.execute`) computed on `threads` torch intra-op
        threads (0: as set); raises what the forward raised, or Unavailable, with `is_wedged`
        set, once the step has held the thread past the bound.

        `while_running` (which must not raise) is called on the event loop once the step's
        device work is launched (`ModelRunner.on_launched`: its host work done, only the
        device's left), or once the step ended where it never is (a step run on a CPU): the
        loop's work then overlaps the device's instead of following it. Within the bound."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.watchdog_s) as timeout:
                if while_running is None:
                    return await loop.run_in_executor(self._executor, self._run, items, threads)
                launched: asyncio.Future[None] = loop.create_future()

                def on_launched() -> None:  # on the step's thread
                    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                        loop.call_soon_threadsafe(settle, launched)

                step = loop.run_in_executor(self._executor, self._run, items, threads, on_launched)
                try:
                    step.add_done_callback(lambda _: settle(launched))
                    await launched
                    while_running()
                    return await step
                finally:  # given up before its launch (the bound, a cancel): as awaiting it
                    step.cancel()
        except TimeoutError:
            if not timeout.expired():
                raise  # raised by the forward itself: a failed step like any other
            raise self._wedged("a model step", self.watchdog_s) from None

    async def decodes_again(
        self, items: Sequence[T_Item], threads: int, fail: Callable[[Sequence[T_Item]], None]
    ) -> tuple[list[T_Item], torch.Tensor] | None:
        """After a step of `items` failed: `fail`s its new prompts (a prompt's chunk is the
        likelier cause: its attention out of memory, say) and runs the sequences that have sent
        tokens again (`rerun_split`: decodes, and preempted sequences' recomputes); if that
        fails too, or nothing new was there to blame, the recomputes fail and the decodes run
        again alone. Returns what ran and its logits (a failure failed streams that had sent
        tokens, whatever its cause: review finding); None where every sequence of the step is
        to fail: no decode, or the decodes' own rerun failed too (raised, where that wedged the
        thread)."""
        plan = rerun_plan(items, self._has_sent)
        if plan is None:
            return None
        failed, attempts = plan
        fail(failed)
        for number, attempt in enumerate(attempts, 1):
            try:
                return attempt, await self.execute(attempt, threads=threads)
            except Exception:
                if self.is_wedged:
                    raise
                log.exception("generation step failed again, %d sequences rerun", len(attempt))
                if number < len(attempts):  # its recomputes fail; the decodes run alone
                    fail([item for item in attempt if not is_decode(item)])
        return None

    def _wedged(self, what: str, bound_s: float) -> Unavailable:
        """Marks the thread wedged (`what` held it past `bound_s`), counted; the error to raise."""
        self.is_wedged = True
        if (expired_total := self._metrics.watchdog_expired_total) is not None:
            expired_total.labels(*self._labels).inc()
        name = "/".join(self._labels)
        return Unavailable(f"{what} of {name} ran past the executor watchdog ({bound_s:.1f}s)")

    def _run(
        self,
        items: Sequence[StepItem],
        threads: int,
        on_launched: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        busy = DeviceBusy(self._runner.execute, self._runner.device)
        self._runner.on_launched = on_launched
        try:
            with intra_op_threads(threads):
                return busy(items)
        finally:
            self._runner.on_launched = None
            if self._device_busy is not None:
                self._device_busy.inc(busy.seconds)

    def abandon(self) -> None:
        """Refuses new calls and drops the queued ones, waiting for none (a warm-up given up:
        its call in flight may never return, and the thread ends after it)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        """Refuses new steps; waits for the one in flight unless it is wedged (its daemon
        thread is left behind: it may never return)."""
        self._executor.shutdown(wait=not self.is_wedged)


def rerun_plan(
    items: Sequence[T_Item], has_sent: Callable[[T_Item], bool]
) -> tuple[list[T_Item], list[list[T_Item]]] | None:
    """After a step of `items` failed: the items to fail at once, and the reruns to try in
    turn (each one's recomputes failing before the next, the decodes alone); None where
    every item is to fail (one kind only: nothing to blame). New prompts are blamed first
    (`rerun_split`); with none, preempted sequences' recomputes are."""
    again, failed = rerun_split(items, has_sent)
    decodes = [item for item in again if is_decode(item)]
    has_recomputes = len(decodes) < len(again)
    if failed and again:
        return failed, [again, decodes] if has_recomputes and decodes else [again]
    if not failed and has_recomputes and decodes:
        return [item for item in again if not is_decode(item)], [decodes]
    return None


def rerun_split(
    items: Sequence[T_Item], has_sent: Callable[[T_Item], bool]
) -> tuple[list[T_Item], list[T_Item]]:
    """A failed step's items as (run again, fail): those of sequences that have sent tokens
    run again (decodes, and a preempted sequence recomputing its prompt and tokens: its
    stream cannot be replayed); new prompts' chunks fail, a chunk of one token after a
    prefix-cache hit too, though it reads as a decode (taken for one, the step's new prompt
    went unblamed and every sequence of it failed: review finding)."""
    again: list[T_Item] = []
    failed: list[T_Item] = []
    for item in items:
        (again if has_sent(item) else failed).append(item)
    return again, failed
