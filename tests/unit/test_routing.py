"""RouteTable and RetryBudget: choice, liveness, reservations, admission, ejection, budgets.

Unless a test says otherwise: every worker serves minilm@1, ready, with per_row_s = min_batch_s
= 0.01, and heartbeats at the time of the update, so predicted_s = max(0.01, rows * 0.01).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common.registry_schema import WorkerRecord
from services.router.config import RouterConfig
from services.router.metrics import RouterMetrics
from services.router.routing import (
    Reject,
    RejectReason,
    RetryBudget,
    Route,
    RouteTable,
)
from services.router.routing_config import RoutingConfig
from tests.support.records import model_record

pytestmark = pytest.mark.unit

MODEL = ("minilm", "1")


#: Every model record of these tests: minilm@1 by default (tests/support/records.py).
make_model = model_record


def make_worker(
    *,
    worker_id: str = "w1",
    queued_rows: int = 0,
    per_row_s: float = 0.01,
    min_batch_s: float = 0.01,
    draining: bool = False,
    is_ready: bool = True,
    is_failing: bool = False,
    shed_past_slo: bool = False,
    models: Sequence[tuple[str, str]] = (MODEL,),
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        address=f"{worker_id}:50051",
        is_draining=draining,
        sent_at_ms=0,
        models=tuple(
            make_model(
                name=name,
                version=version,
                queued_rows=queued_rows,
                per_row_s=per_row_s,
                min_batch_s=min_batch_s,
                is_ready=is_ready,
                is_failing=is_failing,
                shed_past_slo=shed_past_slo,
            )
            for name, version in models
        ),
    )


def make_table(*, seed: int = 0, rng: random.Random | None = None, **config: Any) -> RouteTable:
    return RouteTable(RoutingConfig(**config), rng or random.Random(seed))


def loaded(
    table: RouteTable, *workers: WorkerRecord, now_s: float = 0.0, heartbeat_s: float | None = None
) -> RouteTable:
    """Update `table` with `workers`, all heartbeating at `heartbeat_s` (default: now_s)."""
    beat_s = now_s if heartbeat_s is None else heartbeat_s
    table.update([(w, beat_s) for w in workers], now_s)
    return table


def route(
    table: RouteTable,
    *,
    name: str = "minilm",
    version: str = "1",
    num_rows: int = 1,
    remaining_s: float = 10.0,
    now_s: float = 0.0,
    exclude: frozenset[str] = frozenset(),
) -> Route | Reject:
    return table.route(name, version, num_rows, remaining_s, now_s, exclude)


def routed_to(decision: Route | Reject) -> str:
    assert isinstance(decision, Route), decision
    return decision.worker_id


def route_and_release(table: RouteTable, **kwargs: Any) -> str:
    """Routes one request (see `route`), which must be routed; releases its reservation at once
    and returns the worker it went to."""
    decision = route(table, **kwargs)
    assert isinstance(decision, Route), decision
    table.release(decision.reservation_id)
    return decision.worker_id


def rejected(decision: Route | Reject) -> RejectReason:
    assert isinstance(decision, Reject), decision
    return decision.reason


class RecordingRandom(random.Random):
    """A seeded Random that remembers every pair it sampled."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.samples: list[list[Any]] = []

    def sample(self, population: Any, k: int, **kwargs: Any) -> list[Any]:
        chosen = super().sample(population, k, **kwargs)
        self.samples.append(chosen)
        return chosen


# Choice


def test_least_predicted_wait_wins() -> None:
    table = loaded(
        make_table(),
        make_worker(worker_id="w1", queued_rows=10),
        make_worker(worker_id="w2", queued_rows=2),
        make_worker(worker_id="w3", queued_rows=5),
    )
    decision = route(table, num_rows=4)
    assert routed_to(decision) == "w2"
    assert isinstance(decision, Route)
    assert decision.address == "w2:50051"
    assert decision.predicted_s == pytest.approx((2 + 4) * 0.01)


def test_predicted_wait_weighs_per_row_cost_not_just_queue_depth() -> None:
    table = loaded(
        make_table(),
        make_worker(worker_id="slow", queued_rows=0, per_row_s=0.1, min_batch_s=0.1),
        make_worker(worker_id="fast", queued_rows=5, per_row_s=0.01),
    )
    assert routed_to(route(table)) == "fast"  # 0.06 s beats 0.1 s


def test_predicted_wait_is_at_least_one_batch() -> None:
    table = loaded(make_table(), make_worker(min_batch_s=0.05))
    decision = route(table, num_rows=1)
    assert isinstance(decision, Route)
    assert decision.predicted_s == pytest.approx(0.05)


def test_ties_go_to_the_lowest_worker_id() -> None:
    table = loaded(make_table(), make_worker(worker_id="b"), make_worker(worker_id="a"))
    assert routed_to(route(table)) == "a"


# Reservations


def test_local_reservations_steer_the_next_route_and_release_restores() -> None:
    table = loaded(make_table(), make_worker(worker_id="w1"), make_worker(worker_id="w2"))
    first = route(table, num_rows=10)
    assert routed_to(first) == "w1"
    assert table.inflight_rows("w1") == 10
    assert routed_to(route(table, num_rows=10)) == "w2"  # w1 now looks 10 rows busier

    assert isinstance(first, Route)
    table.release(first.reservation_id)
    assert table.inflight_rows("w1") == 0
    assert routed_to(route(table, num_rows=1)) == "w1"


