"""The queued items of one batch key, in the order the worker serves them.

Priority first: a batch takes `critical` rows before `interactive` ones and those before
`batch` ones. Within a class, the tenant with the least weighted compute on the worker goes
next (fair_share.ComputeLedger, shared by every key on the worker), so a tenant flooding the
queue gets its share of every batch and no more, and shares hold across keys and models.
Within a tenant and class, earliest deadline first. Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence

from services.common.fair_rows import DEFAULT_WEIGHT
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.types import BATCH_RANK, DUE_RANK, QueuedItem

#: Heap entry: (deadline_s, arrival_s, item_id) gives EDF, then arrival, then id.
_Entry = tuple[float, float, int]
#: A heap per (priority rank, tenant).
_Class = tuple[int, str]
#: What orders the heads of the heaps: (priority rank, virtual seconds, tenant's join order).
Rank = tuple[float, float, int]


def check_tenant_weights(tenant_weights: Mapping[str, float]) -> None:
    """Raise ValueError unless every weight is positive and finite."""
    bad = sorted(t for t, w in tenant_weights.items() if not (math.isfinite(w) and w > 0.0))
    if bad:
        raise ValueError(f"tenant weights must be positive and finite; bad tenants: {bad}")


#: How long a tenant refused for a full queue still counts as queued (`QueueShares`).
CROWDED_OUT_S = 2.0


class QueueShares:
    """Each tenant's weighted share of a worker's queue, among the tenants queued and those
    refused because the queue was full in the last CROWDED_OUT_S. A tenant alone in the queue
    may fill it; once another was turned away, both count, so the one holding the queue is
    refused past its share as its rows leave, and the other's retry finds room."""

    def __init__(self) -> None:
        self._crowded_out_s: dict[str, float] = {}

    def crowded_out(self, tenant: str, now_s: float) -> None:
        """`tenant` was refused now: the queue was full."""
        self._crowded_out_s[tenant] = now_s

    def is_shared(self, tenant: str, now_s: float, ledger: ComputeLedger) -> bool:
        """Whether another tenant shares the queue with `tenant`: one has rows queued on the
        worker (`ledger`), or was crowded out within CROWDED_OUT_S of `now_s`. When none does
        and the queue is not full, `is_over` is False for `tenant` (its rows are the queue's,
        its share the whole queue), so its count of every tenant's rows may be spared: a
        one-tenant flood would take it for every row."""
        if ledger.has_queued_other_than(tenant):
            return True
        since_s = now_s - CROWDED_OUT_S
        return any(t != tenant and at_s > since_s for t, at_s in self._crowded_out_s.items())

    def is_over(
        self,
        item: QueuedItem,
        queues: Iterable[TenantQueues],
        weights: Mapping[str, float],
        size: int,
        now_s: float,
    ) -> bool:
        """Whether `item`'s tenant already holds its share of a queue of `size` items held in
        `queues`: the part of `size` its weight gives it among the tenants sharing the queue
        (it included). `weights`: the tenants' weights (DEFAULT_WEIGHT for those missing)."""
        rows: Counter[str] = Counter()
        for queue in queues:
            for tenant in queue.tenants():
                rows[tenant] += queue.tenant_rows(tenant)
        if self._crowded_out_s:  # the recent ones only
            since_s = now_s - CROWDED_OUT_S
            recent = {t: at_s for t, at_s in self._crowded_out_s.items() if at_s > since_s}
            self._crowded_out_s = recent
        sharing = {*rows, *self._crowded_out_s} - {item.tenant}
        others = sum(weights.get(t, DEFAULT_WEIGHT) for t in sharing)
        # Alone, its share is the whole queue: size * w / w may round just below it.
        share = size * item.weight / (others + item.weight) if others else size
        return rows[item.tenant] + 1 > share


