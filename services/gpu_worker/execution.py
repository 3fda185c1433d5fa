"""Running one batch on the executor thread, so that a bad row fails only its own request."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from services.common.errors import Unavailable
from services.common.sparse_log import SparseLog
from services.gpu_worker.backends.base import PreparedRow, check_device
from services.gpu_worker.batching.close_rule import URGENT_RECENT_S
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.failure_streak import FailureStreak
from services.gpu_worker.batching.types import CloseReason, Dispatch
from services.gpu_worker.thread_choice import ThreadChoice

log = logging.getLogger(__name__)
#: A model failing on rows: its traceback, at most every 10 s a version.
_model_failures = SparseLog(log)


def resolve_threads(config: DriverConfig, device: torch.device) -> DriverConfig:
    """`config` with its thread counts resolved, once, at start, before any batch: torch gives
    a thread its count when it first asks, from the last count set on any thread, so a lane
    built later (a hot load) could read a batch's momentary one. `model_threads` 0 becomes
    torch's intra-op threads on a CPU; `backfill_threads` -1 half of them (0 on a GPU, whose
    kernels leave the cores alone)."""
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    if config.model_threads == 0:
        config = dataclasses.replace(config, model_threads=threads)
    if config.backfill_threads < 0:
        config = dataclasses.replace(config, backfill_threads=threads // 2)
    if 0 < config.model_threads < config.backfill_threads:  # never more than the model's own
        config = dataclasses.replace(config, backfill_threads=config.model_threads)
    return config


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` for the block (0: left as set), restored
    after. On the thread that runs the model: torch keeps the count per thread once a thread
    has run a parallel region, so other threads' models keep theirs."""
    previous = torch.get_num_threads()
    if threads <= 0 or threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class DeviceLost(Unavailable):
    """Every row of a batch failed, and its device no longer runs work (a CUDA error that
    poisons the context fails every later call): no row was at fault, and none can run here."""


def run_on_threads(
    threads: int,
    run: Callable[[Sequence[PreparedRow]], list[np.ndarray]],
    rows: Sequence[PreparedRow],
    device: torch.device | None = None,
) -> list[np.ndarray | Exception]:
    """`run_isolated` on `threads` torch intra-op threads (0: as set), restored after. On the
    executor thread: the only one running the model. Once every row failed, `device` (if
    given) is checked: DeviceLost if it no longer runs work."""
    with intra_op_threads(threads):
        results = run_isolated(run, rows)
    if device is not None and all(isinstance(result, Exception) for result in results):
        try:
            check_device(device)
        except Exception as error:
            raise DeviceLost(
                f"{device} no longer runs work ({error}); this worker stopped serving, retry "
                "elsewhere"
            ) from error
    return results


def run_isolated(
    run: Callable[[Sequence[PreparedRow]], list[np.ndarray]], rows: Sequence[PreparedRow]
) -> list[np.ndarray | Exception]:
    """Runs a batch; if it raises, bisects so that only the failing rows fail."""
    try:
        outputs = run(rows)
        if len(outputs) != len(rows):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(rows)} rows")
        return list(outputs)
    except Exception as error:
        if len(rows) == 1:
            return [error]
        middle = len(rows) // 2
        return run_isolated(run, rows[:middle]) + run_isolated(run, rows[middle:])


def backfill_threads_for(
    reason: CloseReason, backfill_threads: int, last_urgent_s: float, now_s: float
) -> int:
    """torch threads for a batch closed for `reason` (0: the model's own): a backfill held
    short beside recent online traffic (`last_urgent_s`) runs on `backfill_threads`, leaving
    the other cores to the online path; a backfill after a quiet spell takes every thread."""
    if backfill_threads <= 0 or reason is not CloseReason.BACKFILL:
        return 0
    return backfill_threads if now_s - last_urgent_s < URGENT_RECENT_S else 0


@dataclasses.dataclass(frozen=True)
class BatchThreads:
    """The torch threads one batch runs on (0: the model's own), whether its time teaches the
    latency model, and where that time is recorded (the lane's thread choice, if any)."""

    count: int
    teaches_latency: bool
    choice: ThreadChoice | None = None
    #: The batch's padded tokens (rows x bucket), the choice's measure of a call's size.
    size: int = 0

    def record(self, compute_s: float) -> None:
        """The batch ran for `compute_s`: its cost per padded token, to the choice."""
        if self.choice is not None:
            self.choice.record(self.size, self.count, compute_s / self.size)


#: A batch on the model's own threads, teaching the latency model.
MODEL_THREADS = BatchThreads(0, teaches_latency=True)


def batch_threads(
    choice: ThreadChoice | None,
    dispatch: Dispatch,
    num_rows: int,
    backfill_threads: int,
    last_urgent_s: float,
    now_s: float,
    *,
    may_explore: bool = True,
) -> BatchThreads:
    """The threads of a batch dispatched at `now_s`. A backfill held short beside online
    traffic runs on `backfill_threads` (or the fewer the lane measured best) and teaches
    nothing. Any other batch, on a lane with a thread `choice` (a model computing on the
    host's cores), runs on the count measured cheapest per padded token for its size: on a
    CPU shared with the tiers, a parallel region waits for its slowest thread, and a
    preempted one stalls the whole batch (minilm beside a 10x flood here served 12-70 rows/s
    on two threads, 120-190 on one). It teaches the latency model unless it is a try of another
    count than the cheapest so far (`ThreadChoice.choose`: a sample or an exploration), which
    it is only when `may_explore` (nothing else queued: a count measured slower delays no
    other row) or after its size's turn has waited long enough."""
    size = num_rows * max(1, dispatch.key.bucket)
    threads = backfill_threads_for(dispatch.reason, backfill_threads, last_urgent_s, now_s)
    if threads:  # a backfill held short
        best = None if choice is None else choice.best(size)
        return BatchThreads(threads if best is None else min(threads, best), False)
    if choice is None:
        return MODEL_THREADS
    threads = choice.choose(size, may_explore=may_explore)
    return BatchThreads(threads, not choice.is_trying(size), choice, size)


def describe_failure(error: Exception) -> str:
    """One line for the client; TorchScript errors carry a multi-line traceback."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"model failed on this input: {lines[-1] if lines else type(error).__name__}"


def note_batch(
    failures: FailureStreak,
    labels: tuple[str, str],
    results: Sequence[object],
    num_failed: int,
    now_s: float,
) -> None:
    """Tells `failures` (batching.failure_streak) of a finished batch of (model, version)
    `labels` by its rows' `results` (an output or an Exception each), `num_failed` of them
    Exceptions. Rows refused unrun (Unavailable: the worker wedged, its device lost) say
    nothing of the model: a batch of only those is not told (the worker stops serving anyway),
    and beside rows that failed in the model they do not make the batch a success. A batch
    with a row served is not looked at again. A row failed in the model is logged with its
    traceback, at most every 10 s a version: its caller is told one line of it (`describe_
    failure`), and nothing else said which worker failed or where."""
    in_model = (r for r in results if isinstance(r, Exception) and not isinstance(r, Unavailable))
    if num_failed and (failed := next(in_model, None)) is not None:
        message = "model %s version %s failed on %d of %d rows of a batch; the first:"
        _model_failures.failure(labels, failed, message, *labels, num_failed, len(results))
    if num_failed < len(results):
        failures.note(labels, now_s, all_failed=False)
    elif results and not all(isinstance(r, Unavailable) for r in results):
        failures.note(labels, now_s, all_failed=True)
