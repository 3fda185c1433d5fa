"""Worker-wide fair share by cost: each tenant's compute, in weighted seconds.

Every batch a worker runs charges its rows' tenants their predicted compute divided by their
weight (start-time fair queuing's virtual time). The batchers of every model, version and
bucket on the worker share one ledger, so a tenant's share holds across all of them, and it is
counted in compute, not items: a row of a long bucket costs more than a row of a short one.
The scheduler serves the tenant with the least virtual time first.

A tenant with nothing queued must not bank credit: when it queues again, its virtual time is
lifted to the least virtual time among tenants with queued work (the floor), so idle time is
never spent later as a burst. An urgent row's (critical or interactive) floor is that of the
tenants with urgent rows queued, and a tenant is lifted when it had none of those. A tenant
whose only queued rows were `batch` work (served as backfill, seldom charged) held the floor
down, so a tenant joining with interactive rows, or that tenant itself, was lifted only to its
virtual time and took the executor from steady interactive tenants for as long as that lead
lasted. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

#: Past this many remembered tenants, idle ones at or below the floor are forgotten (rejoining
#: lifts them to the floor anyway, so forgetting them changes nothing).
MAX_REMEMBERED_TENANTS = 4096


def check_weight(weight: float) -> None:
    """Raise ValueError unless `weight` is positive and finite."""
    if not (math.isfinite(weight) and weight > 0.0):
        raise ValueError(f"tenant weight must be positive and finite, got {weight}")


class TenantRow(Protocol):
    """A queued row, as far as its tenant's charge goes."""

    @property
    def tenant(self) -> str: ...

    @property
    def weight(self) -> float: ...


#: The share of the executor's time due batches may take, worker-wide, and the most they may
#: take at once (seconds of predicted compute): past it, `batch` rows that come due wait as a
#: backfill again, and may expire. Online traffic keeps the rest whatever `batch` callers send.
DUE_SHARE = 0.2
DUE_BURST_S = 2.0


class DueAllowance:
    """A token bucket of executor seconds for due batches, refilled at DUE_SHARE of the time
    that passes, up to DUE_BURST_S; shared by every batcher of a worker (on its
    fair_share.ComputeLedger)."""

    def __init__(self, share: float = DUE_SHARE, burst_s: float = DUE_BURST_S) -> None:
        self._share, self._burst_s = share, burst_s
        self._credit_s = burst_s
        self._as_of_s: float | None = None

    def has_credit(self, now_s: float) -> bool:
        """Whether a due batch may run now."""
        return self._refill(now_s) > 0.0

    def spend(self, now_s: float, seconds: float) -> None:
        """A due batch predicted to run `seconds` was dispatched at `now_s` (the credit may go
        below zero: it is repaid before the next)."""
        self._credit_s = self._refill(now_s) - seconds

    def _refill(self, now_s: float) -> float:
        if self._as_of_s is not None and now_s > self._as_of_s:
            gained_s = (now_s - self._as_of_s) * self._share
            self._credit_s = min(self._burst_s, self._credit_s + gained_s)
        if self._as_of_s is None or now_s > self._as_of_s:
            self._as_of_s = now_s
        return self._credit_s


