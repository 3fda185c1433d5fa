"""When the work queued on one batcher is predicted to finish: what the batching policy
admits by (a row is queued only if predicted to finish in time, without making the rows
already queued late).

Reads the batcher's live queues (the same dicts, never copied) and its latency model.
Synchronous and pure: start times come in as arguments."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from math import inf

from services.common.fair_rows import rows_ahead
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.key_queue import KeyQueue, drain_s, one_more_s
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.types import BatchKey, QueuedItem


class PassBound:
    """A bound on the deadline checks of one admission pass (several rows admitted at one
    instant, with nothing dispatched between them: a bundle's slices).

    `finish_s`: when everything queued at the pass's start, plus every row the pass brings, is
    predicted to be done, the executor free at the pass's `start_s`. No row of the pass can be
    predicted to finish later: what `QueueForecast.finish_s` counts ahead of a row is part of
    that, and a key's drain never shrinks as its rows grow (the latency model's curves are
    monotone). `earliest_limit_s`: the earliest queue limit (QueuedItem.queue_limit_s) of what
    was queued at the start and of the rows admitted since. While `finish_s` plus the margin
    is at most both that and a row's own limit, the row meets its limit and makes no
    batch-mate late, so its per-row forecasts (`Batcher.add`) are skipped: a pass of 64 rows
    reads the queues once, not 64 times.

    A pass that does not fit whole (a standing queue's) is bounded row by row instead, when
    something was queued at its start (`make_step`): from the first row the whole bound does
    not cover, the drain of every row queued then (`Step`, built once, from the queues), plus
    the rows admitted since (withdrawn ones too: an overcount only tightens it) and the row
    asking, kept up to date one row at a time, is the same bound for that row. A row it covers
    is spared its forecasts; one it does not takes them. A pass that fits whole builds none."""

    __slots__ = ("_make_step", "earliest_limit_s", "finish_s", "step")

    def __init__(
        self,
        finish_s: float,
        earliest_limit_s: float,
        make_step: Callable[[], Step] | None = None,
    ) -> None:
        self.finish_s = finish_s
        self.earliest_limit_s = earliest_limit_s
        self._make_step = make_step
        #: The pass's Step, once a row needed it (None before, and without `make_step`).
        self.step: Step | None = None

    def fits_whole(
        self, limit_s: float, margin_s: float, earliest_limit_s: float | None = None
    ) -> bool:
        """Whether a row with admission limit `limit_s` passes the deadline checks by the whole
        pass's bound alone (the queues not read); `earliest_limit_s` in place of the bound's
        own (a slice's rows checked before the bound is told of any)."""
        earliest_s = self.earliest_limit_s if earliest_limit_s is None else earliest_limit_s
        return self.finish_s + margin_s <= min(limit_s, earliest_s)

    def covers(self, key: BatchKey, limit_s: float, margin_s: float) -> bool:
        """Whether a row of `key` with admission limit `limit_s` surely passes the deadline
        checks."""
        if self.fits_whole(limit_s, margin_s):
            return True
        limit_s = min(limit_s, self.earliest_limit_s)
        if self.step is None:
            if self._make_step is None:
                return False
            self.step = self._make_step()
        return self.step.finish_bound_s(key) + margin_s <= limit_s

    def admitted(self, key: BatchKey, limit_s: float) -> None:
        """A row of `key` with queue limit `limit_s` joined the queue."""
        self.earliest_limit_s = min(self.earliest_limit_s, limit_s)
        if self.step is not None:
            self.step.admitted(key)


class Step:
    """The drain (seconds of compute from `start_s`, when the executor is free) of the rows
    queued at a pass's start (`counts` per key) and of every row the pass admits, kept as a
    running sum one admitted row at a time (key_queue.one_more_s). The sum is kept apart from
    `start_s`, the worker's clock (seconds since boot), and added to it once per check, as
    the per-row forecast adds its own drain: summed on the clock, each step would round at
    the clock's grain, days from boot a nanosecond in a few rows."""

    __slots__ = ("_counts", "_drain_s", "_gap_s", "_limit_for", "_predict", "_start_s")

    def __init__(
        self,
        counts: dict[BatchKey, int],
        start_s: float,
        latency: LatencyModel,
        limit_for: Callable[[BatchKey], int],
    ) -> None:
        self._counts = counts
        self._predict = latency.predict
        self._limit_for = limit_for
        self._start_s = start_s
        self._gap_s = latency.batch_gap_at(start_s)
        self._drain_s = drain_s(counts, self._predict, limit_for, self._gap_s)

    def finish_bound_s(self, key: BatchKey) -> float:
        """No earlier than the per-row forecast of one more row of `key` (QueueForecast.
        finish_s), rounding included: the drain with it, plus `_ROUNDING_S` for what the
        running sum and the forecast's own sum may round apart (at the drain's grain, far
        below it), then the clock, as the forecast adds it (rounding is monotone)."""
        return self._start_s + (self._drain_s + self._one_more_s(key) + _ROUNDING_S)

    def admitted(self, key: BatchKey) -> None:
        """A row of `key` joined the queue."""
        self._drain_s += self._one_more_s(key)
        self._counts[key] = self._counts.get(key, 0) + 1

    def _one_more_s(self, key: BatchKey) -> float:
        count = self._counts.get(key, 0)
        return one_more_s(key, count, self._predict, self._limit_for, self._gap_s)


#: What a step's running sum and a per-row forecast's own sum of the same drain may round
#: apart by, with room to spare: a row is covered only with this much left.
_ROUNDING_S = 1e-9


class QueueForecast:
    """The predicted drain of one batcher's queues: `queues` per key, the tenants' `weights`,
    the worker's fair-share `ledger`, and `limit_for(key)`, the most rows a batch of a key
    holds now."""

    def __init__(
        self,
        queues: Mapping[BatchKey, KeyQueue],
        weights: Mapping[str, float],
        ledger: ComputeLedger,
        latency: LatencyModel,
        limit_for: Callable[[BatchKey], int],
    ) -> None:
        self._queues = queues
        self._weights = weights
        self._ledger = ledger
        self._latency = latency
        self._limit_for = limit_for

    def finish_s(
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

        With nothing queued, the item runs alone: predicted by its floor (LatencyModel.
        predict_alone), as an idle lane's admission is, since a lane that refused every lone
        row on a learned slowdown would run no batch to correct it.
        """
        if not any(queue.items for queue in self._queues.values()):
            return start_s + self._latency.predict_alone(key)
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

    def makes_batch_mates_late(
        self, item: QueuedItem, start_s: float, finish_s: float, margin_s: float
    ) -> bool:
        """Whether `item`, joining a partly filled batch of its key, is what would push that
        batch past the earliest queue limit of the items already in it (less `margin_s`).
        A batch already predicted late without the item is not made late by it (one more row
        costs its marginal compute), and refusing the item would not save it. Conservative
        when several batches of the key are queued: the earliest limit may belong to an
        earlier, full batch."""
        queue = self._queues.get(item.key)
        if queue is None or not len(queue.items) % self._limit_for(item.key):
            return False
        mates_limit_s = queue.earliest_limit_s()
        if finish_s + margin_s <= mates_limit_s:
            return False
        queued = self._queued()
        return self._drain_s(item.key, start_s, queued, extra_rows=0) + margin_s <= mates_limit_s

    def pass_bound(self, rows: Mapping[BatchKey, int], start_s: float) -> PassBound:
        """The PassBound of an admission pass bringing `rows` (per key), the executor free at
        `start_s`. With nothing queued at its start, the pass's rows are priced by their floor
        (LatencyModel.predict_bounded), as a lone row is (`finish_s`), and have no step: the
        first row's own forecast prices it alone."""
        queued = self._queued()
        is_queued = any(queued.values())
        make_step = functools.partial(self._step, start_s) if is_queued else None
        predict = self._latency.predict if is_queued else self._latency.predict_bounded
        rows = {key: queued.get(key, 0) + count for key, count in rows.items()}
        earliest_s = min(
            (q.earliest_limit_s() for q in self._queues.values() if len(q.items)), default=inf
        )
        gap_s = self._latency.batch_gap_at(start_s)
        finish_s = start_s + drain_s({**queued, **rows}, predict, self._limit_for, gap_s)
        return PassBound(finish_s, earliest_s, make_step)

    def _step(self, start_s: float) -> Step:
        """The Step of what is queued now, the executor free at `start_s`."""
        return Step(self._queued(), start_s, self._latency, self._limit_for)

    def _queued(self) -> dict[BatchKey, int]:
        """Rows queued per key, at every priority."""
        return {k: len(q.items) for k, q in self._queues.items()}

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
        gap_s = self._latency.batch_gap_at(start_s)
        return start_s + drain_s(rows, self._latency.predict, self._limit_for, gap_s)
