"""Value types shared by the fixed-cost batching policy and its async driver.

Everything here is plain data: no clocks, no I/O. Times are seconds on the caller's monotonic
clock (the driver passes `time.monotonic()`, tests pass a fake clock).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from services.common.metric_names import WORK_BACKFILL, WORK_ONLINE
from services.common.priority import PriorityClass

#: The rank of `batch` rows: a backlog, not traffic (no linger waits for them), held to their
#: deadline, never to an SLO (`queue_limit_s`).
BATCH_RANK = PriorityClass.BATCH.rank
#: The rank of a batch whose `batch` rows are due (CloseReason.BACKFILL_DUE): after critical
#: rows, ahead of interactive ones, as those rows would otherwise be lost unrun. Critical rows
#: never wait for a job's (a review finding: ahead of every class, due batches took up to the
#: allowance's share from critical traffic).
DUE_RANK = (PriorityClass.CRITICAL.rank + PriorityClass.INTERACTIVE.rank) / 2


class BatchKey(NamedTuple):
    """Everything two requests must agree on to share one kernel call.

    model/version/fingerprint are correctness (mixing them gives wrong answers); bucket is
    efficiency (the padded length class, in tokens, or a shape class for tensor models).
    A named tuple: every queued row's key is hashed and compared on the batcher's per-row
    path, and a tuple does both in C.
    """

    model: str
    version: str
    fingerprint: str
    bucket: int


@dataclass(slots=True)
class QueuedItem:
    """One input waiting to be batched. One client request may contribute several items.
    Never changed once built (a new one replaces it): not frozen only because a frozen
    dataclass builds twice as slowly, and one is built per queued row."""

    item_id: int
    key: BatchKey
    tenant: str
    #: Real (unpadded) length in tokens; used for padding-waste accounting.
    num_tokens: int
    arrival_s: float
    #: Absolute deadline on the driver's monotonic clock: past it, the item is dropped unrun.
    deadline_s: float
    #: The SLO bound: the item is admitted only if predicted to finish within its share of it
    #: (`slo_share`, `admission_limit_s`), no later item joining its batch is admitted that
    #: would push it past it (a later item with an earlier deadline still runs first: the
    #: queue is by deadline), and an online item is dropped unrun once it could no longer
    #: finish by then (`queue_limit_s`). None: the deadline.
    #: Earlier than the deadline for a model that sheds what would finish past its SLO (or
    #: while its queue stands: slo_shedding).
    finish_by_s: float | None = None
    #: Priority class rank (services.common.priority.PriorityClass.rank): 0 critical,
    #: 1 interactive, 2 batch. Lower runs first and is shed last.
    priority: int = 1
    #: The tenant's fair-share weight, as its request carried it; 0 for the batcher's
    #: configured `tenant_weights` (1 for a tenant not listed there).
    weight: float = 0.0
    #: The share of its SLO budget (`finish_by_s` - `arrival_s`) that admission's forecast may
    #: fill (SloShedding.slo_share: the slow end of its batches' times); once queued, the
    #: whole budget is its bound.
    slo_share: float = 1.0

    @property
    def admission_limit_s(self) -> float:
        """When the item must be predicted to finish for admission to let it in."""
        if self.finish_by_s is None:
            return self.deadline_s
        slo_s = self.arrival_s + (self.finish_by_s - self.arrival_s) * self.slo_share
        return min(slo_s, self.deadline_s)

    @property
    def is_slo_bound(self) -> bool:
        """Whether its SLO bound, not its deadline, is what admission held it to."""
        return self.admission_limit_s < self.deadline_s

    @property
    def queue_limit_s(self) -> float:
        """When the item, once queued, must still be able to finish, or it is dropped unrun:
        its SLO bound (the whole budget) or deadline, whichever comes first, for online rows;
        its deadline for `batch` rows (a backlog the batcher holds back on purpose,
        close_rule.batch_width)."""
        if self.priority >= BATCH_RANK or self.finish_by_s is None:
            return self.deadline_s
        return min(self.finish_by_s, self.deadline_s)


class CloseReason(enum.Enum):
    """Why a batch was closed and dispatched. Values are Prometheus label values."""

    FULL = "full"
    LINGER = "linger"
    DEADLINE = "deadline"
    IDLE = "idle"
    DRAIN = "drain"
    #: Closed early: the batcher held the worker's most urgent work (priority, then fair share)
    #: while another batcher's batch was ready.
    FAIR_SHARE = "fair_share"
    #: Only `batch` rows, run on an executor no more urgent batch was ready for.
    BACKFILL = "backfill"
    #: `batch` rows first (after critical rows), run ahead of every batch but critical rows':
    #: the earliest of them would otherwise miss its deadline (due_rows.due_limit_s).
    BACKFILL_DUE = "backfill_due"


@dataclass(frozen=True)
class Dispatch:
    """Run these items now, as one batch, on the executor."""

    key: BatchKey
    #: Items of one key, in the order rows should be laid out (by priority, tenants
    #: interleaved by weighted compute, earliest deadline first within a tenant).
    items: tuple[QueuedItem, ...]
    reason: CloseReason

    @property
    def work(self) -> str:
        """The `work` label of its device time: backfill of batch rows only (come due or
        not), or online."""
        if self.reason is CloseReason.BACKFILL:
            return WORK_BACKFILL
        if self.reason is CloseReason.BACKFILL_DUE:
            return (
                WORK_ONLINE if any(i.priority < BATCH_RANK for i in self.items) else WORK_BACKFILL
            )
        return WORK_ONLINE


@dataclass(frozen=True)
class Wait:
    """Nothing to dispatch now. Ask again at `until_s`, or sooner if an item arrives, is
    cancelled, or the executor becomes idle. `None` means nothing is queued at all."""

    until_s: float | None


@dataclass(frozen=True)
class Poll:
    """The batcher's answer to "what now?"."""

    #: Items removed because their queue limit (QueuedItem.queue_limit_s) can no longer be met:
    #: never run them; `slo_shedding.expiry_reason` says how to answer them.
    expired: tuple[QueuedItem, ...]
    action: Dispatch | Wait


@dataclass(frozen=True)
class BatcherConfig:
    """The slice of a model's configuration that the batching policy needs."""

    #: Hard cap on items per batch.
    max_batch_size: int
    #: Items queued (all keys of this batcher together) before new ones are rejected.
    max_queue_size: int
    #: The model's latency SLO (p99, end to end), seconds.
    slo_s: float
    #: Part of the SLO reserved for the stages before the worker (gateway, router, hops).
    upstream_budget_s: float
    #: Safety margin kept between predicted completion and a deadline.
    safety_margin_s: float
    #: Upper bound on the derived linger (max_wait), seconds.
    max_wait_cap_s: float
    #: Optional cap on padded tokens per batch (bucket * batch size); 0 means no cap.
    max_batch_tokens: int = 0
    #: When the executor is idle, wait for more items only if at least this many are expected
    #: to arrive before the linger expires, and the next one soon enough that waiting for it
    #: pays (work-conserving trigger); 0 always lingers.
    min_expected_arrivals: float = 1.0
    #: Fair-share weights of tenants whose requests carry none; tenants not listed weigh 1.0.
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