class ComputeLedger:
    """Per-tenant virtual time (compute seconds served / weight) and which tenants have work
    queued. Shared by every batcher of one worker."""

    def __init__(self) -> None:
        self._virtual_s: dict[str, float] = {}
        self._queued: Counter[str] = Counter()
        #: Rows queued per tenant that are urgent (critical or interactive, not `batch`).
        self._queued_urgent: Counter[str] = Counter()
        self._floor_s = 0.0
        #: The urgent rows' floor as it last was (never decreases).
        self._urgent_floor_s = 0.0
        #: When a row more urgent than `batch` was last queued on the worker, by any of its
        #: batchers: while that is recent, every batcher keeps its backfills short, since the
        #: executor they share cannot be preempted (close_rule.batch_width).
        self.last_urgent_s = -math.inf
        #: What the executor's time due batches of `batch` rows may take (due_rows).
        self.due = DueAllowance()

    @property
    def num_tenants(self) -> int:
        """Tenants remembered (queued now, or served above the floor)."""
        return len(self._virtual_s)

    def virtual_s(self, tenant: str) -> float:
        """The tenant's weighted compute so far; a tenant never seen stands at the floor."""
        return self._virtual_s.get(tenant, self._floor_s)

    def lowest_s(self) -> float:
        """What `floor_s()` returns, without keeping it: for a reader that queues nothing."""
        if not self._queued:
            return self._floor_s
        least = min(self._virtual_s.get(t, self._floor_s) for t in self._queued)
        return max(self._floor_s, least)

    def floor_s(self, *, is_urgent: bool = False) -> float:
        """The least virtual time among tenants with queued work (with urgent work, if
        `is_urgent`: critical or interactive rows); with none queued, the floor as it last
        was. Never decreases."""
        self._floor_s = self.lowest_s()
        if not is_urgent:
            return self._floor_s
        self._urgent_floor_s = max(self._urgent_floor_s, self._floor_s)
        if self._queued_urgent:
            least = min(self._virtual_s.get(t, self._floor_s) for t in self._queued_urgent)
            self._urgent_floor_s = max(self._urgent_floor_s, least)
        return self._urgent_floor_s

    def has_queued_other_than(self, tenant: str) -> bool:
        """Whether a tenant other than `tenant` has rows queued, in any batcher sharing the
        ledger."""
        queued = self._queued
        return len(queued) > 1 or (len(queued) == 1 and tenant not in queued)

    def join(self, tenant: str, rows: int = 1, *, is_urgent: bool = False) -> None:
        """`rows` of the tenant's were queued (urgent: critical or interactive ones); a
        tenant that had none queued (none urgent) is lifted to the floor (the urgent one)."""
        queued = self._queued_urgent if is_urgent else self._queued
        if not queued[tenant]:
            floor_s = self.floor_s(is_urgent=is_urgent)
            self._virtual_s[tenant] = max(self._virtual_s.get(tenant, 0.0), floor_s)
        self._queued[tenant] += rows
        if is_urgent:
            self._queued_urgent[tenant] += rows

    def leave(self, tenant: str, rows: int = 1, *, is_urgent: bool = False) -> None:
        """`rows` of the tenant's (urgent ones, if `is_urgent`) left the queue (dispatched,
        expired or cancelled)."""
        if is_urgent:
            if (left_urgent := self._queued_urgent[tenant] - rows) > 0:
                self._queued_urgent[tenant] = left_urgent
            else:
                self._queued_urgent.pop(tenant, None)
        left = self._queued[tenant] - rows
        if left > 0:
            self._queued[tenant] = left
            return
        del self._queued[tenant]
        if len(self._virtual_s) > MAX_REMEMBERED_TENANTS:
            self._forget_idle()

    def charge(self, tenant: str, compute_s: float, weight: float) -> None:
        """The tenant was served `compute_s` seconds of compute at `weight`."""
        check_weight(weight)
        self._virtual_s[tenant] = self.virtual_s(tenant) + compute_s / weight

    def charge_rows(self, rows: Iterable[TenantRow], seconds_per_row: float) -> None:
        """Each of `rows` was served `seconds_per_row` (a batch's cost split over its rows):
        one charge per tenant and weight of the batch, not one per row."""
        counts: dict[tuple[str, float], int] = {}
        for row in rows:
            key = (row.tenant, row.weight)
            counts[key] = counts.get(key, 0) + 1
        for (tenant, weight), count in counts.items():
            self.charge(tenant, seconds_per_row * count, weight)

    def _forget_idle(self) -> None:
        floor_s = self.floor_s()
        for tenant in [t for t, v in self._virtual_s.items() if v <= floor_s]:
            if tenant not in self._queued:
                del self._virtual_s[tenant]
