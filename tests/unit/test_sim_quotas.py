"""The simulated gateways run the real tenant quotas: rates, calls in flight (released on every
answer and refusal), priority classes, models, fleet-wide shares; scenario [tenants.NAME]
tables, and their weights in the batcher's fair share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.gateway.tenants import TenantPolicy
from services.sim.gateway import GatewayAdmission, QuotaRefused, gateway_index
from services.sim.report import format_table
from services.sim.scenario import parse_scenario
from services.sim.shards import shard_of
from services.sim.simulation import Scenario, run
from services.sim.traffic import Arrival

pytestmark = pytest.mark.unit


def make_arrival(*, tenant: str = "t", priority: str = "interactive", model: str = "m") -> Arrival:
    return Arrival(at_s=0.0, model=model, tenant=tenant, priority=priority, num_tokens=12)


def make_admission(num_gateways: int = 1, **limits: Any) -> GatewayAdmission:
    return GatewayAdmission({"t": TenantPolicy("t", **limits)}, num_gateways, sync_period_s=0.5)


def test_the_request_rate_is_a_token_bucket_burst_s_deep() -> None:
    admission = make_admission(requests_per_s=10.0, burst_s=1.0)
    granted = [admission.admit(0, make_arrival(), now_s=0.0) is None for _ in range(11)]
    assert granted == [True] * 10 + [False]
    assert admission.admit(0, make_arrival(), now_s=0.05) == QuotaRefused("requests_per_s")
    assert admission.admit(0, make_arrival(), now_s=0.11) is None


def test_calls_in_flight_are_limited_until_released() -> None:
    admission = make_admission(max_concurrency=2)
    assert admission.admit(0, make_arrival(), now_s=0.0) is None
    assert admission.admit(0, make_arrival(), now_s=0.0) is None
    assert admission.admit(0, make_arrival(), now_s=0.0) == QuotaRefused("max_concurrency")
    admission.release(0, "t")
    assert admission.in_flight(0, "t") == 1
    assert admission.admit(0, make_arrival(), now_s=0.0) is None


def test_a_class_or_model_not_granted_is_refused_and_holds_no_slot() -> None:
    tenants = {
        "t": TenantPolicy("t", max_concurrency=1, models=frozenset({"m"})),
    }
    admission = GatewayAdmission(tenants, 1, sync_period_s=0.5)
    critical = make_arrival(priority="critical")
    assert admission.admit(0, critical, now_s=0.0) == QuotaRefused("priority")
    assert admission.admit(0, make_arrival(model="other"), now_s=0.0) == QuotaRefused("models")
    assert admission.in_flight(0, "t") == 0
    assert admission.admit(0, make_arrival(), now_s=0.0) is None


def test_the_row_rate_refuses_after_the_request_token_and_frees_the_slot() -> None:
    admission = make_admission(rows_per_s=2.0, burst_s=1.0, max_concurrency=5)
    arrival = make_arrival()
    admitted = [admission.admit(0, arrival, now_s=0.0) for _ in range(3)]
    assert admitted == [None] * 3  # the row rate is charged apart, after the throttle
    assert [admission.take_rows(0, arrival, now_s=0.0) for _ in range(3)] == [
        None,
        None,
        QuotaRefused("rows_per_s"),
    ]
    assert admission.in_flight(0, "t") == 2
    admission.give_back_rows(0, arrival, now_s=0.0)  # one refused downstream for load, unrun
    assert admission.take_rows(0, arrival, now_s=0.0) is None


def test_calls_the_throttle_or_downstream_refuses_spend_none_of_their_tenants_rows() -> None:
    """The real gateway charges a call's rows after its throttle and gives them back when the
    call is refused downstream for load (predictor.py, admission.never_served); the simulated
    one charged every call before its throttle and kept them all: after a flood its tenant was
    refused for rows it never got (review finding). One worker, a tenant offering 6,000 calls/s
    against ~2,000 served with a row rate of 3,000/s: the rows refused stay few."""
    summary = run(
        make_scenario(
            fleet={"workers": 1},
            tenants={"b": {"rows_per_s": 3000, "burst_s": 0.5}},
            traffic={"streams": [{"tenant": "b", "rate_per_s": 6000, "timeout_ms": 200}]},
            duration_s=4,
        )
    ).summary
    refusals = summary["refusals"]
    throttled_or_downstream = sum(
        v for k, v in refusals.items() if not k.startswith("gateway_quota")
    )
    assert throttled_or_downstream > 5000
    assert refusals.get("gateway_quota_rows_per_s", 0) < 0.2 * throttled_or_downstream, refusals


def test_the_simulated_router_retries_as_often_as_the_real_one() -> None:
    from services.router.config import RouterConfig
    from services.sim.fleet_config import FleetConfig

    assert FleetConfig().max_retries == RouterConfig.max_retries


def test_a_tenant_without_a_table_is_unlimited() -> None:
    admission = make_admission(requests_per_s=1.0)
    other = make_arrival(tenant="other", priority="batch")
    assert all(admission.admit(0, other, now_s=0.0) is None for _ in range(1000))


def test_gateways_split_a_fleet_wide_limit_by_their_share_of_the_demand() -> None:
    admission = make_admission(num_gateways=2, requests_per_s=100.0, burst_s=1.0)
    assert admission.needs_sync
    for _ in range(20):
        assert admission.admit(0, make_arrival(), now_s=0.0) is None
    admission.sync(0.5)
    # Gateway 1 saw no demand: it keeps the floor share, 10% of an equal half (5 requests/s).
    granted = sum(admission.admit(1, make_arrival(), now_s=0.5) is None for _ in range(10))
    assert granted == 5
    # Gateway 0 had all the demand: it enforces the whole limit, 100 deep.
    granted = sum(admission.admit(0, make_arrival(), now_s=0.5) is None for _ in range(150))
    assert granted == 100


def make_scenario(**overrides: Any) -> Scenario:
    """2 workers serving ~4,000 rows/s; tenants a (100/s) and b (400/s) for 6 s."""
    raw: dict[str, Any] = {
        "name": "tenants",
        "duration_s": 6,
        "warmup_s": 1,
        "curve": {"fixed_ms": 5.0, "per_token_us": 20.0},
        "model": {"name": "m", "slo_ms": 200, "max_batch_size": 32, "length_buckets": [16]},
        "fleet": {"workers": 2},
        "traffic": {
            "streams": [
                {"tenant": "a", "rate_per_s": 100, "lengths": [[12, 1.0]]},
                {"tenant": "b", "rate_per_s": 400, "lengths": [[12, 1.0]]},
            ]
        },
    }
    raw.update(overrides)
    return parse_scenario(raw, base_dir=Path("."), default_name="tenants")


def test_a_tenant_over_its_rate_is_refused_at_the_gateway_and_the_other_is_not() -> None:
    summary = run(make_scenario(tenants={"b": {"requests_per_s": 200, "burst_s": 0.5}})).summary
    refused = summary["refusals"]["gateway_quota_requests_per_s"]
    # b offers ~400/s for the 5 measured seconds and keeps ~200/s of it.
    assert refused == pytest.approx(200 * 5, rel=0.15)
    assert summary["goodput_per_s_by_tenant"]["b"] == pytest.approx(200, rel=0.1)
    assert summary["slo_attainment_by_tenant"]["a"] == 1.0
    table = format_table(summary)
    assert "goodput by tenant (req/s)" in table
    assert "p99 by tenant (ms)" in table


def test_answers_release_calls_in_flight_so_a_concurrency_limit_never_leaks() -> None:
    # ~400/s of calls answered within ~50 ms keep at most ~20 in flight. Had any answer kept
    # its slot, the tenant would be refused everything after its first 40 calls.
    summary = run(make_scenario(tenants={"b": {"max_concurrency": 40}})).summary
    assert summary["goodput_per_s_by_tenant"]["b"] > 0.95 * 400
    assert summary["refusals"].get("gateway_quota_max_concurrency", 0) < 0.01 * 400 * 5
    # A limit below what the load keeps in flight refuses some, and only some.
    tight = run(make_scenario(tenants={"b": {"max_concurrency": 4}})).summary
    assert 0 < tight["refusals"]["gateway_quota_max_concurrency"] < 0.9 * 400 * 5


def test_refusals_downstream_also_release_the_slot() -> None:
    # One worker, 6,000 calls/s against ~2,000 it serves, each answered or refused within its
    # 200 ms deadline: never 1,200 in flight, so a limit of 2,000 never binds. The throttle and
    # the router refuse thousands of calls; had a refusal kept its slot, the quota would refuse
    # everything after the first 2,000.
    summary = run(
        make_scenario(
            fleet={"workers": 1},
            tenants={"b": {"max_concurrency": 2000}},
            traffic={"streams": [{"tenant": "b", "rate_per_s": 6000, "timeout_ms": 200}]},
            duration_s=4,
        )
    ).summary
    refusals = summary["refusals"]
    assert "gateway_quota_max_concurrency" not in refusals
    assert sum(refusals.values()) > 5000


def test_a_class_the_tenant_was_not_granted_is_refused() -> None:
    traffic = {"streams": [{"tenant": "a", "priority": "critical", "rate_per_s": 100}]}
    summary = run(make_scenario(traffic=traffic, tenants={"a": {"weight": 1.0}})).summary
    assert summary["refusals"] == {"gateway_quota_priority": pytest.approx(500, rel=0.2)}
    granted = {"a": {"priorities": ["critical", "interactive"]}}
    assert run(make_scenario(traffic=traffic, tenants=granted)).summary["refusals"] == {}


def test_tenant_weights_feed_the_batcher_from_one_place() -> None:
    scenario = make_scenario(
        tenants={"a": {"weight": 3.0}, "b": {"requests_per_s": 10}},
        batching={"tenant_weights": {"c": 2.0}},
    )
    assert dict(scenario.driver.tenant_weights) == {"a": 3.0, "c": 2.0}
    assert scenario.fleet.tenants["b"].requests_per_s == 10.0
    same = make_scenario(tenants={"a": {"weight": 3.0}}, batching={"tenant_weights": {"a": 3}})
    assert dict(same.driver.tenant_weights) == {"a": 3.0}
    with pytest.raises(ValueError, match="set it in one place"):
        make_scenario(tenants={"a": {"weight": 3.0}}, batching={"tenant_weights": {"a": 2.0}})


def test_a_tenant_table_is_read_as_the_gateway_reads_it() -> None:
    with pytest.raises(ValueError, match="unknown settings"):
        make_scenario(tenants={"a": {"rate_per_s": 10}})
    with pytest.raises(ValueError, match="max_concurrency"):
        make_scenario(tenants={"a": {"max_concurrency": 0}})
    with pytest.raises(ValueError, match=r"\[tenants.NAME\]"):
        make_scenario(fleet={"workers": 1, "tenants": {}})


def test_a_shard_enforces_its_part_of_each_fleet_wide_limit() -> None:
    tenants = {"b": {"requests_per_s": 200, "rows_per_s": 300, "max_concurrency": 5}}
    scenario = make_scenario(fleet={"workers": 2, "cell_size": 1}, tenants=tenants)
    policy = shard_of(scenario, 0, 2).fleet.tenants["b"]
    assert (policy.requests_per_s, policy.rows_per_s, policy.max_concurrency) == (100, 150, 3)


def test_calls_spread_evenly_over_the_gateways_within_every_second() -> None:
    """A float's hash is its whole part plus its fraction's bits shifted high, so `hash(t) %
    n` sent every call of a second to gateway `floor(t) % n` for any n a power of two (review
    finding): with tenant quotas split by demand, each second's gateway held only its floor
    share and refused most of the second's calls."""
    times = [i / 1000 + 0.0001 * (i % 7) for i in range(5_000)]  # 1,000 calls a second
    for num_gateways in (2, 3, 4, 8):
        per_second = [[0] * num_gateways for _ in range(5)]
        for at_s in times:
            per_second[int(at_s)][gateway_index(at_s, num_gateways)] += 1
        for counts in per_second:
            assert min(counts) > 0.7 * 1_000 / num_gateways, (num_gateways, counts)
    assert [gateway_index(t, 4) for t in (1.5, 1.25, 1.75, 2.0)] == [3, 1, 2, 0]  # pinned


def test_a_limited_tenant_keeps_its_rate_through_two_gateways_as_through_one() -> None:
    """Its calls split over two gateways, each holding about half its fleet-wide limit: it is
    refused about what one gateway refuses (before, each second's calls met one gateway)."""
    tenants = {"b": {"requests_per_s": 200, "burst_s": 0.5}}
    one = run(make_scenario(tenants=tenants)).summary
    two = run(make_scenario(tenants=tenants, fleet={"workers": 2, "gateways": 2})).summary
    assert two["goodput_per_s_by_tenant"]["b"] == pytest.approx(
        one["goodput_per_s_by_tenant"]["b"], rel=0.15
    )