def test_s12_release_is_idempotent_and_ignores_unknown_ids() -> None:
    table = loaded(make_table(), make_worker())
    first, second = route(table, num_rows=3), route(table, num_rows=2)
    assert isinstance(first, Route) and isinstance(second, Route)
    assert first.reservation_id != second.reservation_id
    table.release(first.reservation_id)
    table.release(first.reservation_id)
    table.release(12345)
    assert table.inflight_rows("w1") == 2


def test_batch_rows_reserved_here_are_not_ahead_of_an_online_row() -> None:
    """Reservations were kept by worker and model alone, so a batch job's rows held through
    this router counted ahead of every online call, which the worker runs first: its calls
    were priced as waiting behind the job, and refused (review finding). Batch rows still
    wait behind both."""
    table = loaded(make_table(), make_worker(worker_id="w1"))
    job = table.route("minilm", "1", 50, 10.0, 0.0, is_batch=True, tenant="t")
    assert isinstance(job, Route) and table.inflight_rows("w1") == 50
    online = table.route("minilm", "1", 1, 0.2, 0.0, tenant="t")  # 0.2 s: not 51 rows' 0.51
    assert isinstance(online, Route) and online.predicted_s == pytest.approx(0.01)
    more = table.route("minilm", "1", 1, 10.0, 0.0, is_batch=True, tenant="t")
    assert isinstance(more, Route) and more.predicted_s == pytest.approx((1 + 50 + 1) * 0.01)
    for reservation in (job, online, more):
        table.release(reservation.reservation_id)
    assert table.inflight_rows("w1") == 0


def test_heartbeat_queue_counts_when_above_local_reservations() -> None:
    # The heartbeat counts other routers' rows too; our own 5 must not hide its 20.
    table = loaded(make_table(), make_worker(worker_id="w1", queued_rows=20))
    assert isinstance(route(table, num_rows=5), Route)
    decision = route(table, num_rows=1)
    assert isinstance(decision, Route)
    assert decision.predicted_s == pytest.approx((20 + 1) * 0.01)


def test_s02_routes_in_one_tick_admit_exactly_what_fits() -> None:
    # Each 1-row route on an idle worker is predicted at (reserved + 1) * 0.01 s; with a 0.1 s
    # deadline and 0.005 s margin, 9 fit per worker.
    table = loaded(make_table(), make_worker(worker_id="w1"), make_worker(worker_id="w2"))
    decisions = [route(table, remaining_s=0.1) for _ in range(30)]
    routes = [d for d in decisions if isinstance(d, Route)]
    assert len(routes) == 18
    assert Counter(r.worker_id for r in routes) == {"w1": 9, "w2": 9}
    assert all(rejected(d) is RejectReason.DEADLINE for d in decisions[18:])

    table.release(routes[0].reservation_id)
    assert isinstance(route(table, remaining_s=0.1), Route)
    assert rejected(route(table, remaining_s=0.1)) is RejectReason.DEADLINE


# Admission


def test_deadline_rejection_gives_a_retry_hint_and_reserves_nothing() -> None:
    table = loaded(make_table(), make_worker(queued_rows=100))  # predicted 1.01 s
    decision = route(table, remaining_s=0.5)
    assert rejected(decision) is RejectReason.DEADLINE
    assert isinstance(decision, Reject)
    # The whole predicted time: what is left of the caller's deadline shrinks as fast as the
    # backlog drains, so a retry within it (0.5 s, less the hint) could never fit; the hint
    # says so (before, it was the excess, 0.515 s, and the retry was refused again).
    assert decision.retry_after_s == pytest.approx(1.01)
    assert "1.010" in decision.message and "0.500" in decision.message
    assert table.inflight_rows("w1") == 0
    assert isinstance(route(table, remaining_s=2.0), Route)


def test_deadline_already_passed_still_gives_a_positive_retry_hint() -> None:
    table = loaded(make_table(), make_worker())
    decision = route(table, remaining_s=0.0)
    assert isinstance(decision, Reject)
    assert decision.reason is RejectReason.DEADLINE
    assert decision.retry_after_s > 0


def test_an_idle_worker_is_never_refused_on_its_queue_estimate() -> None:
    # An inflated per-row cost (one slow batch) predicts 5 s for 5 rows; the worker is idle.
    table = loaded(make_table(), make_worker(per_row_s=1.0, min_batch_s=0.01))

    first = route(table, num_rows=5, remaining_s=0.5)
    assert isinstance(first, Route)
    # Now it has rows reserved: the estimate decides.
    assert rejected(route(table, num_rows=5, remaining_s=0.5)) is RejectReason.DEADLINE
    table.release(first.reservation_id)
    assert isinstance(route(table, num_rows=5, remaining_s=0.5), Route)


def test_an_idle_worker_refuses_a_row_whose_own_batch_cannot_fit() -> None:
    table = loaded(make_table(), make_worker(min_batch_s=0.3))

    assert rejected(route(table, remaining_s=0.2)) is RejectReason.DEADLINE
    assert isinstance(route(table, remaining_s=0.4), Route)


def test_shedding_models_refuse_what_would_finish_past_the_slo() -> None:
    # 30 queued rows: 0.31 s predicted, past the 0.1 s SLO, well inside a 10 s deadline.
    shedding = loaded(make_table(), make_worker(queued_rows=30, shed_past_slo=True))
    decision = route(shedding, remaining_s=10.0)
    assert rejected(decision) is RejectReason.DEADLINE
    assert isinstance(decision, Reject) and "SLO" in decision.message
    assert decision.retry_after_s == pytest.approx(0.31 - (0.1 - 0.005))
    # Where the caller's deadline is shorter than the SLO, the deadline binds: the whole time.
    decision = route(shedding, remaining_s=0.05)
    assert isinstance(decision, Reject) and decision.retry_after_s == pytest.approx(0.31)

    patient = loaded(make_table(), make_worker(queued_rows=30))
    assert isinstance(route(patient, remaining_s=10.0), Route)


