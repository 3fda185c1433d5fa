"""Weighted deficit round robin across tenants, for the queued items of one batch key.

Each tenant has its own queue in earliest-deadline-first order. Tenants take turns; a turn is
worth `weight` items, so a tenant flooding the queue gets its share of every batch and no more.
Deficits persist between batches (a batch may close in the middle of a tenant's turn), which is
what keeps shares exact over many small batches. Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator, Mapping

from services.gpu_worker.batching.types import QueuedItem

#: Weight of a tenant that `tenant_weights` does not list.
DEFAULT_WEIGHT = 1.0

#: Heap entry: (deadline_s, arrival_s, item_id) gives EDF, then arrival, then id.
_Entry = tuple[float, float, int]


def check_tenant_weights(tenant_weights: Mapping[str, float]) -> None:
    """Raise ValueError unless every weight is positive and finite."""
    bad = sorted(t for t, w in tenant_weights.items() if not (math.isfinite(w) and w > 0.0))
    if bad:
        raise ValueError(f"tenant weights must be positive and finite; bad tenants: {bad}")


class DeficitRoundRobin:
    """The items of one batch key: EDF per tenant, tenants interleaved by weighted DRR."""

    def __init__(self, tenant_weights: Mapping[str, float]) -> None:
        """`tenant_weights`: relative shares; unlisted tenants get `DEFAULT_WEIGHT`."""
        check_tenant_weights(tenant_weights)
        self._weights = dict(tenant_weights)
        # Turns are scaled so the lightest possible tenant's turn is worth exactly one item:
        # every turn then takes at least one item and take() never spins through empty rounds.
        self._min_weight = min([DEFAULT_WEIGHT, *self._weights.values()])
        self._items: dict[int, QueuedItem] = {}
        # Heaps are pruned lazily: an entry whose id is no longer in _items is stale.
        self._heaps: dict[str, list[_Entry]] = {}
        self._num_stale = 0
        # Tenants with a heap, in turn order; the head's turn is in progress.
        self._turns: deque[str] = deque()
        self._deficits: dict[str, float] = {}
        self._is_head_credited = False

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def __iter__(self) -> Iterator[QueuedItem]:
        return iter(self._items.values())

    def push(self, item: QueuedItem) -> None:
        """Queue `item`; a tenant new to the rotation joins at the back with no deficit."""
        if item.item_id in self._items:
            raise ValueError(f"item {item.item_id} is already queued")
        self._items[item.item_id] = item
        heap = self._heaps.get(item.tenant)
        if heap is None:
            heap = self._heaps[item.tenant] = []
            self._turns.append(item.tenant)
            self._deficits[item.tenant] = 0.0
        heapq.heappush(heap, (item.deadline_s, item.arrival_s, item.item_id))

    def remove(self, item_id: int) -> QueuedItem | None:
        """Remove one item (cancelled); returns it, or None if it was not queued."""
        item = self._items.pop(item_id, None)
        if item is not None:
            self._num_stale += 1
            # Cancelled entries deep in a heap are only popped when they reach the top; rebuild
            # once they outnumber live ones so memory stays O(queued).
            if self._num_stale > len(self._items) + 64:
                self._rebuild_heaps()
        return item

    def earliest_deadline_s(self) -> float | None:
        """The earliest deadline among queued items, or None if empty."""
        heads = [heap[0][0] for heap in self._heaps.values() if self._prune(heap)]
        return min(heads, default=None)

    def pop_deadline_before(self, cutoff_s: float) -> list[QueuedItem]:
        """Remove and return every item whose deadline is strictly before `cutoff_s`."""
        due: list[QueuedItem] = []
        for heap in self._heaps.values():
            while self._prune(heap) and heap[0][0] < cutoff_s:
                due.append(self._items.pop(heapq.heappop(heap)[2]))
        return due

    def take(self, limit: int) -> list[QueuedItem]:
        """Remove and return up to `limit` items in DRR order (EDF within each tenant)."""
        batch: list[QueuedItem] = []
        while len(batch) < limit and self._turns:
            tenant = self._turns[0]
            heap = self._heaps[tenant]
            if not self._prune(heap):
                self._leave(tenant)
                continue
            if not self._is_head_credited:
                self._deficits[tenant] += (
                    self._weights.get(tenant, DEFAULT_WEIGHT) / self._min_weight
                )
                self._is_head_credited = True
            while len(batch) < limit and self._deficits[tenant] >= 1.0 and self._prune(heap):
                batch.append(self._items.pop(heapq.heappop(heap)[2]))
                self._deficits[tenant] -= 1.0
            if not self._prune(heap):
                self._leave(tenant)
            elif self._deficits[tenant] < 1.0:
                self._turns.rotate(-1)
                self._is_head_credited = False
            # Otherwise the batch is full mid-turn: the tenant keeps the head and its deficit.
        return batch

    def _prune(self, heap: list[_Entry]) -> bool:
        """Drop stale entries from the top; True if a live item remains."""
        while heap and heap[0][2] not in self._items:
            heapq.heappop(heap)
            self._num_stale -= 1
        return bool(heap)

    def _leave(self, tenant: str) -> None:
        """The head tenant has nothing queued: it leaves the rotation and, as in classic DRR,
        forfeits its deficit so that idle time cannot be saved up and spent as a burst."""
        self._turns.popleft()
        del self._heaps[tenant]
        del self._deficits[tenant]
        self._is_head_credited = False

    def _rebuild_heaps(self) -> None:
        heaps: dict[str, list[_Entry]] = {tenant: [] for tenant in self._turns}
        for item in self._items.values():
            heaps[item.tenant].append((item.deadline_s, item.arrival_s, item.item_id))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps
        self._num_stale = 0
