"""How long the executor stands idle between batches while rows wait for it.

A batch's end reaches the event loop as a callback; the loop answers its rows and dispatches
the next batch on later turns. On an idle loop that costs tens of microseconds. On a loop
busy taking a flood's bundles, each turn runs every message that arrived meanwhile, and the
executor waits out several turns between batches: the stand-in's batches of 64 rows run 2.4
ms and, with 280 bundles a second arriving, the executor idled 3-5 ms between them. A queue
the latency model (executor time only) forecast to drain within the SLO took twice as long,
and under a 2x flood, when refusing cost the loop as much as serving, 20-60 times.

`BatchGap` measures that idle time: from a batch's end to the next batch's start on the
executor, when the next batch closed full with every one of its rows queued by that end (so
it could have started then: neither a linger the policy chose nor arrivals still to come
filled the wait). A batch that found no rows waiting when the one before it ended says the
loop kept up: a measurement of 0. Any other batch measures nothing. The estimate is an EWMA,
each measurement bounded by a multiple of it, and forecasts read it halved every half second
no batch refreshed it (LatencyModel.batch_gap_at). They add it once a batch
(key_queue.drain_s), so the queue admitted is the queue the loop can drain in time, and a
flood past that is refused at the bundle door (bundle_door) before its rows cost the loop
more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import Gauge

from services.gpu_worker.batching.lane import Lane
from services.gpu_worker.batching.types import CloseReason, Dispatch
from services.gpu_worker.device_busy import DeviceBusy

#: Weight of a new measurement in the EWMA (about the last ten batches count).
ALPHA = 0.2
#: A measurement counts for at most this many times the estimate (or MIN_BOUND_S): one stall
#: (a collection, a version's warm-up between batches) moves it by at most 1.6x, where a
#: flood's loop, gap after gap, takes it from 5 to 100 ms within seven batches.
MAX_RATIO = 4.0
MIN_BOUND_S = 0.005


class BatchGap:
    """The EWMA of the executor's idle time between batches while rows wait. Pure: times
    come in as arguments, on the driver's clock."""

    def __init__(self, gauge: Gauge | None = None) -> None:
        """`gauge`: where `ran` exports the estimate."""
        self._gauge = gauge
        self.gap_s = 0.0
        # When the last batch ended on the executor with rows still queued (None: none were).
        self._backlog_end_s: float | None = None

    def observe(
        self, started_s: float, ended_s: float, *, full_at_s: float | None, rows_waiting: bool
    ) -> float:
        """A batch ran on the executor from `started_s` to `ended_s`; it closed full, its last
        row queued at `full_at_s` (None: it did not close full), and `rows_waiting` were
        queued as it ended. Folds in what it measures and returns the estimate."""
        backlog_end_s = self._backlog_end_s
        self._backlog_end_s = ended_s if rows_waiting else None
        if backlog_end_s is None:
            gap_s = 0.0  # the executor waited for rows, not for the loop
        elif full_at_s is not None and full_at_s <= backlog_end_s:
            gap_s = max(0.0, started_s - backlog_end_s)
        else:  # a linger, or rows that came later, filled the wait: it says nothing
            return self.gap_s
        bound_s = max(MAX_RATIO * self.gap_s, MIN_BOUND_S)
        self.gap_s += ALPHA * (min(gap_s, bound_s) - self.gap_s)
        return self.gap_s

    def ran(self, batch: DeviceBusy[..., Any], dispatch: Dispatch, lanes: Sequence[Lane]) -> None:
        """`batch` ran `dispatch` (unless it never reached the executor); every lane's latency
        model is told the estimate (LatencyModel.batch_gap_s) as of the batch's end."""
        if batch.started_s is None or batch.ended_s is None:
            return
        full_at_s = None
        if dispatch.reason is CloseReason.FULL:
            full_at_s = max(item.arrival_s for item in dispatch.items)
        waiting = any(lane.batcher.num_queued for lane in lanes)
        gap_s = self.observe(
            batch.started_s, batch.ended_s, full_at_s=full_at_s, rows_waiting=waiting
        )
        for lane in lanes:
            lane.latency.batch_gap_s = gap_s
            lane.latency.batch_gap_as_of_s = batch.ended_s
        if self._gauge is not None:
            self._gauge.set(gap_s)