# Candidates


def test_s26_stale_heartbeat_is_excluded() -> None:
    table = make_table(stale_after_s=3.0)
    table.update(
        [
            (make_worker(worker_id="dead", queued_rows=0), 6.9),  # 3.1 s old at refresh
            (make_worker(worker_id="edge", queued_rows=5), 7.0),  # exactly 3.0 s: alive
            (make_worker(worker_id="busy", queued_rows=50), 9.5),
        ],
        now_s=10.0,
    )
    assert routed_to(route(table, now_s=10.0)) == "edge"
    assert [w.worker_id for w in table.live_workers(10.0)] == ["busy", "edge"]


def test_draining_worker_is_excluded() -> None:
    table = loaded(
        make_table(),
        make_worker(worker_id="w1", draining=True),
        make_worker(worker_id="w2", queued_rows=50),
    )
    assert routed_to(route(table)) == "w2"


def test_not_ready_model_is_excluded() -> None:
    table = loaded(
        make_table(),
        make_worker(worker_id="w1", is_ready=False),
        make_worker(worker_id="w2", queued_rows=50),
    )
    assert routed_to(route(table)) == "w2"


def test_a_worker_failing_a_model_is_routed_to_only_while_no_other_serves_it() -> None:
    """A worker whose batches of a version all fail answers at once: idle by its queue, it
    won the least predicted wait and drew more than its share, all failed (routing review).
    Its heartbeat now says so (`is_failing`, batching.failure_streak), and routing prefers any
    other worker; with none left, it is routed to (panic mode: failures are no worse than an
    outage, and a poison input that marks every worker must not take the model down)."""
    idle_failing = make_worker(worker_id="w1", is_failing=True)
    busy = make_worker(worker_id="w2", queued_rows=50)
    table = loaded(make_table(), idle_failing, busy)
    assert {route_and_release(table) for _ in range(5)} == {"w2"}
    # The only one left (w2 draining): routed to rather than refused.
    loaded(table, idle_failing, make_worker(worker_id="w2", draining=True))
    assert routed_to(route(table)) == "w1"
    # Its next heartbeat says it serves again: the least predicted wait wins again.
    loaded(table, make_worker(worker_id="w1"), busy)
    assert routed_to(route(table)) == "w1"


def test_a_worker_failing_a_model_takes_a_retry_or_an_ejected_peers_calls() -> None:
    """A failing worker comes after the others' first choices, not after their panic-mode
    fallback: a retry whose healthy worker failed UNAVAILABLE, and the calls of the time that
    worker is ejected for it, go to the failing one rather than nowhere, or back to the one
    just ejected (review finding: filtered out before the retry's exclude set and the
    ejections, they were NO_WORKER)."""
    table = loaded(
        make_table(eject_s=5.0),
        make_worker(worker_id="w1", is_failing=True),
        make_worker(worker_id="w2", queued_rows=50),
    )
    assert routed_to(route(table, exclude=frozenset({"w2"}))) == "w1"
    table.eject("w2", now_s=0.0)
    assert routed_to(route(table, now_s=1.0)) == "w1"
    assert routed_to(route(table, now_s=5.0)) == "w2"  # back once its ejection ends
    # Every worker tried: none, failing or not.
    assert rejected(route(table, exclude=frozenset({"w1", "w2"}))) is RejectReason.NO_WORKER


def test_exclude_set_sends_a_retry_elsewhere() -> None:
    table = loaded(
        make_table(), make_worker(worker_id="w1"), make_worker(worker_id="w2", queued_rows=50)
    )
    assert routed_to(route(table, exclude=frozenset({"w1"}))) == "w2"
    everyone = frozenset({"w1", "w2"})
    assert rejected(route(table, exclude=everyone)) is RejectReason.NO_WORKER


def test_ejected_worker_is_skipped_until_eject_s_passes() -> None:
    table = loaded(
        make_table(eject_s=5.0),
        make_worker(worker_id="w1"),
        make_worker(worker_id="w2", queued_rows=50),
    )
    table.eject("w1", now_s=1.0)
    assert routed_to(route(table, now_s=1.0)) == "w2"
    loaded(table, make_worker(worker_id="w1"), make_worker(worker_id="w2"), now_s=5.9)
    assert routed_to(route(table, now_s=5.9)) == "w2"  # a fresh heartbeat does not un-eject
    assert routed_to(route(table, now_s=6.0)) == "w1"


def test_a_models_last_worker_ejected_for_unavailable_is_still_routed_to() -> None:
    """Ejected for one UNAVAILABLE (its stream reset once, say), a model's only worker was
    skipped for `eject_s`: every call of the model failed NO_WORKER meanwhile, though the
    worker served (review finding). As for timeouts, an ejection skips a worker only while
    another is routable; a request that tried it already still never goes back."""
    table = loaded(make_table(), make_worker())
    table.eject("w1", now_s=0.0)
    assert routed_to(route(table)) == "w1"
    assert rejected(route(table, exclude=frozenset({"w1"}))) is RejectReason.NO_WORKER


def test_unknown_model_differs_from_no_ready_worker() -> None:
    table = make_table()
    table.update(
        [
            (make_worker(worker_id="dead", models=(("old", "1"),)), 0.0),
            (make_worker(worker_id="busy", draining=True, models=(("minilm", "1"),)), 10.0),
        ],
        now_s=10.0,
    )
    assert rejected(route(table, name="nope", now_s=10.0)) is RejectReason.UNKNOWN_MODEL
    assert rejected(route(table, version="2", now_s=10.0)) is RejectReason.UNKNOWN_MODEL
    unknown = route(table, name="nope", now_s=10.0)
    assert isinstance(unknown, Reject) and "nope@1" in unknown.message
    # Advertised, but only by a dead worker or a draining one: the model exists.
    assert rejected(route(table, name="old", now_s=10.0)) is RejectReason.NO_WORKER
    assert rejected(route(table, now_s=10.0)) is RejectReason.NO_WORKER


