"""What the router reads of a call (services.router.call_facts), from a multiplexed call's
context (services.common.multiplex_server.CallContext)."""

from __future__ import annotations

import time

import pytest

from services.common.errors import DeadlineExceeded
from services.common.multiplex_server import CallContext
from services.common.registry_schema import route_metadata
from services.router.call_facts import call_facts

pytestmark = pytest.mark.unit


def test_a_call_with_time_left_gets_its_deadline() -> None:
    metadata = tuple(route_metadata("affine", "1", 3))
    before_s = time.monotonic()
    facts = call_facts(CallContext(metadata, before_s + 2.0), None)
    assert (facts.name, facts.version, facts.num_rows) == ("affine", "1", 3)
    assert before_s < facts.deadline_s <= time.monotonic() + 2.0


def test_a_call_that_arrives_with_no_time_left_is_deadline_exceeded() -> None:
    """The gateway sends what is left of a deadline, at least 1 us, and it can pass on the way:
    such a call is answered DEADLINE_EXCEEDED, not refused as overload with a retry hint and
    counted as the router's refusal."""
    metadata = tuple(route_metadata("affine", "1", 1))
    with pytest.raises(DeadlineExceeded):
        call_facts(CallContext(metadata, time.monotonic() - 0.001), None)
