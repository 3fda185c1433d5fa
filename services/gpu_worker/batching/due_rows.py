"""When a key's `batch` rows must run ahead of every batch but critical rows' or be lost
(close reason `backfill_due`, close_rule.assess; how much of the executor such batches may
take: fair_share.DueAllowance).

`batch` rows wait for urgent ones (close_rule.batch_width, choice.choose), but not until they
are lost: beside online traffic that kept the executor busy they never ran, and a job's calls
timed out. Pure: time comes in as `now_s`, compute cost from the `LatencyModel`."""

from __future__ import annotations

import math

from services.gpu_worker.batching.batch_sizes import batch_compute_budget_s
from services.gpu_worker.batching.fair_share import DUE_BURST_S, DUE_SHARE
from services.gpu_worker.batching.key_queue import KeyQueue
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.types import BATCH_RANK, BatcherConfig, BatchKey

#: A `batch` row is kept from starving when its deadline leaves it at least this many of its
#: model's SLOs on arrival (a job's call: 20 s); one asking for less asks for online latency at
#: `batch` priority and is a backfill only (KeyQueue.min_patience_s).
DUE_PATIENCE_SLOS = 4.0


def due_limit_s(
    key: BatchKey,
    queue: KeyQueue,
    now_s: float,
    *,
    config: BatcherConfig,
    latency: LatencyModel,
    limit: int,
) -> float | None:
    """The deadline of the protected `batch` row (KeyQueue.batch_limits) that makes the key's
    `batch` rows due now, or None when none does.

    Earliest deadline first: a protected row is due when the `batch` rows up to it, run in
    batches of `limit` rows (each with the executor's gap between batches) within the due
    allowance (fair_share.DueAllowance: a burst, then DUE_SHARE of the time), after one batch
    already running (at most the batch compute budget) and the margin, would only just finish
    by its deadline. What the backlog costs the urgent rows is paid as late as it can be, a
    group at a time: rows with later deadlines wait on. When that moment is computed
    (`_due_at`) is cached on the queue until its `batch` rows or the cost model change (about
    once a batch under load: each batch teaches the cost model)."""
    if not queue.batch_limits:  # every queued `batch` row has an entry: none, the usual case
        return None
    backlog = len(queue.items) - queue.items.count_at_most(BATCH_RANK - 1)
    if not backlog:
        return None
    # Rows only leave between pushes, and pushes only count up: the stamp moves at every change.
    stamp = (queue.batch_pushes, backlog, limit, latency.revision)
    if queue.due_stamp != stamp:
        queue.due_stamp = stamp
        queue.due_at_s, queue.due_limit_s = _due_at(key, queue, now_s, config, latency, limit)
    return queue.due_limit_s if now_s >= queue.due_at_s else None


def _due_at(
    key: BatchKey,
    queue: KeyQueue,
    now_s: float,
    config: BatcherConfig,
    latency: LatencyModel,
    limit: int,
) -> tuple[float, float]:
    """(when the key's `batch` rows come due, the deadline of the row that makes them), both
    infinite when no protected row is queued; drops the stale entries of `batch_limits`."""
    items = queue.items
    live = queue.batch_limits = [entry for entry in queue.batch_limits if entry[1] in items]
    batch_s = latency.predict(key, limit) + latency.batch_gap_at(now_s)
    lead_s = config.safety_margin_s + max(0.0, batch_compute_budget_s(config))
    due_at_s = due_row_s = math.inf
    for index, (limit_s, _, protected) in enumerate(live):
        if not protected:
            continue
        run_s = (index // limit + 1) * batch_s  # beyond the burst, at DUE_SHARE of the time
        if (at_s := limit_s - max(run_s, (run_s - DUE_BURST_S) / DUE_SHARE) - lead_s) < due_at_s:
            due_at_s, due_row_s = at_s, limit_s
    return due_at_s, due_row_s
