"""Pure rules of durable batch jobs, shared by the gateway's JobService and the job runners.

- `job_state`: a job's state is derived from its item counts and its cancel flag, never stored,
  so it cannot disagree with the results it summarises.
- `RetryPolicy.decide`: after a failed attempt, `Retry(after_s)` with capped exponential backoff
  and full jitter, or `GiveUp` (dead-letter) when the error can never succeed or the attempts
  are spent.
- `chunk_ranges` / `finished_prefix`: how a job's items are cut into queue entries, and which
  results a resumable `GetJobResults` call may stream (the contiguous finished prefix from the
  caller's offset, so that results are always in input order with no gaps).
- `eta_s`: remaining time at the rate seen since the first item started.

No I/O, no clock: time comes in as `now_s`, randomness as `jitter` in [0, 1).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from services.common import errors
from services.common.backoff import doubled_s

#: gRPC status names a retry can fix: capacity, deadlines, a tier restarting, a model error
#: that may be transient, a call the gateway's grpc dropped unseen (CANCELLED: its queue of
#: calls not yet picked up was past --max-pending-calls; a runner never cancels a call itself:
#: its drain cancels the task, not the call's status). Everything else (INVALID_ARGUMENT,
#: NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED, FAILED_PRECONDITION...) fails the same way
#: every time: dead-letter at once.
RETRYABLE_CODES = frozenset(
    {
        "UNAVAILABLE",
        "RESOURCE_EXHAUSTED",
        "DEADLINE_EXCEEDED",
        "ABORTED",
        "INTERNAL",
        "UNKNOWN",
        "CANCELLED",
    }
)
#: Codes that say the fleet cannot serve now (no worker up for the model, a tier restarting,
#: the fleet overloaded or too slow for the call's deadline: batch rows wait behind online
#: traffic), not that an item is bad: a chunk still failing with one after its retries is left
#: for a later round rather than failed (`fleet_patience_spent`).
FLEET_CODES = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED"})
#: Rounds (a chunk's retries, then the claim timeout) a chunk waits for the fleet at least
#: before its items fail with the fleet's status...
FLEET_ROUNDS = 10
#: ... and seconds since its first such round (a deploy, a restart of every worker, a long
#: online peak): an item that crashes the worker it runs on cannot take the fleet down forever,
#: and a rollout of any tier fails no item.
FLEET_PATIENCE_S = 1800.0


def is_too_large(code: str, message: str) -> bool:
    """errors.is_too_large for a status by name: the call, or its answer, too large for the
    gateway's or the runner's limit. Not the fleet's doing: retried, it fails the same way,
    where its items run alone may pass."""
    return errors.is_too_large(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN), message)


def fleet_patience_spent(rounds: int, waited_s: float, patience_s: float) -> bool:
    """Whether a chunk the fleet could not serve for `rounds` rounds, the first `waited_s`
    ago, fails its items now rather than wait another round."""
    return rounds >= FLEET_ROUNDS and waited_s >= patience_s


#: Rounds a chunk may fail in its runner with an unexpected error (a bug, an answer the runner
#: cannot read) before its items without a result fail INTERNAL: a chunk that always fails so
#: would otherwise be reclaimed and rerun by the runners forever.
CRASH_ROUNDS = 3


class JobState(enum.Enum):
    """A job's state; values are the names the API and the CLI print."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    PARTIALLY_FAILED = "partially_failed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING)


class ItemStatus(enum.Enum):
    """One item's outcome; the values are the job hash's counter fields (`num_<value>`)."""

    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class ItemCounts:
    """Finished items of a job by status; the rest are queued or running."""

    num_ok: int = 0
    num_failed: int = 0
    num_cancelled: int = 0

    @property
    def num_done(self) -> int:
        return self.num_ok + self.num_failed + self.num_cancelled


