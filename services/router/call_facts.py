"""What routing needs of a call (`CallFacts`): its model, rows, deadline, class and tenant,
read once from its metadata and deadline, and the same for one part of a split bundle."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import grpc

from services.common.errors import DeadlineExceeded, InvalidInput
from services.common.multiplex_server import CallContext
from services.common.priority import DEFAULT_PRIORITY, PriorityClass
from services.common.registry_schema import (
    ROUTE_PRIORITY_KEY,
    ROUTE_TENANT_KEY,
    ROUTE_WEIGHT_KEY,
    parse_route_metadata,
)
from services.router.bundle_split import Part


@dataclass(frozen=True)
class CallFacts:
    """What routing needs of a call, from its metadata and deadline."""

    name: str
    version: str
    #: Input rows (prompt tokens for generation).
    num_rows: int
    #: Absolute, on time.monotonic(); math.inf for none.
    deadline_s: float
    priority: PriorityClass
    #: The caller's tenant ("" when the gateway sent none) and its fair-share weight.
    tenant: str = ""
    weight: float = 1.0


class LateCall(DeadlineExceeded):
    """A call whose deadline passed before it was routed; `labels`: its (model, version)."""

    def __init__(self, labels: tuple[str, str]) -> None:
        super().__init__("deadline exceeded before the call was routed")
        self.labels = labels


def call_facts(
    context: grpc.aio.ServicerContext | CallContext, default_timeout_s: float | None
) -> CallFacts:
    """The call's facts. Without a caller's deadline: `default_timeout_s` from now, or
    math.inf when that is None; without a priority class, the default class."""
    metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
    route_info = parse_route_metadata(metadata)
    if route_info is None:
        raise InvalidInput("router calls need x-route-model, -version and -rows metadata")
    try:
        priority = PriorityClass.parse(metadata.get(ROUTE_PRIORITY_KEY) or DEFAULT_PRIORITY.value)
    except ValueError as error:
        raise InvalidInput(f"{ROUTE_PRIORITY_KEY}: {error}") from None
    tenant = metadata.get(ROUTE_TENANT_KEY, "")
    try:
        weight = float(metadata.get(ROUTE_WEIGHT_KEY) or 1.0)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise InvalidInput(f"{ROUTE_WEIGHT_KEY} must be a positive number")
    remaining_s = context.time_remaining()
    if remaining_s is not None and remaining_s <= 0:
        # Late already: its caller's answer is the deadline's, not an overload to retry.
        raise LateCall(route_info[:2])
    timeout_s = default_timeout_s if remaining_s is None else remaining_s
    deadline_s = math.inf if timeout_s is None else time.monotonic() + timeout_s
    return CallFacts(*route_info, deadline_s, priority, tenant, weight)


def part_facts(facts: CallFacts, part: Part) -> CallFacts:
    """A part of a bundle's facts: its rows, its tenant, and its latest slice's deadline."""
    return dataclasses.replace(
        facts,
        num_rows=part.rows,
        deadline_s=facts.deadline_s - part.earlier_us / 1e6,
        tenant=part.tenant,
        weight=part.weight,
    )