class TenantQueues:
    """The items of one batch key: by priority, then weighted fair share, then EDF."""

    def __init__(self, ledger: ComputeLedger) -> None:
        self._ledger = ledger
        self._items: dict[int, QueuedItem] = {}
        # Heaps are pruned lazily: an entry whose id is no longer in _items is stale.
        self._heaps: dict[_Class, list[_Entry]] = {}
        self._num_stale = 0
        self._by_rank: Counter[int] = Counter()
        self._by_class: Counter[_Class] = Counter()
        self._by_tenant: Counter[str] = Counter()
        # Order in which tenants with queued items joined: breaks ties like a DRR rotation.
        self._joined: dict[str, int] = {}
        self._join_order = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def __iter__(self) -> Iterator[QueuedItem]:
        return iter(self._items.values())

    def count_at_most(self, rank: int) -> int:
        """Items queued at priority `rank` or more urgent (ranks ascend toward `batch`)."""
        return sum(n for r, n in self._by_rank.items() if r <= rank)

    def rows_by_tenant(self, rank: int) -> Counter[str]:
        """Items per tenant queued at priority `rank` or more urgent."""
        counts: Counter[str] = Counter()
        for (priority, tenant), n in self._by_class.items():
            if priority <= rank:
                counts[tenant] += n
        return counts

    def tenant_rows(self, tenant: str) -> int:
        """Items of `tenant` queued here."""
        return self._by_tenant[tenant]

    def tenants(self) -> Iterator[str]:
        """Tenants with items queued here."""
        return iter(self._by_tenant)

    def push(self, item: QueuedItem) -> None:
        """Queue `item`; a tenant new to the queue joins behind those already in it."""
        if item.item_id in self._items:
            raise ValueError(f"item {item.item_id} is already queued")
        self._items[item.item_id] = item
        cls = (item.priority, item.tenant)
        heapq.heappush(
            self._heaps.setdefault(cls, []), (item.deadline_s, item.arrival_s, item.item_id)
        )
        self._count(cls, 1)

    def push_many(self, items: Sequence[QueuedItem]) -> None:
        """Queue `items`, in order, as `push` each would: the counts and the ledger move once
        per class of them, not once per item (an admission pass queues a bundle's rows at
        once)."""
        own, heaps = self._items, self._heaps
        counts: dict[_Class, int] = {}
        for item in items:
            if item.item_id in own:
                raise ValueError(f"item {item.item_id} is already queued")
            own[item.item_id] = item
            cls = (item.priority, item.tenant)
            heapq.heappush(
                heaps.setdefault(cls, []), (item.deadline_s, item.arrival_s, item.item_id)
            )
            counts[cls] = counts.get(cls, 0) + 1
        for cls, count in counts.items():  # in order of first arrival: the tenants' join order
            self._count(cls, count)

    def _count(self, cls: _Class, count: int) -> None:
        """`count` items of class `cls` joined the queue."""
        priority, tenant = cls
        self._by_rank[priority] += count
        self._by_class[cls] += count
        self._by_tenant[tenant] += count
        if tenant not in self._joined:
            self._joined[tenant] = next(self._join_order)
        self._ledger.join(tenant, count, is_urgent=priority < BATCH_RANK)

    def remove(self, item_id: int) -> QueuedItem | None:
        """Remove one item (cancelled or expired); returns it, or None if it was not queued."""
        item = self._items.pop(item_id, None)
        if item is not None:
            self._forget(item)
            self._num_stale += 1
            # Cancelled entries deep in a heap are only popped when they reach the top; rebuild
            # once they outnumber live ones so memory stays O(queued).
            if self._num_stale > len(self._items) + 64:
                self._rebuild_heaps()
        return item

    def head_rank(self) -> Rank | None:
        """The rank of the item `take` would take first, or None if empty."""
        ranks = [self._rank(cls) for cls, heap in self._heaps.items() if self._prune(heap)]
        return min(ranks, default=None)

    def take(self, limit: int, row_cost_s: float, *, batch_first: bool = False) -> list[QueuedItem]:
        """Remove and return up to `limit` items, each time from the most urgent class and,
        within it, the tenant with the least virtual time counting the rows it already got in
        this batch at `row_cost_s` each (the ledger is charged for them after the batch is
        formed). EDF within a tenant and class. `batch_first`: `batch` rows after critical rows
        and before the others, earliest deadline first whatever their tenant (they are due,
        due_rows.due_limit_s: by deadline, not share)."""
        live = [cls for cls, heap in self._heaps.items() if self._prune(heap)]
        if len(live) == 1:
            batch = self._take_from(self._heaps[live[0]], limit)
        else:
            unit_s = row_cost_s if row_cost_s > 0.0 else 1.0
            batch = self._take_ranked(limit, unit_s, batch_first)
        self._heaps = {cls: heap for cls, heap in self._heaps.items() if heap}
        return batch

    def _take_from(self, heap: list[_Entry], limit: int) -> list[QueuedItem]:
        """`take` from a queue whose items are all of one class: its heap's order (EDF), as
        ranking one class against itself at every item would give."""
        items = self._items
        batch: list[QueuedItem] = []
        while len(batch) < limit and self._prune(heap):
            batch.append(items.pop(heapq.heappop(heap)[2]))
        if batch:  # one class: its counts and its tenant's ledger move once
            self._forget(batch[0], len(batch))
        return batch

    def _take_ranked(
        self, limit: int, unit_s: float, batch_first: bool = False
    ) -> list[QueuedItem]:
        """`take`, ranking the classes again for every item."""
        taken_s: dict[str, float] = {}
        batch: list[QueuedItem] = []
        while len(batch) < limit:
            live = [cls for cls, heap in self._heaps.items() if self._prune(heap)]
            if not live:
                break
            priority, tenant = min(
                live, key=lambda c: self._rank(c, taken_s.get(c[1], 0.0), batch_first)
            )
            item = self._pop(self._heaps[(priority, tenant)])
            batch.append(item)
            taken_s[tenant] = taken_s.get(tenant, 0.0) + unit_s / item.weight
        return batch

    def _rank(self, cls: _Class, extra_s: float = 0.0, batch_first: bool = False) -> Rank:
        priority, tenant = cls
        if batch_first and priority >= BATCH_RANK:  # after critical rows, EDF across tenants
            return (DUE_RANK, self._heaps[cls][0][0], self._joined[tenant])
        return (priority, self._ledger.virtual_s(tenant) + extra_s, self._joined[tenant])

    def _pop(self, heap: list[_Entry]) -> QueuedItem:
        item = self._items.pop(heapq.heappop(heap)[2])
        self._forget(item)
        return item

    def _forget(self, item: QueuedItem, count: int = 1) -> None:
        """Counts of `count` items of `item`'s class that left the queue (taken, expired or
        cancelled)."""
        self._by_rank[item.priority] -= count
        self._by_class[(item.priority, item.tenant)] -= count
        if not self._by_class[(item.priority, item.tenant)]:
            del self._by_class[(item.priority, item.tenant)]
        self._by_tenant[item.tenant] -= count
        if not self._by_tenant[item.tenant]:
            del self._by_tenant[item.tenant]
            del self._joined[item.tenant]  # rejoins at the back, as in a DRR rotation
        self._ledger.leave(item.tenant, count, is_urgent=item.priority < BATCH_RANK)

    def _prune(self, heap: list[_Entry]) -> bool:
        """Drop stale entries from the top; True if a live item remains."""
        while heap and heap[0][2] not in self._items:
            heapq.heappop(heap)
            self._num_stale -= 1
        return bool(heap)

    def _rebuild_heaps(self) -> None:
        heaps: dict[_Class, list[_Entry]] = {}
        for item in self._items.values():
            entry = (item.deadline_s, item.arrival_s, item.item_id)
            heaps.setdefault((item.priority, item.tenant), []).append(entry)
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps
        self._num_stale = 0
