"""Priority classes, shared by every tier.

A request's class is resolved once, at the gateway, from the call (inference.v1 `priority`, or
KServe v2's `priority` request parameter) and the tenant's configuration; tiers below never see
UNSPECIFIED from a gateway. Lower rank runs first and is shed last:

- `critical`: above interactive; granted to tenants explicitly.
- `interactive`: online traffic with a latency SLO; the default.
- `batch`: fills idle capacity; the first to be shed, never allowed to delay the others.
"""

from __future__ import annotations

import enum
import math

from services.pb.inference.v1 import types_pb2, worker_pb2


class PriorityClass(enum.Enum):
    """Values are the names used in configuration, metadata and metric labels."""

    CRITICAL = "critical"
    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 for the most urgent class; schedulers order by it, ascending."""
        return _RANKS[self._value_]  # by value: a member's own hash is a Python call

    @property
    def proto(self) -> types_pb2.Priority:
        """The `inference.v1.Priority` value."""
        return _TO_PROTO[self]

    @classmethod
    def from_proto(cls, value: int) -> PriorityClass | None:
        """The class of a proto value; None for UNSPECIFIED (the caller picks the default).

        Raises ValueError for a value the enum does not define.
        """
        if value == worker_pb2.PRIORITY_UNSPECIFIED:
            return None
        try:
            return _FROM_PROTO[value]
        except KeyError:
            raise ValueError(f"unknown priority {value}") from None

    @classmethod
    def parse(cls, text: str) -> PriorityClass:
        """The class named `text` (case-insensitive); ValueError naming the choices otherwise."""
        try:
            return cls(text.strip().lower())
        except ValueError:
            choices = ", ".join(c.value for c in cls)
            raise ValueError(f"unknown priority {text!r}; expected one of: {choices}") from None


DEFAULT_PRIORITY = PriorityClass.INTERACTIVE

#: `batch` rows are admitted only while a worker's queue is less full than this share of its
#: size: they fill idle capacity and are the first to be refused when it runs out.
BATCH_QUEUE_SHARE = 0.5


def max_queued_rows(priority: PriorityClass, max_queue_size: int) -> int:
    """Most rows one call of `priority` can have queued at once on a worker whose queue holds
    `max_queue_size` (a call's rows are queued together or not at all): a `batch` call past
    it would be refused on an idle worker too, for good, with a retry hint."""
    if priority is PriorityClass.BATCH:
        return math.ceil(max_queue_size * BATCH_QUEUE_SHARE)
    return max_queue_size


_RANKS = {  # by value (PriorityClass.rank)
    PriorityClass.CRITICAL.value: 0,
    PriorityClass.INTERACTIVE.value: 1,
    PriorityClass.BATCH.value: 2,
}
_TO_PROTO: dict[PriorityClass, types_pb2.Priority] = {
    PriorityClass.CRITICAL: worker_pb2.PRIORITY_CRITICAL,
    PriorityClass.INTERACTIVE: worker_pb2.PRIORITY_INTERACTIVE,
    PriorityClass.BATCH: worker_pb2.PRIORITY_BATCH,
}
_FROM_PROTO: dict[int, PriorityClass] = {value: cls for cls, value in _TO_PROTO.items()}


def worker_priority(value: int) -> PriorityClass:
    """The class of an internal request's `priority` field: UNSPECIFIED (a direct call without
    a gateway) runs as the default class; an unknown value raises ValueError."""
    return PriorityClass.from_proto(value) or DEFAULT_PRIORITY
