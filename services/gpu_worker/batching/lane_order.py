"""The order in which the batching driver asks its lanes for a batch (pure: no asyncio, so the
simulator's worker orders its lanes with this same function)."""

from __future__ import annotations

import math
from typing import Protocol, TypeVar

from services.gpu_worker.batching.policy import Batcher


class HasBatcher(Protocol):
    """A lane, as far as ordering goes: its model version's batcher."""

    @property
    def batcher(self) -> Batcher: ...


L = TypeVar("L", bound=HasBatcher)


def by_urgency(lanes: list[L], now_s: float) -> list[tuple[L, bool]]:
    """The order in which the driver, its executor idle, asks `lanes` (given in rotation
    order) for a batch, each with whether to force it to close one now: the lane whose next
    batch is most urgent (priority class, then the tenant furthest below its fair share) first,
    ties in rotation order. If the worker's most urgent queued work is in a lane still
    lingering while another lane is ready, that lane is forced to close its batch now:
    lingering must not hand the executor to a tenant over its share."""
    if len(lanes) < 2:
        return [(lane, False) for lane in lanes]
    urgency = {id(lane): lane.batcher.urgency(now_s) for lane in lanes}
    ranked = sorted(lanes, key=lambda lane: urgency[id(lane)] or (math.inf, math.inf))
    heads = [(head, i) for i, lane in enumerate(lanes) if (head := lane.batcher.head_rank())]
    ready = urgency[id(ranked[0])]
    if ready is not None and heads and min(heads)[0] < ready:
        first = lanes[min(heads)[1]]
        return [(first, True)] + [(lane, False) for lane in ranked if lane is not first]
    return [(lane, False) for lane in ranked]