# Snapshot staleness


def test_no_snapshot_yet_is_no_registry_not_unknown_model() -> None:
    table = make_table()
    assert table.snapshot_age_s(5.0) is None and not table.has_snapshot
    assert rejected(route(table)) is RejectReason.NO_REGISTRY
    loaded(table)  # an empty registry is a snapshot too
    assert table.has_snapshot


def test_s25_frozen_snapshot_routes_until_max_age_then_rejects_until_refreshed() -> None:
    table = loaded(make_table(stale_after_s=3.0, max_snapshot_age_s=120.0), make_worker())
    # Redis unreachable: no updates. Workers alive at the last good read keep serving.
    assert routed_to(route(table, now_s=100.0)) == "w1"
    assert table.snapshot_age_s(100.0) == pytest.approx(100.0)
    stale = route(table, now_s=120.5)
    assert rejected(stale) is RejectReason.NO_WORKER
    assert isinstance(stale, Reject) and "stale" in stale.message

    loaded(table, make_worker(), now_s=121.0)
    assert routed_to(route(table, now_s=121.0)) == "w1"


def test_s25_a_frozen_snapshot_forgets_heartbeat_queues_once_stale() -> None:
    # The last read showed w1 with a deep queue. While reads arrive that keeps w2 preferred; once
    # the snapshot is older than the queue report TTL (Redis slow or down) the frozen queue says
    # nothing about now: only the router's own reservations count, so w1 is not starved.
    table = loaded(
        make_table(queue_report_ttl_s=1.0, max_snapshot_age_s=120.0),
        make_worker(worker_id="w1", queued_rows=50),
        make_worker(worker_id="w2"),
    )
    assert routed_to(route(table, now_s=0.5)) == "w2"
    chosen = {routed_to(route(table, now_s=1.5)) for _ in range(4)}
    assert chosen == {"w1", "w2"}


# Power-of-two-choices


def test_few_candidates_use_the_exact_minimum() -> None:
    rng = RecordingRandom(0)
    workers = [make_worker(worker_id=f"w{i}", queued_rows=10 * i) for i in range(4)]
    table = loaded(make_table(rng=rng, power_of_two_threshold=4), *workers)
    for _ in range(50):
        assert route_and_release(table) == "w0"
    assert rng.samples == []


def test_power_of_two_never_picks_the_worse_of_its_pair_and_spreads_load() -> None:
    rng = RecordingRandom(7)
    workers = [make_worker(worker_id=f"w{i}", queued_rows=10 * i) for i in range(10)]
    table = loaded(make_table(rng=rng, power_of_two_threshold=4, explore_share=0.0), *workers)
    chosen: Counter[str] = Counter()
    for _ in range(2000):
        decision = route(table)
        assert isinstance(decision, Route)
        table.release(decision.reservation_id)
        pair = rng.samples[-1]
        better = min(pair, key=lambda c: c.predicted_s)
        assert decision.worker_id == better.worker.worker_id
        chosen[decision.worker_id] += 1

    assert chosen["w9"] == 0  # the most loaded is the worse of any pair
    assert len(chosen) == 9
    # The least loaded wins whenever sampled: 2 of 10 draws.
    assert 0.16 < chosen["w0"] / 2000 < 0.24
    assert chosen["w0"] > chosen["w4"] > chosen["w8"]


def test_power_of_two_balances_reservations_across_equal_workers() -> None:
    workers = [make_worker(worker_id=f"w{i}") for i in range(10)]
    table = loaded(make_table(seed=3), *workers)
    for _ in range(1000):
        assert isinstance(route(table, remaining_s=math.inf), Route)
    loads = [table.inflight_rows(f"w{i}") for i in range(10)]
    assert sum(loads) == 1000
    assert max(loads) - min(loads) <= 4


def test_power_of_two_falls_back_to_the_best_before_rejecting() -> None:
    busy = [make_worker(worker_id=f"busy{i}", queued_rows=100) for i in range(6)]
    table = loaded(make_table(seed=1), *busy, make_worker(worker_id="idle"))
    for _ in range(200):
        assert route_and_release(table, remaining_s=0.1) == "idle"


# Read-only views


def test_served_models_groups_live_workers_by_model_version() -> None:
    table = make_table()
    table.update(
        [
            (make_worker(worker_id="w1", models=(("minilm", "1"), ("minilm", "2"))), 10.0),
            (make_worker(worker_id="w2", models=(("minilm", "1"),), is_ready=False), 10.0),
            (make_worker(worker_id="dead", models=(("gone", "1"),)), 0.0),
        ],
        now_s=10.0,
    )
    served = table.served_models(10.0)
    assert set(served) == {"minilm@1", "minilm@2"}
    assert [(w.worker_id, m.is_ready) for w, m in served["minilm@1"]] == [
        ("w1", True),
        ("w2", False),
    ]


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="routing durations and margin"):
        RoutingConfig(eject_s=-1.0)
    with pytest.raises(ValueError, match="power_of_two_threshold"):
        RoutingConfig(power_of_two_threshold=0)
    # Accepted, each refused every call: every worker dead, every snapshot too old.
    with pytest.raises(ValueError, match="stale_after_s"):
        RoutingConfig(stale_after_s=0.0)
    with pytest.raises(ValueError, match="max_snapshot_age_s"):
        RoutingConfig(max_snapshot_age_s=0.0)
    with pytest.raises(ValueError, match="two registry refresh periods"):
        RouterConfig(redis_url="redis://x", routing=RoutingConfig(max_snapshot_age_s=0.3))
    RouterConfig(redis_url="redis://x", routing=RoutingConfig(max_snapshot_age_s=1.0))


