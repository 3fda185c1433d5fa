"""When one batch key's batch closes, and how wide it is: the batching policy's rules for a
single key (services.gpu_worker.batching.policy chooses among keys).

A bigger batch amortizes the executor's fixed per-call cost but makes earlier rows wait:
urgent rows linger while more arrivals are expected soon enough to pay for the wait, and
`batch` rows (a backlog, not traffic) ride along only on the executor's spare width.
Synchronous and pure: time comes in as `now_s`, compute cost from the `LatencyModel`."""

from __future__ import annotations

from services.gpu_worker.batching.due_rows import due_limit_s
from services.gpu_worker.batching.fair_share import DueAllowance
from services.gpu_worker.batching.key_queue import KeyQueue
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.types import BATCH_RANK, BatcherConfig, BatchKey, CloseReason

#: `batch` rows may lengthen a batch's predicted compute by at most this share of what its
#: interactive rows alone would take: they ride the executor's spare width (large on a GPU,
#: where a wider batch costs little more; about none on a CPU, where each row costs its own).
BATCH_RIDE_SHARE = 0.1
#: While more urgent rows arrived this recently (on the worker, for any model), a batch of
#: `batch` rows only is held to what one urgent row costs (x 1 + BATCH_RIDE_SHARE): an urgent
#: row arriving as it starts waits for it, and the executor cannot be preempted. After a
#: longer silence it is full width.
URGENT_RECENT_S = 1.0


def linger_s(config: BatcherConfig, compute_s: float) -> float:
    """The linger before a batch predicted to compute for `compute_s`: what the SLO leaves
    after the upstream stages, that compute and the safety margin, clamped to [0, cap]."""
    budget_s = config.slo_s - config.upstream_budget_s - compute_s - config.safety_margin_s
    return min(max(budget_s, 0.0), config.max_wait_cap_s)


def batch_width(
    key: BatchKey,
    queue: KeyQueue,
    now_s: float,
    *,
    limit: int,
    latency: LatencyModel,
    last_urgent_s: float,
    margin_s: float = 0.0,
) -> int:
    """How many rows the next batch of `key` takes (urgent rows first, then `batch` ones), at
    most `limit`: `batch` rows must not cost more urgent rows their latency, and the executor
    cannot be preempted. `last_urgent_s`: when an urgent row last arrived on the worker.

    - With urgent rows in the batch, `batch` rows fill it only as far as they lengthen its
      predicted compute by BATCH_RIDE_SHARE of the urgent rows' alone, and never past the
      earliest limit of the rows queued less `margin_s` (admission counted no riders: a
      row admitted with little room would finish late for them).
    - A batch of `batch` rows only (a backfill), while urgent rows arrived within
      URGENT_RECENT_S, is held to about one urgent row's compute: an urgent row arriving as it
      starts waits for all of it. After a longer silence it is as wide as any batch
      (throughput: a job on an otherwise idle worker); the first urgent row after the silence
      may wait for one, as the batch compute budget allows. Either way it is predicted to end
      by the earliest limit of the rows queued less `margin_s` (at least one row): a row
      whose deadline fell inside a wider batch ran and answered late.
    """
    urgent = min(queue.items.count_at_most(BATCH_RANK - 1), limit)
    if urgent:
        budget_s = latency.predict(key, urgent) * (1.0 + BATCH_RIDE_SHARE)
        budget_s = min(budget_s, queue.earliest_limit_s() - now_s - margin_s)
        return max(urgent, latency.largest_batch_within(key, limit, budget_s))
    budget_s = queue.earliest_limit_s() - now_s - margin_s
    if now_s - last_urgent_s < URGENT_RECENT_S:
        budget_s = min(budget_s, latency.predict(key, 1) * (1.0 + BATCH_RIDE_SHARE))
    return latency.largest_batch_within(key, limit, budget_s)


