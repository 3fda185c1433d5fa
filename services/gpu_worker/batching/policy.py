"""The fixed-cost batching policy: "dispatch this batch now, or wake me at t".

A bigger batch amortizes the executor's fixed per-call cost but makes earlier items wait. The
batcher holds one queue per batch key and, each time the driver polls, drops items that can no
longer meet their deadline, then either closes one batch (and says why) or says when to ask
again. Synchronous and pure: time comes in as `now_s`, compute cost from the `LatencyModel`.
"""

from __future__ import annotations

import dataclasses
import heapq

from services.common.fair_rows import DEFAULT_WEIGHT, rows_ahead
from services.common.priority import PriorityClass
from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.fairness import TenantQueues, check_tenant_weights, is_over_share
from services.gpu_worker.batching.key_queue import KeyQueue, drain_s
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

#: `batch` rows are admitted only while the queue is less full than this share of its size:
#: they fill idle capacity and are the first to be refused when it runs out.
BATCH_QUEUE_SHARE = 0.5
#: Past this share of the queue, a tenant holding more than its weighted share of the queued
#: rows is refused before tenants under theirs are.
CONTENDED_QUEUE_SHARE = 0.5

#: `batch` rows may lengthen a batch's predicted compute by at most this share of what its
#: interactive rows alone would take: they ride the executor's spare width (large on a GPU,
#: where a wider batch costs little more; about none on a CPU, where each row costs its own).
BATCH_RIDE_SHARE = 0.1
#: While more urgent rows arrived this recently (on the worker, for any model), a batch of
#: `batch` rows only is held to what one urgent row costs (x 1 + BATCH_RIDE_SHARE): an urgent
#: row arriving as it starts waits for it, and the executor cannot be preempted. After a
#: longer silence it is full width.
URGENT_RECENT_S = 1.0

_BATCH_RANK = PriorityClass.BATCH.rank
# `Admitted` carries no data: one instance answers every call.
_ADMITTED = Admitted()


@dataclasses.dataclass(frozen=True, slots=True)
class _Choice:
    """The key `_choose` picked and why, with its urgency (priority rank, tenant virtual
    seconds); `width` is the batch's row count when the choice already had to compute it."""

    rank: tuple[int, float]
    key: BatchKey
    reason: CloseReason
    width: int | None = None