# Retry budget


def test_s05_retry_budget_holds_retries_to_the_ratio_under_traffic() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=0.0, window_s=10.0)
    allowed = 0
    for i in range(5000):  # 100 requests/s for 50 s, every one wanting a retry
        now_s = i * 0.01
        budget.record_request(now_s)
        allowed += budget.try_spend(now_s)
    assert 0.19 * 5000 <= allowed <= 0.2 * 5000


def test_retry_budget_floor_lets_a_few_retries_through_at_zero_traffic() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=1.0, window_s=10.0)
    assert sum(budget.try_spend(0.0) for _ in range(100)) == 10
    assert not budget.try_spend(5.0)
    # The floor's withdrawals age out with the window, so the reserve comes back.
    assert sum(budget.try_spend(10.0) for _ in range(100)) == 10


def test_retry_budget_cap_holds_after_idle() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=1.0, window_s=10.0)
    for i in range(1000):
        budget.record_request(i * 0.001)
    assert budget.balance(1.0) == pytest.approx(0.2 * 1000 + 10)
    # An hour of quiet banks nothing beyond the reserve.
    assert budget.balance(3600.0) == pytest.approx(10)
    assert sum(budget.try_spend(3600.0) for _ in range(500)) == 10


def test_retries_paid_by_deposits_expire_with_them_and_leave_the_reserve() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=1.0, window_s=10.0)  # a reserve of 10
    for _ in range(1000):  # a burst deposits 200 tokens
        budget.record_request(0.0)
    assert sum(budget.try_spend(9.5) for _ in range(300)) == 210  # the deposits and reserve
    # The burst's deposits have expired, and with them the retries they paid for: the
    # reserve's 10 are spent until they age out (before, the 200 retries outlived their
    # deposits as a debt, and no retry got through until 19.5 s).
    assert budget.balance(10.0) == pytest.approx(0.0, abs=1e-9)
    assert budget.try_spend(19.5)


def test_retry_budget_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="ratio and min_per_s must be >= 0"):
        RetryBudget(ratio=-0.1)
    with pytest.raises(ValueError, match="window_s > 0"):
        RetryBudget(window_s=0.0)


def test_generation_prefers_a_worker_whose_free_kv_blocks_hold_the_prompt() -> None:
    def generation_worker(worker_id: str, *, queued_rows: int, kv_blocks_free: int) -> WorkerRecord:
        base = make_worker(worker_id=worker_id, queued_rows=queued_rows)
        model = dataclasses.replace(base.models[0], kv_blocks_free=kv_blocks_free, kv_block_size=16)
        return dataclasses.replace(base, models=(model,))

    table = make_table()
    # w1 is idle but its cache is full; w2 has a queue but room for a 40-token prompt.
    table.update(
        [
            (generation_worker("w1", queued_rows=0, kv_blocks_free=1), 0.0),
            (generation_worker("w2", queued_rows=5, kv_blocks_free=3), 0.0),
        ],
        0.0,
    )
    route = table.route(*MODEL, num_rows=40, remaining_s=10.0, now_s=0.0)
    assert isinstance(route, Route) and route.worker_id == "w2"
    # A prompt both can hold goes to the idle one.
    route = table.route(*MODEL, num_rows=10, remaining_s=10.0, now_s=0.0)
    assert isinstance(route, Route) and route.worker_id == "w1"


def test_generation_counts_the_prompts_it_sent_since_the_report_against_free_kv_room() -> None:
    """Room was the heartbeat's free blocks alone: every prompt routed before the next report
    went to the worker that looked roomy, though only the first few fit (review finding)."""

    def generation_worker(worker_id: str, *, kv_blocks_free: int) -> WorkerRecord:
        base = make_worker(worker_id=worker_id)
        model = dataclasses.replace(base.models[0], kv_blocks_free=kv_blocks_free, kv_block_size=16)
        return dataclasses.replace(base, models=(model,))

    table = loaded(
        make_table(), generation_worker("w1", kv_blocks_free=10),
        generation_worker("w2", kv_blocks_free=2),
    )  # fmt: skip
    # 160 tokens free on w1, 32 on idle w2: w1 holds three prompts of 50 tokens, not four
    # (none started yet); the fourth fits neither, and goes to the one with no queue.
    routes = [table.route(*MODEL, num_rows=50, remaining_s=10.0, now_s=0.0) for _ in range(4)]
    assert [routed_to(r) for r in routes] == ["w1", "w1", "w1", "w2"]


def test_s27_an_empty_read_keeps_the_last_workers_until_their_heartbeats_would_be_stale() -> None:
    # Issue 16: a restarted, empty Redis wiped routing at once and clients got NOT_FOUND.
    table = loaded(make_table(stale_after_s=3.0), make_worker(), now_s=10.0)
    table.update([], now_s=11.0)  # Redis restarted empty; the worker re-registers within 1 s
    assert isinstance(route(table, now_s=11.0), Route)
    table.update([], now_s=14.0)  # still empty past stale_after_s: the worker is taken as dead
    assert rejected(route(table, now_s=14.0)) is RejectReason.NO_WORKER
    loaded(table, make_worker(worker_id="w2"), now_s=15.0)  # a non-empty read replaces it
    chosen = route(table, now_s=15.0)
    assert isinstance(chosen, Route) and chosen.worker_id == "w2"


