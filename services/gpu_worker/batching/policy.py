"""The fixed-cost batching policy: "dispatch this batch now, or wake me at t".

A bigger batch amortizes the executor's fixed per-call cost but makes earlier items wait. The
batcher holds one queue per batch key and, each time the driver polls, drops items that can no
longer meet their queue limit (their deadline, or an online row's SLO bound), then either
closes one batch (and says why) or says when to ask again. Synchronous and pure: time comes in
as `now_s`, compute cost from the `LatencyModel`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Mapping, Sequence

from services.common.fair_rows import DEFAULT_WEIGHT
from services.common.priority import BATCH_QUEUE_SHARE
from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.batching.batch_sizes import BatchSizes
from services.gpu_worker.batching.choice import Choice, choose
from services.gpu_worker.batching.close_rule import URGENT_RECENT_S, assess, batch_width, linger_s
from services.gpu_worker.batching.due_rows import DUE_PATIENCE_SLOS
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.fairness import QueueShares, TenantQueues, check_tenant_weights
from services.gpu_worker.batching.forecast import PassBound, QueueForecast
from services.gpu_worker.batching.key_queue import KeyQueue
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.slo_shedding import admitted_alone
from services.gpu_worker.batching.types import (
    BATCH_RANK,
    BatcherConfig,
    BatchKey,
    CloseReason,
    Dispatch,
    Poll,
    QueuedItem,
    Wait,
)

#: Past this share of the queue, a tenant holding more than its weighted share of the queued
#: rows is refused before tenants under theirs are.
CONTENDED_QUEUE_SHARE = 0.5
#: The detail of a DEADLINE refusal for the limit of a row already queued in the batch the new
#: row would join (forecast.QueueForecast.makes_batch_mates_late), not the new row's own.
PAST_BATCH_MATES = "past the limit of a row already queued in its batch"


def executor_start_s(now_s: float, executor_free_s: float | None) -> float:
    """When the executor can start what is queued: now, or once the running batch is
    predicted to end (`executor_free_s`; in the past when the batch overruns)."""
    return now_s if executor_free_s is None else max(now_s, executor_free_s)


_ADMITTED = Admitted()  # it carries no data: one instance answers every call
_key_of_item = operator.attrgetter("key")


class Batcher(BatchSizes):
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
        super().__init__(config, latency)
        self._ledger = ComputeLedger() if ledger is None else ledger
        self._queues: dict[BatchKey, KeyQueue] = {}
        # The weight each tenant's latest row carried, for the queue-share check.
        self._weights: dict[str, float] = {}
        self._shares = QueueShares()
        # item_id -> key of every queued item: num_queued and cancel() without a scan.
        self._key_of: dict[int, BatchKey] = {}
        self._forecast = QueueForecast(
            self._queues, self._weights, self._ledger, latency, self.max_batch_size_for
        )
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
        return len(queue.items) if (queue := self._queues.get(key)) is not None else 0

    def max_wait_s(self, key: BatchKey) -> float:
        """The derived linger for `key`: what the SLO leaves after the upstream stages, the
        predicted compute of the next batch and the safety margin, clamped to [0, cap]. The
        next batch is sized by the rows more urgent than `batch` when there are any."""
        queue = self._queues.get(key)
        rows = 0 if queue is None else queue.items.count_at_most(BATCH_RANK - 1) or len(queue.items)
        n_next = min(max(rows, 1), self.max_batch_size_for(key))
        return linger_s(self._config, self._latency.predict(key, n_next))

    def can_admit(
        self, num_items: int, *, tenant: str | None = None, weight: float = 0.0, now_s: float = 0.0
    ) -> Admitted | Rejected:
        """Whether the queue has room for `num_items` more items now. A request's rows are
        queued all or none: the driver asks for all of them before it adds the first, so a
        request too big for the room left is refused whole, nothing queued. Room only: `add`
        still checks each item's deadline. A `tenant` (of `weight`) refused for a full queue at
        `now_s` shares the queue from then on (fairness.QueueShares)."""
        if self._is_draining:
            return Rejected(RejectReason.DRAINING)
        if self.num_queued + num_items > self._config.max_queue_size:
            if tenant is not None:
                self._crowded_out(tenant, weight, now_s)
            return Rejected(
                RejectReason.QUEUE_FULL,
                f"{num_items} rows, room for {self._config.max_queue_size - self.num_queued}",
            )
        return _ADMITTED

    def add(
        self,
        item: QueuedItem,
        now_s: float,
        *,
        executor_free_s: float | None = None,
        bound: PassBound | None = None,
    ) -> Admitted | Rejected:
        """Queue `item` (arriving at `now_s`) or say why not.

        `executor_free_s` is when the batch running now is predicted to end (None: nothing
        runs). The item is admitted if everything queued, it included, is predicted to finish
        by its own admission limit and the earliest queue limit of the others (see
        QueuedItem.finish_by_s, queue_limit_s): a new item may join the batch of items already
        admitted, and must not make them late.

        An idle lane (nothing queued, nothing running) refuses an item only if its own compute
        alone cannot meet its deadline (one admitted past its SLO bound is then held to its
        deadline: `admitted_alone`), and a lane with nothing queued prices it by its floor
        (predict_alone): refused items teach the latency model nothing.

        Priority and tenants: rows queued at a lower priority do not count as ahead of the item
        (they run after it); `batch` rows are refused once the queue is `BATCH_QUEUE_SHARE`
        full, and past `CONTENDED_QUEUE_SHARE` a tenant over its weighted share of the queue is
        refused (TENANT_SHARE; fairness.QueueShares). `bound`: the admission pass's
        (`pass_bound`), which spares a row it covers the per-row forecasts, to the same
        decision. Raises ValueError on a duplicate item_id, a caller bug."""
        if item.item_id in self._key_of:
            raise ValueError(f"item {item.item_id} is already queued")
        if item.weight <= 0.0:
            item = dataclasses.replace(item, weight=self.weight_of(item.tenant, item.weight))
        refusal = self.refusal(item, now_s, executor_free_s, bound)
        if refusal is not None:
            return refusal
        if executor_free_s is None and not self._key_of:
            alone_s = self._latency.predict_alone(item.key) + self._config.safety_margin_s
            item = admitted_alone(item, now_s + alone_s)
        if bound is not None:
            bound.admitted(item.key, item.queue_limit_s)
        self._weights[item.tenant] = item.weight
        self._queue_of(item.key).push(item, now_s)
        if item.priority < BATCH_RANK:
            self._ledger.last_urgent_s = now_s
        self._key_of[item.item_id] = item.key
        return _ADMITTED

    @property
    def unchecked_room(self) -> int:
        """Rows that may be queued now that no check of room, priority or tenant share would
        refuse, each checked after those before it (`refusal`): the queue stays under the
        shares at which those checks begin. 0 while draining."""
        if self._is_draining:
            return 0
        share = min(BATCH_QUEUE_SHARE, CONTENDED_QUEUE_SHARE)
        return max(0, math.ceil(self._config.max_queue_size * share) - self.num_queued)

    def push_admitted(self, items: Sequence[QueuedItem], now_s: float) -> None:
        """Queues `items`, admitted at `now_s` without `add`: within `unchecked_room`, covered
        by their pass's bound (forecast.PassBound.fits_whole), their weights resolved
        (`weight_of`). A run of one key at a time, in order: tenants join the shared ledger
        in the order of their rows, as one by one."""
        key_of, weights, is_urgent = self._key_of, self._weights, False
        for item in items:
            weights[item.tenant] = item.weight
            key_of[item.item_id] = item.key
            is_urgent = is_urgent or item.priority < BATCH_RANK
        for key, run in itertools.groupby(items, key=_key_of_item):
            self._queue_of(key).push_many(list(run), now_s)
        if is_urgent:
            self._ledger.last_urgent_s = now_s

    def _queue_of(self, key: BatchKey) -> KeyQueue:
        if (queue := self._queues.get(key)) is None:
            wait_s = DUE_PATIENCE_SLOS * self._config.slo_s  # a `batch` row's, to be kept
            queue = self._queues[key] = KeyQueue(TenantQueues(self._ledger), min_patience_s=wait_s)
        return queue

    def _crowded_out(self, tenant: str, weight: float, now_s: float) -> None:
        self._weights[tenant] = self.weight_of(tenant, weight)  # its share counts its weight
        self._shares.crowded_out(tenant, now_s)

    def weight_of(self, tenant: str, weight: float) -> float:
        """The fair-share weight a row of `tenant` carrying `weight` gets: its own when
        positive, else the configured one (DEFAULT_WEIGHT for a tenant not configured)."""
        return weight if weight > 0.0 else self._config.tenant_weights.get(tenant, DEFAULT_WEIGHT)

    def refusal(
        self,
        item: QueuedItem,
        now_s: float,
        executor_free_s: float | None,
        bound: PassBound | None = None,
    ) -> Rejected | None:
        """Why `item` may not be queued now (see `add`), or None."""
        cfg = self._config
        if self._is_draining:
            return Rejected(RejectReason.DRAINING)
        num_queued = self.num_queued
        if num_queued >= cfg.max_queue_size:
            self._crowded_out(item.tenant, item.weight, now_s)
            return Rejected(RejectReason.QUEUE_FULL)
        if item.priority >= BATCH_RANK and num_queued >= cfg.max_queue_size * BATCH_QUEUE_SHARE:
            return Rejected(RejectReason.QUEUE_FULL, "batch priority fills idle capacity only")
        shares = self._shares  # a tenant alone in a queue not full is within its share
        if num_queued >= cfg.max_queue_size * CONTENDED_QUEUE_SHARE and shares.is_shared(
            item.tenant, now_s, self._ledger
        ):
            queues = [queue.items for queue in self._queues.values()]
            if shares.is_over(item, queues, self._weights, cfg.max_queue_size, now_s):
                return Rejected(RejectReason.TENANT_SHARE)
        if executor_free_s is None and num_queued == 0:
            if now_s + self._latency.predict_alone(item.key) > item.deadline_s:
                return Rejected(RejectReason.DEADLINE)
            return None
        if bound is not None and bound.covers(
            item.key, item.admission_limit_s, cfg.safety_margin_s
        ):
            return None
        start_s = executor_start_s(now_s, executor_free_s)
        finish_s = self.predicted_finish_s(item.key, start_s, rank=item.priority, of=item)
        if finish_s + cfg.safety_margin_s > item.admission_limit_s:
            return Rejected(RejectReason.DEADLINE)
        if self._forecast.makes_batch_mates_late(item, start_s, finish_s, cfg.safety_margin_s):
            return Rejected(RejectReason.DEADLINE, PAST_BATCH_MATES)
        return None

    def pass_bound(
        self, rows: Mapping[BatchKey, int], now_s: float, executor_free_s: float | None
    ) -> PassBound:
        """The bound of an admission pass at `now_s` bringing `rows` per key (forecast.PassBound),
        the running batch predicted to end at `executor_free_s` (None: nothing runs)."""
        start_s = executor_start_s(now_s, executor_free_s)
        return self._forecast.pass_bound(rows, start_s)

    def oldest_urgent_wait_s(self, now_s: float) -> float:
        """How long the oldest online row still queued has waited; 0 when none is queued."""
        arrivals = [
            a for q in self._queues.values() if (a := q.oldest_urgent_arrival_s()) is not None
        ]
        return now_s - min(arrivals) if arrivals else 0.0

    def queued_at_most(self, rank: int) -> int:
        """Items queued at priority `rank` or more urgent, across keys."""
        return sum(queue.items.count_at_most(rank) for queue in self._queues.values())

    def predicted_finish_s(
        self,
        key: BatchKey,
        start_s: float,
        *,
        rank: int | None = None,
        of: QueuedItem | None = None,
    ) -> float:
        """When one more item of `key` would finish if the executor, free at `start_s`, ran
        what is queued first (forecast.QueueForecast.finish_s)."""
        return self._forecast.finish_s(key, start_s, rank=rank, of=of)

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
        """Drop items that can no longer meet their queue limit, then dispatch one batch or wait.

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
        key, reason, limit = choice.key, choice.reason, choice.width
        due = reason is CloseReason.BACKFILL_DUE  # its `batch` rows first, at full width
        if limit is None:
            limit = self.max_batch_size_for(key) if due else self._width(key, now_s)
        cost_s = self._latency.per_item_s(key, limit)
        items = self._queues[key].items.take(limit, cost_s, batch_first=due)
        # Fair share is charged in predicted compute: the batch's cost, split over its rows.
        row_cost_s = self._latency.predict(key, len(items)) / max(1, len(items))
        if due and now_s - self._ledger.last_urgent_s < URGENT_RECENT_S:  # lent by online rows
            self._ledger.due.spend(now_s, row_cost_s * len(items))  # (fair_share.DueAllowance)
        for item in items:
            del self._key_of[item.item_id]
        self._ledger.charge_rows(items, row_cost_s)
        return Poll(expired, Dispatch(key=key, items=tuple(items), reason=reason))

    def _width(self, key: BatchKey, now_s: float) -> int:
        """How many rows the next batch of `key` takes (close_rule.batch_width)."""
        return batch_width(
            key,
            self._queues[key],
            now_s,
            limit=self.max_batch_size_for(key),
            latency=self._latency,
            last_urgent_s=self._ledger.last_urgent_s,
            margin_s=self._config.safety_margin_s,
        )

    def urgency(self, now_s: float) -> tuple[float, float] | None:
        """(priority rank, tenant virtual seconds) of the batch an idle executor would get from
        this batcher now, or None if it would wait: the driver serves the most urgent of its
        batchers first. Changes nothing (items that expired stay until the next poll)."""
        choice = self._choose(now_s)
        return None if isinstance(choice, Wait) else choice.rank

    def head_rank(self) -> tuple[float, float] | None:
        """(priority rank, tenant virtual seconds) of the most urgent queued item, ready to
        dispatch or not; None if nothing is queued."""
        heads = [head[:2] for q in self._queues.values() if (head := q.items.head_rank())]
        return min(heads, default=None)

    def _choose(self, now_s: float, *, force: bool = False) -> Choice | Wait:
        """The key to dispatch now and why, or when to ask again (choice.choose)."""
        return choose(
            self._queues,
            lambda key, queue: self._assess(key, queue, now_s),
            lambda key: self._width(key, now_s),
            self._latency.predict,
            now_s,
            force=force,
        )

    def _expire(self, now_s: float) -> tuple[QueuedItem, ...]:
        """Remove items that would miss their queue limit even if run alone right now: their
        deadline, or an online row's SLO bound (`expiry_reason` tells which)."""
        expired: list[QueuedItem] = []
        for key, queue in self._queues.items():
            if queue.items:
                cutoff_s = now_s + self._latency.predict_alone(key)
                expired.extend(queue.pop_limit_before(cutoff_s))
        for item in expired:
            del self._key_of[item.item_id]
        return tuple(expired)

    def _expiry_s(self, key: BatchKey, queue: KeyQueue) -> float:
        """When the key's most urgent item will expire: past this, it cannot finish in time."""
        return queue.earliest_limit_s() - self._latency.predict_alone(key)

    def _assess(
        self, key: BatchKey, queue: KeyQueue, now_s: float
    ) -> tuple[CloseReason, None] | tuple[None, float]:
        """Why the key's batch should close now, or else when that could next change."""
        return assess(
            key,
            queue,
            now_s,
            config=self._config,
            latency=self._latency,
            limit=self.max_batch_size_for(key),
            is_draining=self._is_draining,
            due=self._ledger.due,
        )
