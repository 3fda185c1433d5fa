"""How long the executor stands idle between batches while rows wait for it.

A batch's end reaches the event loop as a callback; the loop answers its rows and dispatches
the next batch on later turns. On an idle loop that costs tens of microseconds. On a loop
busy taking a flood's bundles, each turn runs every message that arrived meanwhile, and the
executor waits out several turns between batches: the stand-in's batches of 64 rows run 2.4
ms and, with 280 bundles a second arriving, the executor idled 3-5 ms between them. A queue
the latency model (executor time only) forecast to drain within the SLO took twice as long,
and under a 2x flood, when refusing cost the loop as much as serving, 20-60 times.

`BatchGap` measures that idle time from each batch's start on the executor to the end of the
batch before it, when rows were queued at that end (otherwise the executor waited for rows,
not for the loop), smoothed as an EWMA, each measurement bounded by a multiple of the
estimate. The forecasts add it once a batch (LatencyModel.batch_gap_s), so the queue admitted
is the queue the loop can drain in time, and a flood past that is refused at the bundle door
(bundle_door) before its rows cost the loop more. A batch that found no rows waiting when the
one before it ended says the loop kept up: the gap decays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import Gauge

from services.gpu_worker.batching.lane import Lane
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

    def observe(self, started_s: float, ended_s: float, *, rows_waiting: bool) -> float:
        """A batch ran on the executor from `started_s` to `ended_s`, and `rows_waiting` were
        queued as it ended: folds in its gap from the batch before (none when no rows waited
        then) and returns the gap now."""
        gap_s = 0.0 if self._backlog_end_s is None else started_s - self._backlog_end_s
        bound_s = max(MAX_RATIO * self.gap_s, MIN_BOUND_S)
        self.gap_s += ALPHA * (min(max(0.0, gap_s), bound_s) - self.gap_s)
        self._backlog_end_s = ended_s if rows_waiting else None
        return self.gap_s

    def ran(self, batch: DeviceBusy[..., Any], lanes: Sequence[Lane]) -> None:
        """`batch` ran (unless it never reached the executor); every lane's latency model is
        told the gap (LatencyModel.batch_gap_s)."""
        if batch.started_s is None or batch.ended_s is None:
            return
        waiting = any(lane.batcher.num_queued for lane in lanes)
        gap_s = self.observe(batch.started_s, batch.ended_s, rows_waiting=waiting)
        for lane in lanes:
            lane.latency.batch_gap_s = gap_s
        if self._gauge is not None:
            self._gauge.set(gap_s)
