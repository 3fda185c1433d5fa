"""The fixed-cost batching policy: "dispatch this batch now, or wake me at t".

A bigger batch amortizes the executor's fixed per-call cost but makes earlier items wait. The
batcher holds one queue per batch key and, each time the driver polls, drops items that can no
longer meet their deadline, then either closes one batch (and says why) or says when to ask
again. Synchronous and pure: time comes in as `now_s`, compute cost from the `LatencyModel`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.batching.fairness import DeficitRoundRobin, check_tenant_weights
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.types import (
    BatcherConfig,
    BatchKey,
    CloseReason,
    Dispatch,
    Poll,
    QueuedItem,
    Wait,
)

#: Weight of each new inter-arrival gap in the per-key EWMA.
ARRIVAL_GAP_ALPHA = 0.2

#: Floor on the arrival-gap estimate, so simultaneous arrivals give a large, finite rate.
_MIN_ARRIVAL_GAP_S = 1e-9


@dataclass
class _KeyQueue:
    """The queued items of one batch key, and what the policy has learned about its traffic.

    Kept after the queue empties: the arrival-rate estimate and the tenants' deficits belong to
    the key, not to one burst of it.
    """

    items: DeficitRoundRobin
    #: (arrival_s, item_id) min-heap for the oldest item; entries of items gone are stale.
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    #: (admission limit, item_id) min-heap for the tightest queued item; stale likewise.
    limits: list[tuple[float, int]] = field(default_factory=list)
    last_add_s: float | None = None
    #: EWMA of gaps between admissions; None until the second admission.
    mean_gap_s: float | None = None

    def oldest_arrival_s(self) -> float:
        while self.arrivals[0][1] not in self.items:
            heapq.heappop(self.arrivals)
        return self.arrivals[0][0]

    def earliest_limit_s(self) -> float:
        while self.limits[0][1] not in self.items:
            heapq.heappop(self.limits)
        return self.limits[0][0]

    def earliest_deadline_s(self) -> float:
        deadline_s = self.items.earliest_deadline_s()
        if deadline_s is None:
            raise RuntimeError("earliest_deadline_s() of an empty queue")
        return deadline_s


class Batcher:
    """Per-key queues of one worker's model, and the decision of which batch to run next."""

    def __init__(self, config: BatcherConfig, latency: LatencyModel) -> None:
        """Raises ValueError if `config` is inconsistent."""
        if config.max_batch_size < 1 or config.max_queue_size < 1:
            raise ValueError("max_batch_size and max_queue_size must be >= 1")
        if config.max_batch_tokens < 0 or config.min_expected_arrivals < 0:
            raise ValueError("max_batch_tokens and min_expected_arrivals must be >= 0")
        durations = (config.slo_s, config.upstream_budget_s, config.safety_margin_s)
        if min(*durations, config.max_wait_cap_s) < 0:
            raise ValueError("SLO, budgets, margin and max_wait cap must be >= 0 seconds")
        check_tenant_weights(config.tenant_weights)
        self._config = config
        self._latency = latency
        self._queues: dict[BatchKey, _KeyQueue] = {}
        # item_id -> key of every queued item: num_queued and cancel() without a scan.
        self._key_of: dict[int, BatchKey] = {}
        # key -> (latency model revision, max_batch_size_for): recomputed after observations.
        self._limits: dict[BatchKey, tuple[int, int]] = {}
        self._is_draining = False

    @property
    def num_queued(self) -> int:
        """Items queued across all keys."""
        return len(self._key_of)

    @property
    def is_draining(self) -> bool:
        """True after begin_drain(): nothing is admitted, everything queued is dispatched."""
        return self._is_draining

    def queued_keys(self) -> tuple[BatchKey, ...]:
        """Keys with at least one queued item, sorted."""
        return tuple(sorted(key for key, queue in self._queues.items() if queue.items))

    def queue_length(self, key: BatchKey) -> int:
        """Items queued for `key`."""
        queue = self._queues.get(key)
        return len(queue.items) if queue is not None else 0

    def shape_limit(self, key: BatchKey) -> int:
        """Most items one batch of `key` may ever hold: max_batch_size, and the padded-token
        cap. The shapes warm-up measures."""
        limit = self._config.max_batch_size
        if self._config.max_batch_tokens > 0 and key.bucket > 0:
            limit = min(limit, max(1, self._config.max_batch_tokens // key.bucket))
        return limit

    @property
    def batch_compute_budget_s(self) -> float:
        """The longest one batch may be predicted to run: half of what the SLO leaves the
        worker. A row that arrives as a batch starts waits for it, then runs in the next: two
        batches must fit the SLO, whatever else is queued (a long bucket's batch must not hold
        short rows past it)."""
        cfg = self._config
        return (cfg.slo_s - cfg.upstream_budget_s - cfg.safety_margin_s) / 2

    def max_batch_size_for(self, key: BatchKey) -> int:
        """Most items one batch of `key` holds now: the shape limit, and the largest batch
        predicted to run within `batch_compute_budget_s` (at least 1). It shrinks when the
        machine slows down and grows back with it."""
        cached = self._limits.get(key)
        if cached is not None and cached[0] == self._latency.revision:
            return cached[1]
        budget_s = self.batch_compute_budget_s
        low, high = 1, self.shape_limit(key)
        # Largest n with predict(n) <= budget: predictions are monotone in n.
        while low < high:
            middle = (low + high + 1) // 2
            if self._latency.predict(key, middle) <= budget_s:
                low = middle
            else:
                high = middle - 1
        self._limits[key] = (self._latency.revision, low)
        return low

    def max_wait_s(self, key: BatchKey) -> float:
        """The derived linger for `key`: what the SLO leaves after the upstream stages, the
        predicted compute of the next batch and the safety margin, clamped to [0, cap]."""
        cfg = self._config
        n_next = min(max(self.queue_length(key), 1), self.max_batch_size_for(key))
        compute_s = self._latency.predict(key, n_next)
        budget_s = cfg.slo_s - cfg.upstream_budget_s - compute_s - cfg.safety_margin_s
        return min(max(budget_s, 0.0), cfg.max_wait_cap_s)

    def can_admit(self, num_items: int) -> Admitted | Rejected:
        """Whether the queue has room for `num_items` more items now. A request's rows are
        queued all or none: the driver asks for all of them before it adds the first, so a
        request too big for the room left is refused whole, nothing queued. Room only: `add`
        still checks each item's deadline."""
        if self._is_draining:
            return Rejected(RejectReason.DRAINING)
        if self.num_queued + num_items > self._config.max_queue_size:
            return Rejected(
                RejectReason.QUEUE_FULL,
                f"{num_items} rows, room for {self._config.max_queue_size - self.num_queued}",
            )
        return Admitted()

    def add(
        self, item: QueuedItem, now_s: float, *, executor_free_s: float | None = None
    ) -> Admitted | Rejected:
        """Queue `item` (arriving at `now_s`) or say why not.

        `executor_free_s` is when the batch running now is predicted to end (None: nothing
        runs). The item is admitted if everything queued, it included, is predicted to finish
        by the earliest admission limit among them (see QueuedItem.finish_by_s): a new item
        may join the batch of items already admitted, and must not make them late.

        An idle lane (nothing queued, nothing running) refuses an item only if its own compute
        alone cannot meet its deadline: a prediction that refused every item would never be
        corrected, since refused items teach the latency model nothing. Raises ValueError on a
        duplicate item_id, a caller bug."""
        if self._is_draining:
            return Rejected(RejectReason.DRAINING)
        if self.num_queued >= self._config.max_queue_size:
            return Rejected(RejectReason.QUEUE_FULL)
        if item.item_id in self._key_of:
            raise ValueError(f"item {item.item_id} is already queued")
        if executor_free_s is None and self.num_queued == 0:
            if now_s + self._latency.predict(item.key, 1) > item.deadline_s:
                return Rejected(RejectReason.DEADLINE)
        else:
            start_s = now_s if executor_free_s is None else max(now_s, executor_free_s)
            finish_s = self.predicted_finish_s(item.key, start_s)
            if finish_s + self._config.safety_margin_s > item.admission_limit_s:
                return Rejected(RejectReason.DEADLINE)
            if self._makes_batch_mates_late(item, start_s, finish_s):
                return Rejected(RejectReason.DEADLINE)
        queue = self._queues.get(item.key)
        if queue is None:
            queue = self._queues[item.key] = _KeyQueue(
                DeficitRoundRobin(self._config.tenant_weights)
            )
        queue.items.push(item)
        heapq.heappush(queue.arrivals, (item.arrival_s, item.item_id))
        heapq.heappush(queue.limits, (item.admission_limit_s, item.item_id))
        # Entries of dispatched and expired items leave the heaps only from their tops.
        if len(queue.arrivals) > 2 * len(queue.items) + 64:
            queue.arrivals = [(i.arrival_s, i.item_id) for i in queue.items]
            heapq.heapify(queue.arrivals)
            queue.limits = [(i.admission_limit_s, i.item_id) for i in queue.items]
            heapq.heapify(queue.limits)
        self._key_of[item.item_id] = item.key
        self._record_arrival(queue, now_s)
        return Admitted()

    def _makes_batch_mates_late(self, item: QueuedItem, start_s: float, finish_s: float) -> bool:
        """Whether `item`, joining a partly filled batch of its key, is what would push that
        batch past the earliest admission limit of the items already in it. A batch already
        predicted late without the item is not made late by it (one more row costs its
        marginal compute), and refusing the item would not save it. Conservative when several
        batches of the key are queued: the earliest limit may belong to an earlier, full
        batch."""
        queue = self._queues.get(item.key)
        if queue is None or not len(queue.items) % self.max_batch_size_for(item.key):
            return False
        margin_s = self._config.safety_margin_s
        mates_limit_s = queue.earliest_limit_s()
        if finish_s + margin_s <= mates_limit_s:
            return False
        return self._drain_s(item.key, start_s, extra_rows=0) + margin_s <= mates_limit_s

    def predicted_finish_s(self, key: BatchKey, start_s: float) -> float:
        """When one more item of `key` would finish if the executor, free at `start_s`, ran
        everything queued now first, every key in batches as full as its limit allows.

        Conservative on purpose: queued items of other keys count as ahead even when their
        deadlines are later (the batcher serves the most urgent key first). Admitting only
        items that fit keeps the queue short enough to serve within deadlines; without it,
        overload fills the queue until every item waits about the whole SLO and most miss it.
        """
        return self._drain_s(key, start_s, extra_rows=1)

    def _drain_s(self, key: BatchKey, start_s: float, *, extra_rows: int) -> float:
        """When everything queued, plus `extra_rows` more of `key`, would be done."""
        finish_s = start_s
        for queued_key, queue in self._queues.items():
            rows = len(queue.items) + (extra_rows if queued_key == key else 0)
            if rows == 0:
                continue
            limit = self.max_batch_size_for(queued_key)
            full, rest = divmod(rows, limit)
            if full:
                finish_s += full * self._latency.predict(queued_key, limit)
            if rest:
                finish_s += self._latency.predict(queued_key, rest)
        if key not in self._queues and extra_rows:
            finish_s += self._latency.predict(key, extra_rows)
        return finish_s

    def cancel(self, item_id: int) -> bool:
        """Remove a queued item; True if it was queued (False if dispatched, expired or unknown)."""
        key = self._key_of.pop(item_id, None)
        if key is None:
            return False
        self._queues[key].items.remove(item_id)
        return True

    def begin_drain(self) -> None:
        """Stop admitting; from now on every poll with an idle executor dispatches at once."""
        self._is_draining = True

    def poll(self, now_s: float, *, executor_idle: bool) -> Poll:
        """Drop items that can no longer meet their deadline, then dispatch one batch or wait.

        A busy executor is never given work: items keep merging into bigger batches meanwhile,
        and the driver polls again once it is idle.
        """
        expired = self._expire(now_s)
        if not executor_idle:
            expiries = (self._expiry_s(key, q) for key, q in self._queues.items() if q.items)
            return Poll(expired, Wait(min(expiries, default=None)))
        chosen: tuple[float, BatchKey, CloseReason] | None = None
        wake_s: float | None = None
        for key, queue in self._queues.items():
            if not queue.items:
                continue
            assessment = self._assess(key, queue, now_s)
            if assessment[0] is None:  # not closing yet: [1] is when that could next change
                key_wake_s = assessment[1]
                wake_s = key_wake_s if wake_s is None else min(wake_s, key_wake_s)
                continue
            reason = assessment[0]
            candidate = (queue.earliest_deadline_s(), key, reason)
            # The most urgent key goes first; BatchKey order breaks ties deterministically.
            if chosen is None or candidate[:2] < chosen[:2]:
                chosen = candidate
        if chosen is None:
            return Poll(expired, Wait(wake_s))
        _, key, reason = chosen
        items = self._queues[key].items.take(self.max_batch_size_for(key))
        for item in items:
            del self._key_of[item.item_id]
        return Poll(expired, Dispatch(key=key, items=tuple(items), reason=reason))

    def _expire(self, now_s: float) -> tuple[QueuedItem, ...]:
        """Remove items that would miss their deadline even if run alone right now."""
        expired: list[QueuedItem] = []
        for key, queue in self._queues.items():
            if queue.items:
                cutoff_s = now_s + self._latency.predict(key, 1)
                expired.extend(queue.items.pop_deadline_before(cutoff_s))
        for item in expired:
            del self._key_of[item.item_id]
        return tuple(expired)

    def _expiry_s(self, key: BatchKey, queue: _KeyQueue) -> float:
        """When the key's most urgent item will expire: past this, it cannot finish in time."""
        return queue.earliest_deadline_s() - self._latency.predict(key, 1)

    def _assess(
        self, key: BatchKey, queue: _KeyQueue, now_s: float
    ) -> tuple[CloseReason, None] | tuple[None, float]:
        """Why the key's batch should close now, or else when that could next change."""
        cfg = self._config
        if self._is_draining:
            return CloseReason.DRAIN, None
        limit = self.max_batch_size_for(key)
        if len(queue.items) >= limit:
            return CloseReason.FULL, None
        compute_s = self._latency.predict(key, len(queue.items))
        slack_at_s = queue.earliest_deadline_s() - compute_s - cfg.safety_margin_s
        if now_s > slack_at_s:
            return CloseReason.DEADLINE, None
        linger_end_s = queue.oldest_arrival_s() + self.max_wait_s(key)
        if now_s >= linger_end_s:
            return CloseReason.LINGER, None
        gap_s = self._arrival_gap_s(queue, now_s)
        # Expected arrivals before the linger ends; none expected with no rate estimate yet.
        expected = 0.0 if gap_s is None else (linger_end_s - now_s) / gap_s
        if expected < cfg.min_expected_arrivals:
            return CloseReason.IDLE, None
        wake_s = min(linger_end_s, slack_at_s, self._expiry_s(key, queue))
        if gap_s is not None:
            wake_s = min(wake_s, self._idle_at_s(queue, linger_end_s))
        return None, wake_s

    def _record_arrival(self, queue: _KeyQueue, now_s: float) -> None:
        if queue.last_add_s is not None:
            gap_s = max(now_s - queue.last_add_s, 0.0)
            if queue.mean_gap_s is None:
                queue.mean_gap_s = gap_s
            else:
                queue.mean_gap_s += ARRIVAL_GAP_ALPHA * (gap_s - queue.mean_gap_s)
        queue.last_add_s = now_s

    @staticmethod
    def _arrival_gap_s(queue: _KeyQueue, now_s: float) -> float | None:
        """Expected seconds between arrivals, or None with fewer than two arrivals so far."""
        if queue.mean_gap_s is None or queue.last_add_s is None:
            return None
        # A silence longer than the usual gap is itself evidence that traffic has slowed.
        return max(queue.mean_gap_s, now_s - queue.last_add_s, _MIN_ARRIVAL_GAP_S)

    def _idle_at_s(self, queue: _KeyQueue, linger_end_s: float) -> float:
        """When the work-conserving trigger will fire if nothing else arrives.

        Expected arrivals (linger_end - t) / max(mean_gap, t - last_add) fall as t grows; this
        is the t where they cross min_expected_arrivals, first while the mean gap dominates,
        else once the silence since the last arrival does.
        """
        if queue.mean_gap_s is None or queue.last_add_s is None:
            return linger_end_s
        wanted = self._config.min_expected_arrivals
        last_add_s = queue.last_add_s
        mean_gap_s = max(queue.mean_gap_s, _MIN_ARRIVAL_GAP_S)
        while_mean_s = linger_end_s - wanted * mean_gap_s
        if while_mean_s <= last_add_s + mean_gap_s:
            return while_mean_s
        return (linger_end_s + wanted * last_add_s) / (1.0 + wanted)
