"""A retry the router's retry budget refuses is refused before it is routed: routing it took
the worker's place (a probation's one probe, a reservation) and counted it as routed, then
gave the failure to the caller anyway (a review finding). The forwarder's own routing over a
route table the test loads, no call sent."""

from __future__ import annotations

import dataclasses
import math
import random
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.errors import DeadlineExceeded, UpstreamError
from services.common.multiplex import MAX_CALL_BYTES
from services.common.multiplex_server import CallContext
from services.common.priority import PriorityClass
from services.common.registry_schema import WorkerRecord, route_metadata
from services.router.call_facts import CallFacts
from services.router.ejection import TimeoutEjectionConfig
from services.router.forwarder import Forwarder
from services.router.metrics import RouterMetrics
from services.router.routing import RetryBudget, Route, RouteTable
from services.router.routing_config import RoutingConfig
from tests.support.in_process import metric
from tests.support.records import model_record

pytestmark = pytest.mark.unit

FACTS = CallFacts("minilm", "1", 1, math.inf, PriorityClass.INTERACTIVE)
FAILED = UpstreamError(grpc.StatusCode.UNAVAILABLE, "worker w0 went away")


def _forwarder(budget: RetryBudget) -> tuple[Forwarder, RouteTable, RouterMetrics]:
    table = RouteTable(RoutingConfig(explore_share=0.0), random.Random(0))
    now_s = time.monotonic()
    records = [WorkerRecord(w, f"127.0.0.1:{port}", False, 0, (model_record(),))
               for w, port in (("w0", 1), ("w1", 2))]  # fmt: skip
    table.update([(record, now_s) for record in records], now_s)
    metrics = RouterMetrics(CollectorRegistry())
    return Forwarder(table, budget, metrics, default_timeout_s=5.0, max_retries=2), table, metrics


def test_a_retry_the_budget_refuses_is_not_routed() -> None:
    forwarder, table, metrics = _forwarder(RetryBudget(ratio=0.0, min_per_s=0.0))

    with pytest.raises(UpstreamError) as refused:
        forwarder._route(FACTS, {"w0"}, FAILED)

    assert refused.value is FAILED, "the worker's failure, given to the caller"
    assert metric(metrics.registry, names.ROUTER_ROUTED_TOTAL) == 0
    assert table.inflight_rows("w1") == 0, "nothing reserved on the worker not tried"
    assert metric(metrics.registry, names.ROUTER_RETRIES_TOTAL) == 0


def test_a_retry_with_a_token_is_routed_and_spends_it() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=0.1, window_s=10.0)  # a reserve of one token
    forwarder, table, metrics = _forwarder(budget)

    route = forwarder._route(FACTS, {"w0"}, FAILED)

    assert isinstance(route, Route) and route.worker_id == "w1"
    assert table.inflight_rows("w1") == 1
    assert metric(metrics.registry, names.ROUTER_RETRIES_TOTAL) == 1
    assert not budget.has_token(time.monotonic()), "its one token spent"


async def test_a_call_too_large_to_send_says_nothing_of_the_worker_it_was_routed_to() -> None:
    """The link refuses a call past its message limit before sending it: counted as the
    worker's answer, it lifted the ejection of a worker whose calls only time out (review
    finding). The caller gets RESOURCE_EXHAUSTED; the worker stays ejected."""
    forwarder, table, _ = _forwarder(RetryBudget(ratio=0.0, min_per_s=0.0))
    timeouts = table.timeouts
    now_s = time.monotonic()
    for _ in range(TimeoutEjectionConfig.timeouts_to_eject):
        timeouts.record_timeout("w0", now_s, waited_s=60.0, predicted_s=0.01)
    assert timeouts.is_ejected("w0", now_s)
    # Routed there all the same (no other worker routable); nothing reserved (id 0).
    route = Route("w0", "127.0.0.1:1", reservation_id=0, predicted_s=0.01)

    with pytest.raises(UpstreamError) as refused:
        await forwarder._attempts(bytes(MAX_CALL_BYTES + 1), FACTS, None, route)

    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert timeouts.is_ejected("w0", time.monotonic())
    await forwarder.close()


async def test_a_call_late_before_it_is_routed_is_counted_deadline_exceeded() -> None:
    """Refused before its outcome was entered, a call whose deadline had passed was answered
    DEADLINE_EXCEEDED and counted nowhere, under overload above all (review finding)."""
    forwarder, _, metrics = _forwarder(RetryBudget(ratio=0.0, min_per_s=0.0))
    late = CallContext(route_metadata("minilm", "1", 1), deadline_s=time.monotonic() - 1.0)

    with pytest.raises(DeadlineExceeded):
        await forwarder.infer(b"", late)

    labels = {"model": "minilm", "version": "1", "code": "DEADLINE_EXCEEDED"}
    assert metric(metrics.registry, names.ROUTER_RESPONSES_TOTAL, **labels) == 1
    await forwarder.close()


def test_a_batch_calls_retry_leaves_half_the_floor_to_the_other_classes() -> None:
    """A worker lost with many `batch` calls on it (a job runner's) spent the budget on their
    retries, and the critical or interactive call that failed next found none (review
    finding). A batch retry leaves half the floor: a reserve of 4 takes two batch retries,
    then the other classes' two."""
    budget = RetryBudget(ratio=0.0, min_per_s=0.4, window_s=10.0)  # a reserve of 4 tokens
    forwarder, _, metrics = _forwarder(budget)
    batch = dataclasses.replace(FACTS, priority=PriorityClass.BATCH)
    for _ in range(2):
        forwarder._route(batch, {"w0"}, FAILED)
    with pytest.raises(UpstreamError) as refused:
        forwarder._route(batch, {"w0"}, FAILED)
    assert refused.value is FAILED
    for facts in (FACTS, dataclasses.replace(FACTS, priority=PriorityClass.CRITICAL)):
        assert forwarder._route(facts, {"w0"}, FAILED).worker_id == "w1"
    with pytest.raises(UpstreamError):
        forwarder._route(FACTS, {"w0"}, FAILED)  # the floor is spent
    assert metric(metrics.registry, names.ROUTER_RETRIES_TOTAL) == 4


def test_a_retry_not_made_is_counted_by_its_reason() -> None:
    """Why a worker's failure went to its caller unretried was told nowhere but a log line
    sparse per worker (and none when the budget refused it at routing): "retry budget spent"
    looked like the worker's own failure (review finding)."""
    forwarder, _, metrics = _forwarder(RetryBudget(ratio=0.0, min_per_s=0.0))
    with pytest.raises(UpstreamError):
        forwarder._route(FACTS, {"w0"}, FAILED)
    route = forwarder._route(FACTS, set(), None)  # a first attempt spends no token
    with pytest.raises(UpstreamError):
        forwarder._after_failure(FAILED, route, 2, FACTS)  # its retries all made
    answered = UpstreamError(grpc.StatusCode.INVALID_ARGUMENT, "not a row of this model")
    with pytest.raises(UpstreamError):
        forwarder._after_failure(answered, route, 0, FACTS)  # an answer: no retry to give up
    given_up = names.ROUTER_RETRIES_GIVEN_UP_TOTAL
    assert metric(metrics.registry, given_up, reason="budget_spent") == 1
    assert metric(metrics.registry, given_up, reason="no_attempts_left") == 1
    assert metric(metrics.registry, given_up) == 2