def test_a_model_once_served_is_never_unknown_again() -> None:
    table = loaded(make_table(), make_worker(models=(MODEL, ("other", "1"))), now_s=0.0)
    loaded(table, make_worker(worker_id="w2"), now_s=1.0)  # "other" is served nowhere now
    # It may come back (a worker restarting): UNAVAILABLE, not a permanent NOT_FOUND.
    assert rejected(route(table, name="other", now_s=1.0)) is RejectReason.NO_WORKER
    assert rejected(route(table, name="never", now_s=1.0)) is RejectReason.UNKNOWN_MODEL


def test_a_worker_whose_calls_only_time_out_is_skipped_then_probed_by_one_request() -> None:
    table = loaded(
        make_table(timeouts_to_eject=2, timeout_eject_s=10.0),
        make_worker(worker_id="w1"),
        make_worker(worker_id="w2", queued_rows=50),
    )
    for _ in range(2):
        assert routed_to(route(table, now_s=1.0)) == "w1"
        table.timeouts.record_timeout("w1", 1.0, waited_s=1.0, predicted_s=0.01)
    assert routed_to(route(table, now_s=1.0)) == "w2"
    loaded(table, make_worker(worker_id="w1"), make_worker(worker_id="w2"), now_s=10.9)
    assert routed_to(route(table, now_s=10.9)) == "w2"  # a fresh heartbeat does not un-eject
    assert routed_to(route(table, now_s=11.0)) == "w1"  # the probe
    assert routed_to(route(table, now_s=11.0)) == "w2"  # only one while it is out
    table.timeouts.record_success("w1", 11.1)
    assert routed_to(route(table, now_s=11.1)) == "w1"


def test_a_worker_restarted_under_its_id_is_no_longer_ejected() -> None:
    """w1, ejected for timeouts and for an UNAVAILABLE, is restarted under its id (a container
    restarted in its pod: its hostname kept, its pid may be): a new process, at a new start or
    address, began ejected for what its predecessor did, for up to max_timeout_eject_s
    (review finding). The same process beating again stays ejected."""
    busy = make_worker(worker_id="w2", queued_rows=50)
    table = loaded(
        make_table(timeouts_to_eject=2, timeout_eject_s=10.0, eject_s=5.0), make_worker(), busy
    )
    for _ in range(2):
        table.timeouts.record_timeout("w1", 1.0, waited_s=1.0, predicted_s=0.01)
    table.eject("w1", 1.0)
    loaded(table, make_worker(), busy, now_s=2.0)  # the same process: still ejected
    assert routed_to(route(table, now_s=2.0)) == "w2"
    restarted = dataclasses.replace(make_worker(), started_at_ms=1_000)
    assert WorkerRecord.from_json(restarted.to_json()) == restarted
    loaded(table, restarted, busy, now_s=2.5)
    assert routed_to(route(table, now_s=2.5)) == "w1"
    for _ in range(2):
        table.timeouts.record_timeout("w1", 3.0, waited_s=1.0, predicted_s=0.01)
    assert routed_to(route(table, now_s=3.0)) == "w2"
    moved = dataclasses.replace(restarted, address="10.0.0.9:50051")  # a new pod, the same id
    loaded(table, moved, busy, now_s=3.5)
    assert routed_to(route(table, now_s=3.5)) == "w1"


def test_the_last_worker_a_model_has_is_still_routed_when_its_calls_time_out() -> None:
    """Envoy's panic mode, entered only when no other worker is left: every worker timing out
    is an overloaded machine more likely than wedged workers, and ejecting the last would turn
    late answers into none."""
    table = loaded(
        make_table(timeouts_to_eject=2, timeout_eject_s=10.0), make_worker(worker_id="w1")
    )
    for _ in range(2):
        assert routed_to(route(table, now_s=1.0)) == "w1"
        table.timeouts.record_timeout("w1", 1.0, waited_s=1.0, predicted_s=0.01)
    assert table.timeouts.is_ejected("w1", 1.0)
    assert routed_to(route(table, now_s=1.0)) == "w1"
    # A second worker takes every call while the first is ejected ...
    w2 = make_worker(worker_id="w2", queued_rows=50)
    loaded(table, make_worker(worker_id="w1"), w2, now_s=2.0)
    assert {routed_to(route(table, now_s=2.0)) for _ in range(5)} == {"w2"}
    # ... but a retry that already tried it has only the ejected one left: it goes there.
    assert routed_to(route(table, now_s=2.0, exclude=frozenset({"w2"}))) == "w1"
    # So does one that refused a call UNAVAILABLE: skipped only while another is routable.
    table.eject("w1", 2.0)
    assert {routed_to(route(table, now_s=2.0)) for _ in range(5)} == {"w2"}
    assert routed_to(route(table, now_s=2.0, exclude=frozenset({"w2"}))) == "w1"


def test_bad_timeout_ejection_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="eject_s <= max_eject_s"):
        RoutingConfig(timeout_eject_s=60.0, max_timeout_eject_s=30.0)


# Tenants: the wait of a request is its tenant's under fair share