def assess(
    key: BatchKey,
    queue: KeyQueue,
    now_s: float,
    *,
    config: BatcherConfig,
    latency: LatencyModel,
    limit: int,
    is_draining: bool,
    due: DueAllowance,
) -> tuple[CloseReason, None] | tuple[None, float]:
    """Why the key's batch should close now, or else when that could next change. `limit`:
    the most rows one batch of `key` holds now; `due`: what due batches may still take."""
    if is_draining:
        return CloseReason.DRAIN, None
    is_due = due_limit_s(key, queue, now_s, config=config, latency=latency, limit=limit)
    if is_due is not None and due.has_credit(now_s):
        return CloseReason.BACKFILL_DUE, None
    # The urgent rows decide; `batch` rows alone are a backlog, run whenever the executor
    # has nothing more urgent (and ride along with urgent rows, `batch_width`).
    urgent = queue.items.count_at_most(BATCH_RANK - 1)
    if not urgent:
        return CloseReason.BACKFILL, None
    # Lingering trades the urgent rows' latency for fuller batches, worth it only while the
    # executor would otherwise idle: with `batch` rows queued it never does, so they close
    # at once (and `batch` rows ride along as far as `batch_width` lets them).
    if urgent >= limit or len(queue.items) > urgent:
        return CloseReason.FULL, None
    compute_s = latency.predict(key, urgent)
    limit_s = queue.earliest_limit_s()  # a deadline, or an online row's SLO bound
    slack_at_s = limit_s - compute_s - config.safety_margin_s
    if now_s > slack_at_s:
        return CloseReason.DEADLINE, None
    # Batcher.max_wait_s(key), whose next batch is these `urgent` rows (fewer than `limit`).
    linger_end_s = queue.oldest_arrival_s() + linger_s(config, compute_s)
    if now_s >= linger_end_s:
        return CloseReason.LINGER, None
    gap_s = queue.arrival_gap_s(now_s)
    # Expected arrivals before the linger ends; none expected with no rate estimate yet.
    expected = 0.0 if gap_s is None else (linger_end_s - now_s) / gap_s
    if expected < config.min_expected_arrivals:
        return CloseReason.IDLE, None
    expiry_s = limit_s - latency.predict_alone(key)  # Batcher._expiry_s(key, queue)
    wake_s = min(linger_end_s, slack_at_s, expiry_s)
    if gap_s is not None:
        wake_s = min(wake_s, queue.idle_at_s(linger_end_s, config.min_expected_arrivals))
    if config.min_expected_arrivals > 0 and gap_s is not None and queue.last_add_s is not None:
        payoff_gap_s = linger_payoff_gap_s(latency, key, urgent, compute_s)
        if gap_s >= payoff_gap_s:
            return CloseReason.IDLE, None
        # The silence since the last arrival counts as the gap: past this, waiting stops
        # paying even if nobody comes.
        wake_s = min(wake_s, queue.last_add_s + payoff_gap_s)
    return None, wake_s


def linger_payoff_gap_s(
    latency: LatencyModel, key: BatchKey, num_rows: int, compute_s: float
) -> float:
    """How soon the next row must be expected for an idle executor to wait for it rather than
    run the `num_rows` queued now (`compute_s`, their predicted compute).

    One step of lookahead, in total latency of the queued rows and the next one, arriving g
    from now. Run now: the queued rows finish at c(k) each; the newcomer waits for the
    executor, then runs alone, c(1) more. Wait: all k + 1 finish at g + c(k + 1). Waiting pays
    exactly when g < c(1) / (k + 1) - (c(k + 1) - c(k)): a batch's fixed cost, shared by more
    rows, against the wait every queued row pays. A flat curve (a GPU) lingers until about
    c(1) / g rows have gathered; a steep one (each row costs its own compute, a small CPU
    model) or sparse arrivals dispatch at once, and traffic still batches as the rows that
    arrive while a batch runs form the next one (the executor clocks it)."""
    marginal_s = latency.predict(key, num_rows + 1) - compute_s
    return latency.predict(key, 1) / (num_rows + 1) - marginal_s
