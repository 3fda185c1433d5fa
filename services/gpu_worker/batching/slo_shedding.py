"""When a row must be predicted to finish within its model's SLO, not just its deadline.

A model with `shed_past_slo` always bounds new rows by the SLO. Every other model does so
while its queue stands (issue 33): a queue that stays long turns every caller's patience into
waiting, and past capacity everyone's answer is late. The test is CoDel's (services.common.
standing_queue), derived from the SLO: the queue stands once, dispatch after dispatch for a
whole SLO, each dispatch left online rows queued that had already waited above a tenth of it
(and above the longest linger the batcher chooses on purpose).
A batch takes the newest rows with the oldest, so what a dispatch leaves behind is what tells
a standing queue from a burst: a burst drains, and its bursts' callers are all served. Once
standing, the queue is held so for HOLD_INTERVALS after the last dispatch that left a row above
the target or the last online row bound by the SLO refused behind a wait above it (`refused`):
under a flood, a batch that takes every row, or the bound's own refusals, empty the queue
between arrivals, and ending the standing there let the next interval's rows queue up to their
deadlines (docs/benchmarks.md, item 4).

A row bound by the SLO may be admitted by more spreads of its lane's scale than the lane's
`prediction_spreads` (`slo_share`, `DriverConfig.slo_prediction_spreads`, as many by default),
where a row bound by its caller's deadline alone keeps the lane's: four everywhere kept a
flood's accepted p99 within the SLO and refused part of a cold burst; four against the SLO
alone refused part of the normal traffic right after a flood (docs/benchmarks.md, item 4).
Once queued, a row is held to its whole SLO budget (QueuedItem.queue_limit_s).

Only online rows (interactive, critical) are bounded so; `batch` rows may queue up to their
deadline. An online row admitted with the SLO bound is held to it while queued: once its own
compute could no longer end within it, the batcher drops it unrun (PAST_SLO), and it is refused
with a retry hint as admission refuses, since an answer past the SLO is the late answer the
bound exists to prevent, and its place in a batch can still serve a row in time. Rows keep
their place by deadline (a bound row does not overtake an older one without a bound), and
`batch` rows, which a model with `shed_past_slo` admits to the SLO too, are held to their
deadline: the batcher holds a backfill back on purpose. Pure: time comes in as `now_s`. The
worker's lanes and the simulator's use it alike.
"""

from __future__ import annotations

import dataclasses

from services.common.priority import PriorityClass
from services.common.standing_queue import StandingQueue
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.types import BatchKey, QueuedItem

#: The queue stands once what dispatches leave behind has waited above this share of the SLO...
TARGET_SLO_SHARE = 0.1
#: ...for this share of it.
INTERVAL_SLO_SHARE = 1.0
#: A queue that stood keeps standing until, for this many intervals, no dispatch has left a row
#: above the target and no online row bound by the SLO was refused after a wait above it
#: (StandingQueue.hold_s, `SloShedding.refused`): under a flood, a batch that takes every row
#: queued, and the bound's own refusals, empty the queue between arrivals.
HOLD_INTERVALS = 4.0
#: Rows at this rank or more urgent are online traffic.
_URGENT_RANK = PriorityClass.INTERACTIVE.rank
#: Why the batcher dropped a row unrun (`WORKER_DROPPED_TOTAL`'s reason): its deadline could no
#: longer be met, or only the SLO bound admission set could not (its deadline still could).
EXPIRED, PAST_SLO = "expired", "past_slo"


def standing_queue_for(slo_s: float, *, min_target_s: float = 0.0) -> StandingQueue:
    """CoDel's test of a queue serving a model of `slo_s`: a wait above TARGET_SLO_SHARE of the
    SLO (at least `min_target_s`) for INTERVAL_SLO_SHARE of it, held HOLD_INTERVALS (the
    worker's lanes here, and its generation engines: generation.standing_shedding)."""
    target_s = max(TARGET_SLO_SHARE * slo_s, min_target_s)
    interval_s = INTERVAL_SLO_SHARE * slo_s
    return StandingQueue(target_s, interval_s, hold_s=HOLD_INTERVALS * interval_s)


def admitted_alone(item: QueuedItem, finish_s: float) -> QueuedItem:
    """`item` as an idle lane queues it, its own compute predicted to end at `finish_s` (the
    safety margin included). One that cannot meet its SLO bound so is admitted to its deadline
    (Batcher.add: a refused row teaches the latency model nothing) and is held to that, not
    dropped unrun at once."""
    if item.finish_by_s is None or finish_s <= item.finish_by_s:
        return item
    return dataclasses.replace(item, finish_by_s=None)


