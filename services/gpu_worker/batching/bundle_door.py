"""A bundle refused whole, before its rows are made, when none of its slices could be queued.

Under a flood a worker refused a bundle slice by slice: each slice's rows prepared, asked for,
refused and answered with a status of its own. For 64 one-row slices that took 1.8 ms of the
event loop, where serving them took 2.9 ms: refusing a 2x flood took the whole core, and the
batches the loop should have fed waited behind it (of 17,800 rows a second the stand-in's
worker serves, about 110 were answered within the SLO: `python -m bench.worker_flood`). The
door asks once for each caller of a bundle (a tenant, its weight and priority class, the
latest time left among its slices), for a row of each bucket the bundle's rows fall in, and
refuses the whole call when every such row is refused: one status, its retry hint jittered
for each caller by the gateway (UpstreamError.for_one_caller).

It is asked only while the lane's queue is full or stands (slo_shedding): what refuses every
row of a bundle then, and only then, is worth a look before the rows are made. It refuses
only what admission would refuse row by row, in the same state (`Batcher.refusal`): a full
queue, a tenant over its share, or a row predicted late, since a row of the same caller with
an earlier deadline or a smaller share of its SLO bound is refused too. A refusal for the
batch-mates a row would make late depends on the row's place in its batch, so it never
refuses a bundle here: such a bundle takes the row-by-row path, as does one with a slice of
an answer of its own (BundleRunner asks only for token-id bundles of a text model whose rows
all pass its checks, with no caller gone before the bundle came), and one with a `batch`
caller of more rows than the queue takes of one such call (its slice may be refused
INVALID_ARGUMENT). A slice whose own deadline passed on the way, beside a bundle-mate of its
caller group with time left, is refused with the rest (RESOURCE_EXHAUSTED, where the row
path would say DEADLINE_EXCEEDED: its caller has stopped waiting either way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from services.common.priority import PriorityClass, max_queued_rows
from services.gpu_worker.admission import Rejected, RejectReason
from services.gpu_worker.batching.lane import Lane
from services.gpu_worker.batching.policy import executor_start_s
from services.gpu_worker.batching.slice_admission import lane_key
from services.gpu_worker.batching.types import QueuedItem
from services.gpu_worker.metrics import WorkerMetrics

#: A probe row is never queued: its id is none of the ids the driver hands out.
_PROBE_ID = -1


class Caller(NamedTuple):
    """The slices of one bundle that share a tenant, weight and priority class."""

    tenant: str
    weight: float
    rank: int
    #: The latest time left of its slices, seconds (inf: one has no deadline of its own, and
    #: may have the model's default timeout, or longer).
    latest_s: float
    #: Its slices' rows.
    rows: int


def may_refuse_whole(lane: Lane) -> bool:
    """Whether the lane's state may refuse every row of a bundle: its queue is full or
    stands. Cheap: asked for every bundle."""
    return lane.shedding.queue.is_standing or isinstance(lane.batcher.can_admit(1), Rejected)


def whole_refusal(
    lane: Lane,
    callers: Sequence[Caller],
    buckets: Sequence[int],
    now_s: float,
    executor_free_s: float | None,
    metrics: WorkerMetrics,
) -> Exception | None:
    """The error that refuses every slice of a bundle of `buckets` from `callers`, or None
    when a slice might be queued. Asked while `may_refuse_whole`. Each caller's rows are
    counted under its own refusal's reason, and each refusal tells the lane's SLO shedding
    what it tells it row by row (Lane.rejection: a standing queue is held); the first
    caller's is the error."""
    batcher = lane.batcher
    most_batch_rows = max_queued_rows(PriorityClass.BATCH, lane.backend.config.max_queue_size)
    refused: list[tuple[Caller, QueuedItem, Rejected]] = []
    for caller in callers:
        if caller.rank == PriorityClass.BATCH.rank and caller.rows > most_batch_rows:
            # A slice of it may be past what the queue takes of one `batch` call: refused
            # INVALID_ARGUMENT on the row path, where a hint here would have it resent as it is.
            return None
        budget_s = lane.shedding.budget_s(now_s, caller.rank, batcher.num_queued)
        first: tuple[Caller, QueuedItem, Rejected] | None = None
        for bucket in buckets:
            probe = QueuedItem(
                item_id=_PROBE_ID,
                key=lane_key(lane, bucket),
                tenant=caller.tenant,
                num_tokens=bucket,
                arrival_s=now_s,
                deadline_s=now_s + caller.latest_s,
                finish_by_s=None if budget_s is None else now_s + budget_s,
                priority=caller.rank,
                weight=batcher.weight_of(caller.tenant, caller.weight),
            )
            refusal = batcher.refusal(probe, now_s, executor_free_s)
            if refusal is None or (refusal.reason is RejectReason.DEADLINE and refusal.detail):
                return None
            first = first or (caller, probe, refusal)
        if first is not None:
            refused.append(first)
    start_s = executor_start_s(now_s, executor_free_s)
    errors = []
    for caller, probe, refusal in refused:
        metrics.rejected_total_of[(*lane.labels, refusal.reason.value)].inc(caller.rows)
        errors.append(lane.rejection(probe, refusal, now_s, start_s))
    return errors[0] if errors else None
