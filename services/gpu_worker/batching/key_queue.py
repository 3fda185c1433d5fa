"""The queue of one batch key, and what the batching policy learns about its traffic."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from services.common.moving_average import MovingAverage
from services.gpu_worker.batching.fairness import TenantQueues
from services.gpu_worker.batching.types import BATCH_RANK, BatchKey, QueuedItem

#: Weight of each new inter-arrival gap in the per-key EWMA.
ARRIVAL_GAP_ALPHA = 0.2

#: Floor on the arrival-gap estimate, so simultaneous arrivals give a large, finite rate.
_MIN_ARRIVAL_GAP_S = 1e-9


@dataclass
class KeyQueue:
    """The queued items of one batch key, and what the policy has learned about its traffic.

    Kept after the queue empties: the arrival-rate estimate belongs to the key, not to one
    burst of it.
    """

    items: TenantQueues
    #: (arrival_s, item_id) min-heap for the oldest item; entries of items gone are stale.
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    #: (queue limit, item_id) min-heap for the tightest queued item (QueuedItem.queue_limit_s);
    #: stale likewise.
    limits: list[tuple[float, int]] = field(default_factory=list)
    #: (queue limit, item_id, protected) of the `batch` rows, sorted (earliest first), stale
    #: likewise: a backlog held back on purpose, until it is due (due_rows.due_limit_s).
    #: A row is protected, its due time kept, when its deadline left it at least
    #: `min_patience_s` on arrival; one asking for less is a backfill only.
    batch_limits: list[tuple[float, int, bool]] = field(default_factory=list)
    min_patience_s: float = 0.0
    #: `batch` rows pushed so far, and what due_rows.due_limit_s last computed (its stamp,
    #: when the rows come due, the deadline of the row that makes them).
    batch_pushes: int = 0
    due_stamp: tuple[int, int, int, int] | None = None
    due_at_s: float = math.inf
    due_limit_s: float = math.inf
    last_add_s: float | None = None
    #: Gaps between admissions; its mean is None until the second admission.
    gaps: MovingAverage = field(default_factory=lambda: MovingAverage(ARRIVAL_GAP_ALPHA))

    def oldest_arrival_s(self) -> float:
        while self.arrivals[0][1] not in self.items:
            heapq.heappop(self.arrivals)
        return self.arrivals[0][0]

    def oldest_urgent_arrival_s(self) -> float | None:
        """Arrival of the oldest row queued ahead of `batch` (the heap holds only those), or
        None when there is none."""
        while self.arrivals and self.arrivals[0][1] not in self.items:
            heapq.heappop(self.arrivals)
        return self.arrivals[0][0] if self.arrivals else None

    def earliest_limit_s(self) -> float:
        """The earliest queue limit of the queued items (QueuedItem.queue_limit_s): when the
        tightest of them must finish."""
        while self.limits[0][1] not in self.items:
            heapq.heappop(self.limits)
        return self.limits[0][0]

    def _batch_entry(self, item: QueuedItem) -> tuple[float, int, bool]:
        limit_s = item.queue_limit_s
        return (limit_s, item.item_id, limit_s - item.arrival_s >= self.min_patience_s)

    def pop_limit_before(self, cutoff_s: float) -> list[QueuedItem]:
        """Removes and returns every item whose queue limit is strictly before `cutoff_s`."""
        due: list[QueuedItem] = []
        while self.limits and self.limits[0][0] < cutoff_s:
            item = self.items.remove(heapq.heappop(self.limits)[1])
            if item is not None:
                due.append(item)
        return due

    def push(self, item: QueuedItem, now_s: float) -> None:
        """Queues `item`, admitted at `now_s`. Linger and the arrival rate are the urgent rows'
        own: `batch` rows are a backlog (a job's chunk arrives 64 rows at once), not traffic a
        batch should wait for."""
        self.items.push(item)
        heapq.heappush(self.limits, (item.queue_limit_s, item.item_id))
        if item.priority < BATCH_RANK:
            heapq.heappush(self.arrivals, (item.arrival_s, item.item_id))
            self.record_arrival(now_s)
        else:
            bisect.insort(self.batch_limits, self._batch_entry(item))
            self.batch_pushes += 1
        entries = max(len(self.limits), len(self.arrivals), len(self.batch_limits))
        if entries > 2 * len(self.items) + 64:
            self._rebuild_heaps()

    def push_many(self, items: Sequence[QueuedItem], now_s: float) -> None:
        """Queues `items`, admitted at `now_s`, as `push` each would (the same items, counts and
        estimate; stale heap entries pruned once, not per item): the counts once a class, the
        arrivals once."""
        self.items.push_many(items)
        limits, arrivals, urgent = self.limits, self.arrivals, 0
        for item in items:
            heapq.heappush(limits, (item.queue_limit_s, item.item_id))
            if item.priority < BATCH_RANK:
                heapq.heappush(arrivals, (item.arrival_s, item.item_id))
                urgent += 1
        if urgent < len(items):  # a job's chunk: sorted in once
            self.batch_pushes += len(items) - urgent
            self.batch_limits.extend(
                self._batch_entry(i) for i in items if i.priority >= BATCH_RANK
            )
            self.batch_limits.sort()
        if urgent:
            self.record_arrival(now_s, urgent)
        entries = max(len(self.limits), len(self.arrivals), len(self.batch_limits))
        if entries > 2 * len(self.items) + 64:
            self._rebuild_heaps()

    def _rebuild_heaps(self) -> None:
        """Entries of dispatched and expired items leave the heaps only from their tops (expiry
        empties the top of `limits`, not of the others, so any may grow): rebuilt from the
        items once they outnumber them twice over."""
        self.arrivals = [(i.arrival_s, i.item_id) for i in self.items
                         if i.priority < BATCH_RANK]  # fmt: skip
        heapq.heapify(self.arrivals)
        self.limits = [(i.queue_limit_s, i.item_id) for i in self.items]
        heapq.heapify(self.limits)
        self.batch_limits = sorted(self._batch_entry(i) for i in self.items
                                   if i.priority >= BATCH_RANK)  # fmt: skip

    def record_arrival(self, now_s: float, count: int = 1) -> None:
        """Folds `count` admissions at `now_s` into the arrival-gap estimate (after the first,
        each a gap of 0)."""
        if self.last_add_s is not None:
            self.gaps.observe(max(now_s - self.last_add_s, 0.0))
        self.last_add_s = now_s
        if count > 1:
            self.gaps.observe_repeated(0.0, count - 1)

    def arrival_gap_s(self, now_s: float) -> float | None:
        """Expected seconds between arrivals, or None with fewer than two arrivals so far."""
        mean_gap_s = self.gaps.mean
        if mean_gap_s is None or self.last_add_s is None:
            return None
        # A silence longer than the usual gap is itself evidence that traffic has slowed.
        return max(mean_gap_s, now_s - self.last_add_s, _MIN_ARRIVAL_GAP_S)

    def idle_at_s(self, linger_end_s: float, wanted: float) -> float:
        """When the work-conserving trigger will fire if nothing else arrives.

        Expected arrivals (linger_end - t) / max(mean_gap, t - last_add) fall as t grows; this
        is the t where they cross `wanted` (min_expected_arrivals), first while the mean gap
        dominates, else once the silence since the last arrival does.
        """
        if self.gaps.mean is None or self.last_add_s is None:
            return linger_end_s
        last_add_s = self.last_add_s
        mean_gap_s = max(self.gaps.mean, _MIN_ARRIVAL_GAP_S)
        while_mean_s = linger_end_s - wanted * mean_gap_s
        if while_mean_s <= last_add_s + mean_gap_s:
            return while_mean_s
        return (linger_end_s + wanted * last_add_s) / (1.0 + wanted)


def drain_s(
    rows: Mapping[BatchKey, int],
    predict: Callable[[BatchKey, int], float],
    limit_for: Callable[[BatchKey], int],
    gap_s: float = 0.0,
) -> float:
    """Predicted compute of `rows` per key, every key in batches as full as `limit_for` allows
    (`predict(key, n)`: one batch of n rows of the key), and `gap_s` before each batch (the
    executor idle between batches while rows wait: LatencyModel.batch_gap_at)."""
    total_s = 0.0
    for key, count in rows.items():
        if count <= 0:
            continue
        limit = limit_for(key)
        full, rest = divmod(count, limit)
        if full:
            total_s += full * (predict(key, limit) + gap_s)
        if rest:
            total_s += predict(key, rest) + gap_s
    return total_s


def one_more_s(
    key: BatchKey,
    count: int,
    predict: Callable[[BatchKey, int], float],
    limit_for: Callable[[BatchKey], int],
    gap_s: float = 0.0,
) -> float:
    """What one more row of `key` adds to `drain_s` of rows holding `count` of it: a batch of
    its own (and its gap) when the last batch is full, else that batch's growth by one row."""
    rest = count % limit_for(key)
    if not rest:
        return predict(key, 1) + gap_s
    return predict(key, rest + 1) - predict(key, rest)