def expiry_reason(item: QueuedItem, finish_s: float) -> str:
    """Why the batcher dropped `item` unrun, its own compute predicted to end at `finish_s`
    at the soonest: PAST_SLO while its deadline would still allow that, else EXPIRED."""
    return EXPIRED if finish_s > item.deadline_s else PAST_SLO


class SloShedding:
    """One lane's rule: the SLO budget of a new row, or None for its deadline alone."""

    def __init__(
        self,
        slo_s: float,
        *,
        shed_past_slo: bool,
        upstream_budget_s: float,
        max_linger_s: float,
        slo_spreads: float | None = None,
    ) -> None:
        """`slo_spreads`: the spreads a row is predicted with against its SLO bound for
        admission (`slo_share`; None: those of its lane's predictions)."""
        self._budget_s = slo_s - upstream_budget_s
        self._always = shed_past_slo
        self._slo_spreads = slo_spreads
        # A row may wait up to `max_linger_s` on purpose (lingering to fill its batch while
        # another key's batch leaves): only a wait past that, and past the target, is queueing.
        self.queue = standing_queue_for(slo_s, min_target_s=max_linger_s)

    @classmethod
    def for_model(cls, slo_s: float, shed_past_slo: bool, driver: DriverConfig) -> SloShedding:
        """A model's rule under the driver's budgets (the worker's lanes and the simulator's)."""
        return cls(
            slo_s,
            shed_past_slo=shed_past_slo,
            upstream_budget_s=driver.upstream_budget_s,
            max_linger_s=driver.max_wait_cap_s,
            slo_spreads=driver.slo_prediction_spreads,
        )

    def after_dispatch(self, now_s: float, oldest_left_wait_s: float) -> None:
        """A dispatch at `now_s` left online rows queued, the oldest of which has waited
        `oldest_left_wait_s` (0 when it left none)."""
        self.queue.observe(now_s, oldest_left_wait_s)

    def refused(
        self, now_s: float, item: QueuedItem, finish_s: float, latency: LatencyModel
    ) -> None:
        """`item` was refused at `now_s` as predicted to finish at `finish_s`, past its limit
        (`latency`: its lane's model). An online row whose limit was the SLO bound, turned away
        from a wait above the target (its predicted finish less its own compute), holds a
        standing queue (StandingQueue.hold): the queue is short because its rows are refused.
        Without this, the bound would end the standing it answers, and the next interval's
        rows, bound by their deadlines alone, would queue up to them. A row refused for its
        own deadline, a `batch` row, or one whose own compute is what misses the SLO says
        nothing about the queue, and holds nothing."""
        if item.priority > _URGENT_RANK or not item.is_slo_bound:
            return
        if finish_s - now_s - latency.predict_alone(item.key) > self.queue.target_s:
            self.queue.hold(now_s)

    def slo_share(self, latency: LatencyModel, key: BatchKey) -> float:
        """The share of its SLO budget a new row of `key` bound by it may fill, as `latency` (its
        lane's model) predicts, for admission (QueuedItem.slo_share): the share that predictions
        at the lane's margin fill where predictions at `slo_spreads` would fill it whole
        (LatencyModel.budget_share). So a row bound by the SLO is admitted by the slow end of
        its batches' times, and a row bound by its caller's deadline alone (a burst's) by the
        lane's own margin. Never above 1: a setting of fewer spreads than the lane's cuts
        nothing."""
        if self._slo_spreads is None:
            return 1.0
        # Fewer spreads than the lane's would admit rows past the bound they are held to.
        return min(1.0, latency.budget_share(key, self._slo_spreads))

    def budget_s(self, now_s: float, rank: int, num_queued: int) -> float | None:
        """Seconds a new row of priority `rank`, arriving at `now_s` with `num_queued` rows
        queued, may take to finish, or None (its deadline bounds it)."""
        if num_queued == 0:
            # Empty: the queue drained (its rows ran, expired or were withdrawn), whatever the
            # last dispatch saw.
            self.queue.observe(now_s, 0.0)
        if self._always:
            return self._budget_s
        if rank <= _URGENT_RANK and self.queue.stands_at(now_s):
            return self._budget_s
        return None