def test_a_flooding_tenants_backlog_does_not_refuse_a_light_tenant() -> None:
    # One worker, 0.01 s a row, 0.25 s to go: 24 rows ahead is the most a request can wait for.
    table = loaded(make_table(), make_worker())

    def send(tenant: str, num_rows: int = 1) -> Route | Reject:
        return table.route(*MODEL, num_rows, 0.25, 0.0, tenant=tenant, weight=1.0)

    flood = [send("flood", 4) for _ in range(6)]  # 24 rows reserved: the queue is full for it
    assert all(isinstance(d, Route) for d in flood)
    assert rejected(send("flood")) is RejectReason.DEADLINE
    # Fair share serves one of the flood's rows per row of the light tenant's: 1 ahead.
    light = send("light")
    assert isinstance(light, Route) and light.predicted_s == pytest.approx(0.02)
    # An anonymous request (no tenant from the gateway) waits for the whole queue, as before.
    assert rejected(table.route(*MODEL, 1, 0.25, 0.0)) is RejectReason.DEADLINE


def test_weights_and_the_heartbeat_queue_scale_the_tenants_share() -> None:
    # The heartbeat reports 40 rows, this router sent 20 of them (10 each): the rest (other
    # routers' traffic) is taken to be made up alike.
    table = loaded(make_table(), make_worker(queued_rows=40))
    for tenant, weight in (("gold", 3.0), ("bronze", 1.0)):
        for _ in range(2):
            assert isinstance(
                table.route(*MODEL, 5, 10.0, 0.0, tenant=tenant, weight=weight), Route
            )
    gold = table.route(*MODEL, 1, 10.0, 0.0, tenant="gold", weight=3.0)
    bronze = table.route(*MODEL, 1, 10.0, 0.0, tenant="bronze", weight=1.0)
    # gold: its 10 rows and ceil(11 x 1 / 3) = 4 of bronze's, of 20 -> 14/20 of 40 = 28 ahead.
    assert isinstance(gold, Route) and gold.predicted_s == pytest.approx((28 + 1) * 0.01)
    # bronze: its 10 rows and all 11 of gold's (three of gold's go per row of its own), 21 of
    # 21: the whole queue of 40 is ahead of it.
    assert isinstance(bronze, Route) and bronze.predicted_s == pytest.approx((40 + 1) * 0.01)


def test_tenant_bookkeeping_is_released_with_the_last_row() -> None:
    table = loaded(make_table(), make_worker())
    decisions = [table.route(*MODEL, 2, 10.0, 0.0, tenant=t, weight=1.0) for t in ("a", "b")]
    for decision in decisions:
        assert isinstance(decision, Route)
        table.release(decision.reservation_id)
    assert table.inflight_rows("w1") == 0
    # With nothing reserved, a tenant's wait is the worker's whole (empty) queue again.
    again = table.route(*MODEL, 1, 10.0, 0.0, tenant="a", weight=1.0)
    assert isinstance(again, Route) and again.predicted_s == pytest.approx(0.01)


def test_an_idle_worker_predicted_slow_still_gets_a_share_to_correct_its_estimates() -> None:
    # w2's estimates are five times w1's (warmed up while its machine was busy): by prediction
    # alone w1 wins every route of this light load, and w2 would never serve a row that could
    # show it is as fast. A share of the routes explores it while it is idle.
    fast = make_worker(worker_id="w1", per_row_s=0.01, min_batch_s=0.01)
    slow = make_worker(worker_id="w2", per_row_s=0.05, min_batch_s=0.05)
    for share, low, high in ((0.0, 0, 0), (0.05, 60, 140)):
        table = loaded(make_table(seed=1, explore_share=share), fast, slow)
        chosen: Counter[str] = Counter()
        for _ in range(2000):
            chosen[route_and_release(table, remaining_s=0.2)] += 1
        assert low <= chosen["w2"] <= high, (share, chosen)


def test_exploration_never_sends_a_request_where_it_would_be_late() -> None:
    fast = make_worker(worker_id="w1", per_row_s=0.01, min_batch_s=0.01)
    too_slow = make_worker(worker_id="w2", per_row_s=0.5, min_batch_s=0.5)
    table = loaded(make_table(seed=1, explore_share=1.0), fast, too_slow)
    for _ in range(50):
        assert route_and_release(table, remaining_s=0.2) == "w1"


def test_exploration_never_moves_a_prompt_to_a_worker_whose_kv_cache_cannot_hold_it() -> None:
    """A generation worker idle (no prompt waits) with its cache full of decoding sequences is
    no place to explore with a prompt a busier worker has room for."""

    def generation_worker(worker_id: str, *, queued_rows: int, kv_blocks_free: int) -> WorkerRecord:
        base = make_worker(worker_id=worker_id, queued_rows=queued_rows)
        model = dataclasses.replace(base.models[0], kv_blocks_free=kv_blocks_free, kv_block_size=16)
        return dataclasses.replace(base, models=(model,))

    table = make_table(seed=1, explore_share=1.0)
    table.update(
        [
            (generation_worker("w1", queued_rows=0, kv_blocks_free=1), 0.0),
            (generation_worker("w2", queued_rows=5, kv_blocks_free=3), 0.0),
        ],
        0.0,
    )
    for _ in range(50):
        decision = table.route(*MODEL, num_rows=40, remaining_s=10.0, now_s=0.0)
        assert isinstance(decision, Route) and decision.worker_id == "w2"
        table.release(decision.reservation_id)


def test_explore_share_must_be_a_share() -> None:
    with pytest.raises(ValueError, match="explore_share"):
        RoutingConfig(explore_share=1.5)


def test_can_take_judges_as_route_does_and_reserves_nothing() -> None:
    # w1 has 50 rows queued (0.51 s for one more row), w2 90 (0.91 s).
    table = loaded(make_table(), make_worker(worker_id="w1", queued_rows=50),
                   make_worker(worker_id="w2", queued_rows=90))  # fmt: skip
    assert table.can_take(*MODEL, 1, 0.6, 0.0)
    assert not table.can_take(*MODEL, 10, 0.6, 0.0)  # 0.6 s on w1: past 0.6 less the margin
    assert isinstance(route(table, num_rows=10, remaining_s=0.6), Reject)
    assert table.inflight_rows("w1") == table.inflight_rows("w2") == 0
    assert not table.can_take("other", "1", 1, 10.0, 0.0)
    assert not make_table().can_take(*MODEL, 1, 10.0, 0.0)  # no snapshot yet


