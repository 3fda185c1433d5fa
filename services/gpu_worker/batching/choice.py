"""Which of a batcher's keys closes a batch on an idle executor now, or when to ask again.

Pure: the batcher passes its queues, its close rule (close_rule.assess) and its cost model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from services.gpu_worker.batching.key_queue import KeyQueue
from services.gpu_worker.batching.types import DUE_RANK, BatchKey, CloseReason, Wait

#: What a key's batch is ranked by: (priority rank, tenant virtual seconds, earliest deadline).
_Rank = tuple[float, float, float]
_Candidate = tuple[_Rank, BatchKey, CloseReason]


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """The key `choose` picked and why, with its urgency (priority rank, tenant virtual
    seconds); `width` is the batch's row count when the choice already had to compute it."""

    rank: tuple[float, float]
    key: BatchKey
    reason: CloseReason
    width: int | None = None


def choose(
    queues: Mapping[BatchKey, KeyQueue],
    assess: Callable[[BatchKey, KeyQueue], tuple[CloseReason, None] | tuple[None, float]],
    width_of: Callable[[BatchKey], int],
    predict: Callable[[BatchKey, int], float],
    now_s: float,
    *,
    force: bool = False,
) -> Choice | Wait:
    """Among keys ready to close (with `force`, every key with items): the most urgent priority
    class, then the tenant furthest below its fair share, then the earliest queue limit (a
    deadline, or an online row's SLO bound); BatchKey order breaks ties. With none ready, a
    backfill (a key with `batch` rows only), if it is predicted (`width_of` rows, `predict`) to
    end before the urgent rows lingering in other keys are due: it cannot be preempted. If it
    is not, those rows close now instead (FULL): lingering pays only while the executor would
    otherwise idle, and with a backfill waiting it would not; the backfill runs after them.
    A key whose `batch` rows are due (BACKFILL_DUE) ranks after critical rows and ahead of
    every other class (DUE_RANK); critical rows lingering in another key close now rather
    than wait for its run (FULL).
    `assess` is the close rule of one key."""
    chosen: _Candidate | None = None
    backfill: _Candidate | None = None
    lingering: _Candidate | None = None
    wake_s: float | None = None
    for key, queue in queues.items():
        head = queue.items.head_rank() if queue.items else None
        if head is None:
            continue
        assessment = assess(key, queue)
        if assessment[0] is None and force:
            assessment = (CloseReason.FAIR_SHARE, None)
        rank = (head[0], head[1], queue.earliest_limit_s())
        if assessment[0] is CloseReason.BACKFILL_DUE:  # after critical rows, the earliest due first
            rank = min(rank, (DUE_RANK, queue.due_limit_s, queue.due_limit_s))
        if assessment[0] is None:  # urgent rows linger: [1] is when that could next change
            key_wake_s = assessment[1]
            wake_s = key_wake_s if wake_s is None else min(wake_s, key_wake_s)
            if lingering is None or (rank, key) < lingering[:2]:
                lingering = (rank, key, CloseReason.FULL)
            continue
        candidate = (rank, key, assessment[0])
        if candidate[2] is CloseReason.BACKFILL:
            if backfill is None or candidate[:2] < backfill[:2]:
                backfill = candidate
        elif chosen is None or candidate[:2] < chosen[:2]:
            chosen = candidate
    if chosen is None and backfill is not None:
        (priority, virtual_s, _), key, reason = backfill
        width = width_of(key)
        if wake_s is None or now_s + predict(key, width) <= wake_s:
            return Choice((priority, virtual_s), key, reason, width)
        chosen = lingering
    is_due_first = chosen is not None and chosen[0][0] == DUE_RANK
    if is_due_first and lingering is not None and lingering[0][0] < DUE_RANK:
        chosen = lingering  # critical rows lingering close now: never wait for a due batch
    if chosen is None:
        return Wait(wake_s)
    (priority, virtual_s, _), key, reason = chosen
    return Choice((priority, virtual_s), key, reason)
