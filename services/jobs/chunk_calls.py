"""What the job runner (services/jobs/runner.py) decides about one chunk's calls: which
failures leave the chunk for a later round, which may be one item's (so its items are run
alone), how many one-item calls run at once, and the results it records."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from services.common import metric_names as names
from services.common.job_policy import (
    RETRYABLE_CODES,
    ItemStatus,
    fleet_patience_spent,
    is_too_large,
)
from services.common.job_records import ItemOutcome
from services.common.job_store import JobStore
from services.pb.inference.v1 import jobs_pb2 as jobs

_T = TypeVar("_T")


class FleetUnavailable(Exception):
    """The fleet could not serve a chunk through its retries (UNAVAILABLE, RESOURCE_EXHAUSTED,
    CANCELLED, DEADLINE_EXCEEDED: no worker up, a restart, overload). No item is at fault: the
    chunk stays pending and is retried after the claim timeout, for FLEET_ROUNDS rounds and the
    runner's fleet patience at least, so a job outlives the restart or rollout of any tier."""


class RunnerRefused(Exception):
    """The gateway refused the runner itself (UNAUTHENTICATED: a missing or revoked runner
    key; PERMISSION_DENIED: its tenant not granted a job's priority class or model). No item
    is at fault: the chunk stays pending and is retried after the claim timeout, by this
    runner or another, rather than failing every item of every job."""


def left_reason(error: Exception) -> str:
    """The `reason` label a chunk left pending for a later round after `error` counts under
    (inference_jobs_chunks_left_total): the runner refused, the fleet, or Redis."""
    if isinstance(error, RunnerRefused):
        return names.CHUNK_LEFT_RUNNER_REFUSED
    if isinstance(error, FleetUnavailable):
        return names.CHUNK_LEFT_FLEET_UNAVAILABLE
    return names.CHUNK_LEFT_STORE_UNREACHABLE


#: Retryable codes one item may still cause: a model that crashed on it. A call past its
#: deadline, or aborted, says the fleet is slow: split, it would only multiply the calls.
_ITEM_CRASH_CODES = frozenset({"INTERNAL", "UNKNOWN"})
#: Codes that refuse the call whatever its items: the model or version gone, the runner's
#: rights, a method not served, a version's tokenizer differing. Split, every item fails alike.
_CALL_CODES = frozenset({"NOT_FOUND", "PERMISSION_DENIED", "UNIMPLEMENTED", "FAILED_PRECONDITION"})
#: Most one-item calls a split chunk makes at once (its items are run alone to find the bad
#: one: a chunk's worth at once would be a burst the runner's chunk limit does not bound).
SPLIT_CONCURRENCY = 8


def may_be_one_items(code: str, message: str) -> bool:
    """Whether a chunk's call that failed with `code` and `message` for good may have failed
    for one item (or for its items together: an answer past the message limit)."""
    if is_too_large(code, message):
        return True
    return code not in _CALL_CODES and (code not in RETRYABLE_CODES or code in _ITEM_CRASH_CODES)


async def all_or_none(calls: Iterable[Awaitable[_T]]) -> list[_T]:
    """Every call's result; on the first that raises, the others are cancelled (nothing of a
    chunk given up keeps calling), then it is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class FleetRound:
    """Counts the round a chunk is left for because the fleet cannot serve it (the job's
    `rounds:<start>`), once however many of its calls (its items split) hit the fleet in it,
    and says whether the chunk's patience is spent (job_policy.fleet_patience_spent)."""

    def __init__(self, store: JobStore, job_id: str, start: int, patience_s: float) -> None:
        self._store, self._job_id, self._start = store, job_id, start
        self._patience_s = patience_s
        self._counted: asyncio.Future[tuple[int, float]] | None = None

    async def is_spent(self) -> bool:
        """Whether the chunk's items fail now (not for a job gone: its entry is dropped when
        next run)."""
        if self._counted is None:
            self._counted = asyncio.ensure_future(
                self._store.fleet_round(self._job_id, self._start, time.time())
            )
        rounds, waited_s = await asyncio.shield(self._counted)
        return rounds >= 0 and fleet_patience_spent(rounds, waited_s, self._patience_s)


def item_result(index: int, status: ItemStatus, num_attempts: int, **fields: Any) -> ItemOutcome:
    status_pb = {
        ItemStatus.OK: jobs.ITEM_STATUS_OK,
        ItemStatus.FAILED: jobs.ITEM_STATUS_FAILED,
        ItemStatus.CANCELLED: jobs.ITEM_STATUS_CANCELLED,
    }[status]
    message = jobs.JobItemResult(index=index, status=status_pb, num_attempts=num_attempts, **fields)
    return ItemOutcome(
        index, status, message.SerializeToString(), code=message.code, message=message.message
    )