def job_state(num_items: int, counts: ItemCounts, *, is_cancelled: bool) -> JobState:
    """The state of a job of `num_items` items with `counts` finished.

    A cancelled job is CANCELLED from the cancel on, even while runners still mark its last
    items. Otherwise: QUEUED before any item finished, RUNNING until all have, then SUCCEEDED
    (all ok), FAILED (none ok) or PARTIALLY_FAILED.
    """
    if is_cancelled:
        return JobState.CANCELLED
    if counts.num_done < num_items:
        return JobState.RUNNING if counts.num_done > 0 else JobState.QUEUED
    if counts.num_ok == num_items:
        return JobState.SUCCEEDED
    if counts.num_ok == 0:
        return JobState.FAILED
    return JobState.PARTIALLY_FAILED


def progress(num_items: int, counts: ItemCounts) -> float:
    """Finished over all items, 0..1 (1 for an empty job)."""
    return 1.0 if num_items <= 0 else min(1.0, counts.num_done / num_items)


def eta_s(num_items: int, counts: ItemCounts, *, started_s: float, now_s: float) -> float:
    """Seconds until every item is finished at the rate seen since `started_s` (0: unknown,
    not started, or done)."""
    remaining = num_items - counts.num_done
    elapsed_s = now_s - started_s
    if remaining <= 0 or started_s <= 0 or elapsed_s <= 0 or counts.num_done <= 0:
        return 0.0
    return remaining / (counts.num_done / elapsed_s)


@dataclass(frozen=True)
class Retry:
    """Try again after `after_s` seconds."""

    after_s: float


@dataclass(frozen=True)
class GiveUp:
    """Dead-letter: record the item as failed with this status."""

    code: str
    message: str


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter (AWS's "full jitter": a uniform draw in
    [0, min(max_delay_s, base_delay_s * 2**(attempt-1)))), so that runners retrying together
    after one outage do not come back in lockstep."""

    #: Attempts per item, the first included.
    max_attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    #: The longest a refusal's retry hint makes a retry wait (a runner's chunk is not held
    #: for a hint of minutes; past its attempts the fleet's patience takes over).
    max_hint_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("max_attempts >= 1 and non-negative delays are required")

    def ceiling_s(self, num_attempts: int) -> float:
        """The largest delay after attempt number `num_attempts` (1-based)."""
        return doubled_s(self.base_delay_s, num_attempts - 1, self.max_delay_s)

    def decide(
        self, num_attempts: int, code: str, message: str, jitter: float, hint_s: float = 0.0
    ) -> Retry | GiveUp:
        """What to do after attempt `num_attempts` failed with status `code`; `hint_s`, the
        refusal's retry hint (`retry-after-ms`; 0: none): a retry waits at least that long.
        Without it, a refusal for a tenant's rate that said "3 s" was met with four more
        calls in about 1.5 s, each refused and counted against the tenant (review finding)."""
        if code not in RETRYABLE_CODES or is_too_large(code, message):
            return GiveUp(code, message)
        if num_attempts >= self.max_attempts:
            return GiveUp(code, f"{message} (after {num_attempts} attempts)")
        hint_s = min(hint_s, self.max_hint_s)
        return Retry(after_s=max(hint_s, jitter * self.ceiling_s(num_attempts)))


def chunk_ranges(num_items: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of `chunk_size` items (the last may be shorter)."""
    ends = chunk_ends([0] * num_items, chunk_size, 0)
    return list(zip([0, *ends], ends, strict=False))


def chunk_ends(sizes: Sequence[int], max_items: int, max_bytes: int) -> list[int]:
    """Where each chunk of items of `sizes` (bytes) ends, in order: at most `max_items` items
    and `max_bytes` bytes a chunk (one Predict call each), an item larger alone in a chunk."""
    if max_items < 1:
        raise ValueError("chunk_size must be at least 1")
    ends: list[int] = []
    num_items = num_bytes = 0
    for index, size in enumerate(sizes):
        if num_items and (num_items == max_items or num_bytes + size > max_bytes):
            ends.append(index)
            num_items = num_bytes = 0
        num_items += 1
        num_bytes += size
    if num_items:
        ends.append(len(sizes))
    return ends


def finished_prefix(found: Sequence[bytes | None]) -> list[bytes]:
    """The results of a page read from the caller's offset on, up to the first item not yet
    finished (None): a resumed call never skips an item, and never returns one out of order."""
    prefix = []
    for result in found:
        if result is None:
            break
        prefix.append(result)
    return prefix