class Batcher:
    """Per-key queues of one worker's model, and the decision of which batch to run next."""

    def __init__(
        self, config: BatcherConfig, latency: LatencyModel, ledger: ComputeLedger | None = None
    ) -> None:
        """`ledger`: the worker-wide fair-share ledger every batcher of the worker shares (a
        batcher of its own without one). Raises ValueError if `config` is inconsistent."""
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
        self._ledger = ComputeLedger() if ledger is None else ledger
        self._queues: dict[BatchKey, KeyQueue] = {}
        # The weight each tenant's latest row carried, for the queue-share check.
        self._weights: dict[str, float] = {}
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

    def _urgent_or_all(self, key: BatchKey) -> int:
        """Rows of `key` more urgent than `batch`, or, when there are none, all its rows."""
        queue = self._queues.get(key)
        if queue is None:
            return 0
        return queue.items.count_at_most(_BATCH_RANK - 1) or len(queue.items)

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
        limit = self._latency.largest_batch_within(key, self.shape_limit(key), budget_s)
        self._limits[key] = (self._latency.revision, limit)
        return limit

    def max_wait_s(self, key: BatchKey) -> float:
        """The derived linger for `key`: what the SLO leaves after the upstream stages, the
        predicted compute of the next batch and the safety margin, clamped to [0, cap]. The
        next batch is sized by the rows more urgent than `batch` when there are any."""
        n_next = min(max(self._urgent_or_all(key), 1), self.max_batch_size_for(key))
        return self._linger_s(self._latency.predict(key, n_next))

    def _linger_s(self, compute_s: float) -> float:
        """The linger before a batch predicted to compute for `compute_s` (`max_wait_s`)."""
        cfg = self._config
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
        return _ADMITTED

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
        corrected, since refused items teach the latency model nothing.

        Priority and tenants: rows queued at a lower priority do not count as ahead of the item
        (they run after it); `batch` rows are refused once the queue is `BATCH_QUEUE_SHARE`
        full, and past `CONTENDED_QUEUE_SHARE` a tenant over its weighted share of the queue is
        refused (TENANT_SHARE). Raises ValueError on a duplicate item_id, a caller bug."""
        if item.item_id in self._key_of:
            raise ValueError(f"item {item.item_id} is already queued")
        if item.weight <= 0.0:
            item = dataclasses.replace(item, weight=self.weight_of(item.tenant, item.weight))
        refusal = self._refusal(item, now_s, executor_free_s)
        if refusal is not None:
            return refusal
        self._weights[item.tenant] = item.weight
        queue = self._queues.get(item.key)
        if queue is None:
            queue = self._queues[item.key] = KeyQueue(TenantQueues(self._ledger))
        queue.items.push(item)
        heapq.heappush(queue.limits, (item.admission_limit_s, item.item_id))
        if item.priority < _BATCH_RANK:
            # Linger and the arrival rate are the urgent rows' own: `batch` rows are a backlog
            # (a job's chunk arrives 64 rows at once), not traffic a batch should wait for.
            heapq.heappush(queue.arrivals, (item.arrival_s, item.item_id))
            queue.record_arrival(now_s)
            self._ledger.last_urgent_s = now_s
        # Entries of dispatched and expired items leave the heaps only from their tops.
        if len(queue.limits) > 2 * len(queue.items) + 64:
            queue.arrivals = [(i.arrival_s, i.item_id) for i in queue.items
                              if i.priority < _BATCH_RANK]  # fmt: skip
            heapq.heapify(queue.arrivals)
            queue.limits = [(i.admission_limit_s, i.item_id) for i in queue.items]
            heapq.heapify(queue.limits)
        self._key_of[item.item_id] = item.key
        return _ADMITTED

    def weight_of(self, tenant: str, weight: float) -> float:
        """The fair-share weight a row of `tenant` carrying `weight` gets: its own when
        positive, else the configured one (DEFAULT_WEIGHT for a tenant not configured)."""
        if weight > 0.0:
            return weight
        return self._config.tenant_weights.get(tenant, DEFAULT_WEIGHT)

    def _refusal(
        self, item: QueuedItem, now_s: float, executor_free_s: float | None
    ) -> Rejected | None:
        """Why `item` may not be queued now (see `add`), or None."""
        cfg = self._config
        if self._is_draining:
            return Rejected(RejectReason.DRAINING)
        num_queued = self.num_queued
        if num_queued >= cfg.max_queue_size:
            return Rejected(RejectReason.QUEUE_FULL)
        if item.priority >= _BATCH_RANK and num_queued >= cfg.max_queue_size * BATCH_QUEUE_SHARE:
            return Rejected(RejectReason.QUEUE_FULL, "batch priority fills idle capacity only")
        if num_queued >= cfg.max_queue_size * CONTENDED_QUEUE_SHARE:
            queues = [queue.items for queue in self._queues.values()]
            if is_over_share(item, queues, self._weights, cfg.max_queue_size):
                return Rejected(RejectReason.TENANT_SHARE)
        if executor_free_s is None and num_queued == 0:
            if now_s + self._latency.predict(item.key, 1) > item.deadline_s:
                return Rejected(RejectReason.DEADLINE)
            return None
        start_s = now_s if executor_free_s is None else max(now_s, executor_free_s)
        finish_s = self.predicted_finish_s(item.key, start_s, rank=item.priority, of=item)
        if finish_s + cfg.safety_margin_s > item.admission_limit_s:
            return Rejected(RejectReason.DEADLINE)
        if self._makes_batch_mates_late(item, start_s, finish_s):
            return Rejected(RejectReason.DEADLINE)
        return None

    def oldest_urgent_wait_s(self, now_s: float) -> float:
        """How long the oldest online row still queued has waited; 0 when none is queued."""
        arrivals = [
            a for q in self._queues.values() if (a := q.oldest_urgent_arrival_s()) is not None
        ]
        return now_s - min(arrivals) if arrivals else 0.0

    def queued_at_most(self, rank: int) -> int:
        """Items queued at priority `rank` or more urgent, across keys."""
        return sum(queue.items.count_at_most(rank) for queue in self._queues.values())

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
        queued = {k: len(q.items) for k, q in self._queues.items()}
        return self._drain_s(item.key, start_s, queued, extra_rows=0) + margin_s <= mates_limit_s

    def predicted_finish_s(
        self,
        key: BatchKey,
        start_s: float,
        *,
        rank: int | None = None,
        of: QueuedItem | None = None,
    ) -> float:
        """When one more item of `key` would finish if the executor, free at `start_s`, ran
        everything queued now first, every key in batches as full as its limit allows; with
        `rank`, only what is queued at that priority or a more urgent one (the rest runs after);
        with `of`, the new item, only the part of other tenants' rows that fair share serves
        before it (fairness.rows_ahead): a light tenant is not refused for a flooder's queue.

        Conservative on purpose: queued items of other keys count as ahead even when their
        deadlines are later (the batcher serves the most urgent key first). Admitting only
        items that fit keeps the queue short enough to serve within deadlines; without it,
        overload fills the queue until every item waits about the whole SLO and most miss it.
        """
        if of is not None and rank is not None and not self._has_other_tenants(of.tenant):
            # Fair share serves all of a lone tenant's own rows first: rows_ahead's answer.
            rows = {k: q.items.count_at_most(rank) for k, q in self._queues.items()}
        elif of is not None and rank is not None:
            per_key = {k: q.items.rows_by_tenant(rank) for k, q in self._queues.items()}
            rows = rows_ahead(per_key, of.tenant, of.weight, self._weights)
        else:
            rows = {k: q.items.count_at_most(rank) if rank is not None else len(q.items)
                    for k, q in self._queues.items()}  # fmt: skip
        return self._drain_s(key, start_s, rows, extra_rows=1)

    def _has_other_tenants(self, tenant: str) -> bool:
        """Whether any tenant but `tenant` has rows queued here, at any priority."""
        if not self._ledger.has_queued_other_than(tenant):  # none on the whole worker
            return False
        return any(t != tenant for q in self._queues.values() for t in q.items.tenants())

    def _drain_s(
        self, key: BatchKey, start_s: float, rows: dict[BatchKey, int], *, extra_rows: int
    ) -> float:
        """When `rows` (per key), plus `extra_rows` more of `key`, would be done."""
        rows = {**rows, key: rows.get(key, 0) + extra_rows}
        return start_s + drain_s(rows, self._latency.predict, self.max_batch_size_for)

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

    def poll(self, now_s: float, *, executor_idle: bool, force: bool = False) -> Poll:
        """Drop items that can no longer meet their deadline, then dispatch one batch or wait.

        A busy executor is never given work: items keep merging into bigger batches meanwhile,
        and the driver polls again once it is idle. `force`: close a batch now even if every
        key would rather linger (reason FAIR_SHARE): the driver's call when this batcher holds
        the most urgent work on the worker and another would otherwise take the executor.
        """
        expired = self._expire(now_s)
        if not executor_idle:
            expiries = (self._expiry_s(key, q) for key, q in self._queues.items() if q.items)
            return Poll(expired, Wait(min(expiries, default=None)))
        choice = self._choose(now_s, force=force)
        if isinstance(choice, Wait):
            return Poll(expired, choice)
        key, reason = choice.key, choice.reason
        limit = self._width(key, now_s) if choice.width is None else choice.width
        items = self._queues[key].items.take(limit, self._latency.per_item_s(key, limit))
        # Fair share is charged in predicted compute: the batch's cost, split over its rows.
        row_cost_s = self._latency.predict(key, len(items)) / max(1, len(items))
        for item in items:
            del self._key_of[item.item_id]
            self._ledger.charge(item.tenant, row_cost_s, item.weight)
        return Poll(expired, Dispatch(key=key, items=tuple(items), reason=reason))

    def _width(self, key: BatchKey, now_s: float) -> int:
        """How many rows the next batch of `key` takes (urgent rows first, then `batch` ones):
        `batch` rows must not cost more urgent rows their latency, and the executor cannot be
        preempted.

        - With urgent rows in the batch, `batch` rows fill it only as far as they lengthen its
          predicted compute by BATCH_RIDE_SHARE of the urgent rows' alone.
        - A batch of `batch` rows only (a backfill), while urgent rows arrived within
          URGENT_RECENT_S, is held to about one urgent row's compute: an urgent row arriving
          as it starts waits for all of it. After a longer silence it is as wide as any batch
          (throughput: a job on an otherwise idle worker); the first urgent row after the
          silence may wait for one, as `batch_compute_budget_s` allows.
        """
        limit = self.max_batch_size_for(key)
        urgent = min(self._queues[key].items.count_at_most(_BATCH_RANK - 1), limit)
        if urgent:
            budget_s = self._latency.predict(key, urgent) * (1.0 + BATCH_RIDE_SHARE)
            return max(urgent, self._latency.largest_batch_within(key, limit, budget_s))
        if now_s - self._ledger.last_urgent_s >= URGENT_RECENT_S:
            return limit
        one_row_s = self._latency.predict(key, 1) * (1.0 + BATCH_RIDE_SHARE)
        return self._latency.largest_batch_within(key, limit, one_row_s)

    def urgency(self, now_s: float) -> tuple[int, float] | None:
        """(priority rank, tenant virtual seconds) of the batch an idle executor would get from
        this batcher now, or None if it would wait: the driver serves the most urgent of its
        batchers first. Changes nothing (items that expired stay until the next poll)."""
        choice = self._choose(now_s)
        return None if isinstance(choice, Wait) else choice.rank

    def head_rank(self) -> tuple[int, float] | None:
        """(priority rank, tenant virtual seconds) of the most urgent queued item, ready to
        dispatch or not; None if nothing is queued."""
        heads = [head[:2] for q in self._queues.values() if (head := q.items.head_rank())]
        return min(heads, default=None)

    def _choose(self, now_s: float, *, force: bool = False) -> _Choice | Wait:
        """The key to dispatch now and why, with its urgency, or when to ask again. Among keys
        ready to close (with `force`, every key with items): the most urgent priority class,
        then the tenant furthest below its fair share, then the earliest deadline; BatchKey
        order breaks ties. With none ready, a backfill (a key with `batch` rows only), if it is
        predicted to end before another key's lingering urgent rows are due (it cannot be
        preempted)."""
        chosen: tuple[tuple[int, float, float], BatchKey, CloseReason] | None = None
        backfill: tuple[tuple[int, float, float], BatchKey, CloseReason] | None = None
        wake_s: float | None = None
        for key, queue in self._queues.items():
            if not queue.items:
                continue
            assessment = self._assess(key, queue, now_s)
            if assessment[0] is None and force:
                assessment = (CloseReason.FAIR_SHARE, None)
            if assessment[0] is None:  # urgent rows linger: [1] is when that could next change
                key_wake_s = assessment[1]
                wake_s = key_wake_s if wake_s is None else min(wake_s, key_wake_s)
                continue
            reason = assessment[0]
            head = queue.items.head_rank()
            if head is None:  # not reached: a queue with items has a head
                continue
            candidate = ((head[0], head[1], queue.earliest_deadline_s()), key, reason)
            if reason is CloseReason.BACKFILL:
                if backfill is None or candidate[:2] < backfill[:2]:
                    backfill = candidate
            elif chosen is None or candidate[:2] < chosen[:2]:
                chosen = candidate
        if chosen is None and backfill is not None:
            (priority, virtual_s, _), key, reason = backfill
            width = self._width(key, now_s)
            if wake_s is None or now_s + self._latency.predict(key, width) <= wake_s:
                return _Choice((priority, virtual_s), key, reason, width)
        if chosen is None:
            return Wait(wake_s)
        (priority, virtual_s, _), key, reason = chosen
        return _Choice((priority, virtual_s), key, reason)

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

    def _expiry_s(self, key: BatchKey, queue: KeyQueue) -> float:
        """When the key's most urgent item will expire: past this, it cannot finish in time."""
        return queue.earliest_deadline_s() - self._latency.predict(key, 1)

    def _assess(
        self, key: BatchKey, queue: KeyQueue, now_s: float
    ) -> tuple[CloseReason, None] | tuple[None, float]:
        """Why the key's batch should close now, or else when that could next change."""
        cfg = self._config
        if self._is_draining:
            return CloseReason.DRAIN, None
        # The urgent rows decide; `batch` rows alone are a backlog, run whenever the executor
        # has nothing more urgent (and ride along with urgent rows, `_width`).
        urgent = queue.items.count_at_most(_BATCH_RANK - 1)
        if not urgent:
            return CloseReason.BACKFILL, None
        limit = self.max_batch_size_for(key)
        # Lingering trades the urgent rows' latency for fuller batches, worth it only while the
        # executor would otherwise idle: with `batch` rows queued it never does, so they close
        # at once (and `batch` rows ride along as far as `_width` lets them).
        if urgent >= limit or len(queue.items) > urgent:
            return CloseReason.FULL, None
        compute_s = self._latency.predict(key, urgent)
        deadline_s = queue.earliest_deadline_s()
        slack_at_s = deadline_s - compute_s - cfg.safety_margin_s
        if now_s > slack_at_s:
            return CloseReason.DEADLINE, None
        # max_wait_s(key), whose next batch is these `urgent` rows (fewer than `limit`).
        linger_end_s = queue.oldest_arrival_s() + self._linger_s(compute_s)
        if now_s >= linger_end_s:
            return CloseReason.LINGER, None
        gap_s = queue.arrival_gap_s(now_s)
        # Expected arrivals before the linger ends; none expected with no rate estimate yet.
        expected = 0.0 if gap_s is None else (linger_end_s - now_s) / gap_s
        if expected < cfg.min_expected_arrivals:
            return CloseReason.IDLE, None
        expiry_s = deadline_s - self._latency.predict(key, 1)  # _expiry_s(key, queue)
        wake_s = min(linger_end_s, slack_at_s, expiry_s)
        if gap_s is not None:
            wake_s = min(wake_s, queue.idle_at_s(linger_end_s, cfg.min_expected_arrivals))
        if cfg.min_expected_arrivals > 0 and gap_s is not None and queue.last_add_s is not None:
            payoff_gap_s = self._linger_payoff_gap_s(key, urgent, compute_s)
            if gap_s >= payoff_gap_s:
                return CloseReason.IDLE, None
            # The silence since the last arrival counts as the gap: past this, waiting stops
            # paying even if nobody comes.
            wake_s = min(wake_s, queue.last_add_s + payoff_gap_s)
        return None, wake_s

    def _linger_payoff_gap_s(self, key: BatchKey, num_rows: int, compute_s: float) -> float:
        """How soon the next row must be expected for an idle executor to wait for it rather
        than run the `num_rows` queued now (`compute_s`, their predicted compute).

        One step of lookahead, in total latency of the queued rows and the next one, arriving
        g from now. Run now: the queued rows finish at c(k) each; the newcomer waits for the
        executor, then runs alone, c(1) more. Wait: all k + 1 finish at g + c(k + 1). Waiting
        pays exactly when g < c(1) / (k + 1) - (c(k + 1) - c(k)): a batch's fixed cost, shared
        by more rows, against the wait every queued row pays. A flat curve (a GPU) lingers
        until about c(1) / g rows have gathered; a steep one (each row costs its own compute,
        a small CPU model) or sparse arrivals dispatch at once, and traffic still batches as
        the rows that arrive while a batch runs form the next one (the executor clocks it)."""
        marginal_s = self._latency.predict(key, num_rows + 1) - compute_s
        return self._latency.predict(key, 1) / (num_rows + 1) - marginal_s