def test_workers_that_leave_the_snapshot_are_named_and_their_timeouts_forgotten() -> None:
    """A worker id is a host and a process: every pod restart is a new worker, and what a
    router keeps of each one gone (its ejection, its last answer, its metric series) must go
    with it, or it grows with every restart."""
    table = loaded(make_table(), make_worker(worker_id="w1"), make_worker(worker_id="w2"))
    for _ in range(5):  # w2's calls only time out: ejected
        table.timeouts.record_timeout("w2", 1.0, waited_s=1.0, predicted_s=0.01)
    assert table.timeouts.is_ejected("w2", 1.0)

    assert table.update([(make_worker(worker_id="w1"), 2.0)], 2.0) == {"w2"}
    assert not table.timeouts.is_ejected("w2", 2.0)  # forgotten, not merely left
    # An empty read keeps the snapshot (a restarted Redis): nobody left.
    assert table.update([], 3.0) == set()
    assert table.update([(make_worker(worker_id="w1"), 4.0)], 4.0) == set()


def test_a_late_outcome_of_a_worker_that_left_is_not_kept() -> None:
    """A call to a worker lost without deregistering may time out (or be answered) after the
    registry's read found it gone: nothing is recorded of it then, or every such worker would
    be kept for the router's life (and its ejection counted in a series never removed)."""
    table = loaded(make_table(), make_worker(worker_id="w1"), make_worker(worker_id="w2"))
    assert table.update([(make_worker(worker_id="w1"), 2.0)], 2.0) == {"w2"}
    ejector = table.timeouts
    periods = [ejector.record_timeout("w2", 3.0, waited_s=5.0, predicted_s=0.01) for _ in range(5)]
    assert periods == [None] * 5  # never ejected: its ejection is not counted either
    ejector.record_success("w2", 3.0)
    assert "w2" not in ejector._workers and "w2" not in ejector._last_answer_s
    # The workers still there are recorded as before.
    for _ in range(5):
        ejector.record_timeout("w1", 3.0, waited_s=5.0, predicted_s=0.01)
    assert ejector.is_ejected("w1", 3.0)
    # A worker that (re)joins is recorded again.
    table.update([(make_worker(worker_id="w1"), 4.0), (make_worker(worker_id="w2"), 4.0)], 4.0)
    ejector.record_success("w2", 4.0)
    assert ejector._last_answer_s["w2"] == 4.0


def test_the_series_of_workers_that_left_are_removed() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    for worker in ("w1", "w2"):
        metrics.routed_total_of[("minilm", "1", worker)].inc()
        metrics.ejections_total.labels(worker).inc()

    metrics.forget_workers({"w2"})
    text = generate_latest(metrics.registry).decode()
    assert 'worker="w1"' in text
    assert 'worker="w2"' not in text
    assert list(metrics.routed_total_of) == [("minilm", "1", "w1")]
    metrics.forget_workers({"w3"})  # never seen: nothing to remove, no error


def test_with_one_worker_timing_out_and_one_reset_the_reset_one_is_routed_to() -> None:
    """w2 is ejected for timeouts (wedged, say), then w1's stream resets once (ejected for
    UNAVAILABLE). The UNAVAILABLE ejection left only w2, and panic mode then routed every
    call to it, the worker known to answer nothing, for w1's `eject_s` (review finding):
    w1, which may only have lost a stream, is tried first."""
    table = loaded(
        make_table(timeouts_to_eject=2, timeout_eject_s=10.0),
        make_worker(worker_id="w1"),
        make_worker(worker_id="w2", queued_rows=50),
    )
    for _ in range(2):
        table.timeouts.record_timeout("w2", 1.0, waited_s=1.0, predicted_s=0.01)
    table.eject("w1", 1.0)
    assert {routed_to(route(table, now_s=1.0)) for _ in range(5)} == {"w1"}


def test_a_frozen_report_s_kv_room_is_not_held_against_its_worker() -> None:
    """Redis away, routing runs on the last snapshot: its queue counts were set aside after
    queue_report_ttl_s, but its free KV blocks were still read, so a worker whose cache was
    full at the last read got no prompt for as long as the outage lasted (up to the snapshot's
    2 minutes) while the other took them all (review finding)."""

    def generation_worker(worker_id: str, *, kv_blocks_free: int) -> WorkerRecord:
        base = make_worker(worker_id=worker_id)
        model = dataclasses.replace(base.models[0], kv_blocks_free=kv_blocks_free, kv_block_size=16)
        return dataclasses.replace(base, models=(model,))

    table = loaded(
        make_table(queue_report_ttl_s=1.0, max_snapshot_age_s=120.0),
        generation_worker("w1", kv_blocks_free=0), generation_worker("w2", kv_blocks_free=100),
    )  # fmt: skip
    fresh = [table.route(*MODEL, num_rows=10, remaining_s=60.0, now_s=0.5) for _ in range(4)]
    assert [routed_to(r) for r in fresh] == ["w2"] * 4  # the report is fresh: w1 has no room
    for sent in fresh:
        assert isinstance(sent, Route)
        table.release(sent.reservation_id)
    frozen = {routed_to(table.route(*MODEL, num_rows=10, remaining_s=60.0, now_s=30.0))
              for _ in range(8)}  # fmt: skip
    assert frozen == {"w1", "w2"}
