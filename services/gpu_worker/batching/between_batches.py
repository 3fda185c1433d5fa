"""Work the batching driver runs on its executor between batches (a hot-loaded version's
warm-up, an unloaded version's memory release): no batch is dispatched while any is asked for
or running, so none is timed with it (by the watchdog, the tenants, the latency model). A work
given a watch is itself bounded as batches are (batching.watchdog): one that holds the executor
past the bound is wedged, and so is every batch behind it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor

from services.common.wakeup import Wakeup
from services.gpu_worker.batching.watchdog import Watch, within_watchdog


class BetweenBatches:
    def __init__(
        self, executor: Executor, wake: Wakeup, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._executor = executor
        self._wake = wake  # the driver's loop, told when a work ends
        self._clock = clock  # the driver's
        #: Works asked for or running.
        self.count = 0
        #: When the first of the works on the executor now was handed to it (None: none is).
        self._since_s: float | None = None

    def free_s(self, now_s: float, batch_end_s: float | None) -> float | None:
        """When the executor is predicted free: of the works on it, as long again as they have
        run (nothing tells better how long a hot load's warm-up takes); without any, when the
        running batch ends (`batch_end_s`; None: nothing runs). Admission reads it as a
        running batch's predicted end: a row that could not finish in time behind it is
        refused with a hint, not queued to expire."""
        return batch_end_s if self._since_s is None else now_s + (now_s - self._since_s)

    async def run(
        self,
        running_batch: Callable[[], asyncio.Task[None] | None],
        work: Callable[..., object],
        *args: object,
        watch: Watch | None = None,
    ) -> None:
        """Runs `work(*args)` on the executor once no batch is running (`running_batch`).
        Cancelled, it still counts until `work` ends: a call on a thread runs to its end, and
        a batch, or the executor's shutdown by a drain, must wait for it. With `watch` (a
        bound in seconds, and the model calls `work` makes), raises WatchdogExpired once one
        of them has not ended within the bound of the one before; the work still counts."""
        self.count += 1
        running: asyncio.Future[object] | None = None
        try:
            while (batch := running_batch()) is not None:
                await asyncio.wait({batch})
            if self._since_s is None:
                self._since_s = self._clock()
            running = asyncio.wrap_future(self._executor.submit(work, *args))
            if watch is None:
                await asyncio.shield(running)
            else:
                await within_watchdog(asyncio.shield(running), *watch)
        finally:
            if running is None:
                self._end(None)
            else:
                running.add_done_callback(self._end)

    def _end(self, work: asyncio.Future[object] | None) -> None:
        if work is not None and not work.cancelled():
            work.exception()  # raised to its caller, or to none once the caller was cancelled
        self.count -= 1
        if not self.count:
            self._since_s = None
        self._wake.set()
