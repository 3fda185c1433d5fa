"""Tenant quotas (token buckets, concurrency, fleet shares) and tenant configuration."""

from __future__ import annotations

import pytest

from services.common.errors import PermissionDenied
from services.common.priority import PriorityClass
from services.gateway.quotas import (
    MAX_SHARED_WAIT_S,
    MIN_SHARE_OF_EQUAL,
    TenantQuotas,
    TokenBucket,
    fleet_shares,
)
from services.gateway.tenants import TenantLabels, TenantPolicy, parse_tenants

pytestmark = pytest.mark.unit


def make_policy(**settings: object) -> TenantPolicy:
    return TenantPolicy(name="search", **settings)  # type: ignore[arg-type]


def test_token_bucket_grants_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(rate_per_s=10.0, capacity=5.0, level=5.0, updated_s=0.0)
    assert [bucket.take(1, now_s=0.0) for _ in range(5)] == [0.0] * 5
    assert bucket.take(1, now_s=0.0) == pytest.approx(0.1)  # one token every 0.1 s
    assert bucket.take(1, now_s=0.1) == 0.0
    # Idle time banks no more than the capacity.
    bucket.refill(now_s=100.0)
    assert bucket.level == 5.0


def test_a_take_larger_than_the_bucket_waits_for_a_full_bucket_then_goes_into_debt() -> None:
    bucket = TokenBucket(rate_per_s=10.0, capacity=5.0, level=2.0, updated_s=0.0)
    assert bucket.take(8, now_s=0.0) == pytest.approx(0.3)
    assert bucket.take(8, now_s=0.3) == 0.0
    assert bucket.level == pytest.approx(-3.0)
    assert bucket.take(1, now_s=0.3) == pytest.approx(0.4)


def test_requests_over_the_rate_are_refused_naming_the_quota_with_a_retry_hint() -> None:
    quotas, policy = TenantQuotas(), make_policy(requests_per_s=4.0, burst_s=0.5)
    decisions = [quotas.acquire(policy, now_s=0.0) for _ in range(3)]
    assert decisions[:2] == [None, None]
    refusal = decisions[2]
    assert refusal is not None and refusal.quota == "requests_per_s"
    assert "search" in refusal.message and "4 requests/s" in refusal.message
    assert refusal.retry_after_s == pytest.approx(0.25)
    assert quotas.acquire(policy, now_s=0.25) is None


def test_rows_are_charged_to_their_own_bucket() -> None:
    quotas, policy = TenantQuotas(), make_policy(rows_per_s=10.0)
    assert quotas.take_rows(policy, 10, now_s=0.0) is None
    refusal = quotas.take_rows(policy, 5, now_s=0.0)
    assert refusal is not None and refusal.quota == "rows_per_s"
    assert refusal.retry_after_s == pytest.approx(0.5)


def test_concurrency_counts_calls_from_enter_to_release() -> None:
    quotas, policy = TenantQuotas(), make_policy(max_concurrency=2)
    for _ in range(2):
        assert quotas.acquire(policy, now_s=0.0) is None
        quotas.enter("search")
    refusal = quotas.acquire(policy, now_s=0.0)
    assert refusal is not None and refusal.quota == "max_concurrency"
    quotas.release("search")
    assert quotas.acquire(policy, now_s=0.0) is None


def test_an_unlimited_tenant_is_never_refused_but_its_demand_is_counted() -> None:
    quotas, policy = TenantQuotas(), make_policy()
    assert all(quotas.acquire(policy, now_s=0.0) is None for _ in range(1000))
    assert quotas.take_offered() == {"search": 1000}
    assert quotas.take_offered() == {}


def test_a_tightened_rate_takes_effect_at_once() -> None:
    quotas = TenantQuotas()
    assert quotas.acquire(make_policy(requests_per_s=100.0), now_s=0.0) is None
    tight = make_policy(requests_per_s=1.0, burst_s=1.0)
    # The bucket shrinks to the new depth (1 token): one more call, then refusals.
    assert quotas.acquire(tight, now_s=0.0) is None
    assert quotas.acquire(tight, now_s=0.0) is not None


def test_a_gateway_enforces_its_share_of_fleet_wide_limits() -> None:
    quotas, policy = TenantQuotas(), make_policy(requests_per_s=100.0, burst_s=0.1)
    quotas.set_shares({"search": 0.25})
    granted = sum(quotas.acquire(policy, now_s=0.0) is None for _ in range(100))
    assert granted == 2  # 25 requests/s x 0.1 s of burst, rounded down to whole calls


def test_a_tenant_the_last_round_did_not_know_gets_an_equal_share_of_the_fleet() -> None:
    """Limited by a keys reload after the round: with a share of 1, every one of 4 gateways
    admitted its whole fleet-wide limit until the next round (review finding)."""
    quotas, policy = TenantQuotas(), make_policy(requests_per_s=100.0, burst_s=1.0)
    quotas.set_shares({"other": 0.25}, num_gateways=4)
    granted = sum(quotas.acquire(policy, now_s=0.0) is None for _ in range(200))
    assert granted == 25
    alone = TenantQuotas()  # a gateway with no fleet view enforces the whole limit
    assert sum(alone.acquire(policy, now_s=0.0) is None for _ in range(200)) == 100


def test_a_rate_refusal_at_a_share_below_the_whole_hints_no_more_than_a_second() -> None:
    """At the floor share (the tenant's calls newly moved here), the bucket's wait is seconds,
    where the next sync round, 0.5 s on, sets the share again: the hint is capped, and not
    the least wait (jittered either way). A whole share's hint is its bucket's wait."""
    quotas, policy = TenantQuotas(), make_policy(requests_per_s=10.0, burst_s=0.1)
    quotas.set_shares({"search": 0.025})  # 0.25 requests/s here
    assert quotas.acquire(policy, now_s=0.0) is None  # granted into debt
    refusal = quotas.acquire(policy, now_s=0.0)
    assert refusal is not None and refusal.quota == "requests_per_s"
    assert (refusal.retry_after_s, refusal.is_least) == (MAX_SHARED_WAIT_S, False)
    whole, slow = TenantQuotas(), make_policy(requests_per_s=0.25, burst_s=4.0)
    assert whole.acquire(slow, now_s=0.0) is None
    refusal = whole.acquire(slow, now_s=0.0)
    assert refusal is not None
    assert (refusal.retry_after_s, refusal.is_least) == (pytest.approx(4.0), True)


def test_calls_in_flight_are_held_to_what_the_other_gateways_left_of_the_limit() -> None:
    """A share follows new calls: a tenant whose long calls hold its whole limit on one
    gateway, sending its new calls to another, got the whole limit again there (review
    finding). The other gateways' calls in flight now count: one call (each gateway's floor),
    then refusals."""
    quotas, policy = TenantQuotas(), make_policy(max_concurrency=10)
    quotas.set_shares({"search": 1.0}, others_in_flight={"search": 10})
    admitted = 0
    for _ in range(10):
        if quotas.acquire(policy, now_s=0.0) is None:
            quotas.enter("search")
            admitted += 1
    assert admitted == 1
    quotas.set_shares({"search": 1.0}, others_in_flight={"search": 4})
    assert sum(quotas.acquire(policy, now_s=0.0) is None for _ in range(10)) == 10
    for _ in range(5):
        quotas.enter("search")
    assert quotas.acquire(policy, now_s=0.0) is not None  # 6 here and 4 there


def test_the_row_rate_is_enforced_by_the_share_of_rows() -> None:
    """A gateway taking few calls of many rows (a batch client) has a small share of the
    tenant's calls and most of its rows: split by calls, it was refused most of its rows well
    under the limit (review finding). Rows offered are counted, refused ones too."""
    quotas, policy = TenantQuotas(), make_policy(rows_per_s=1000.0, burst_s=1.0)
    quotas.set_shares({"search": 0.05}, row_shares={"search": 0.9})
    granted = sum(quotas.take_rows(policy, 150, now_s=0.0) is None for _ in range(7))
    assert granted == 6  # 900 rows of burst
    assert quotas.take_offered_rows() == {"search": 1050}
    assert quotas.take_offered_rows() == {}


def test_fleet_shares_follow_each_gateways_demand() -> None:
    demands = {"a": {"search": 30.0, "ads": 0.0}, "b": {"search": 10.0}}
    shares = fleet_shares("a", demands, frozenset({"search", "ads", "quiet"}))
    assert shares["search"] == pytest.approx(0.75)
    assert fleet_shares("b", demands, frozenset({"search"}))["search"] == pytest.approx(0.25)
    # No demand anywhere: an equal split.
    assert shares["ads"] == shares["quiet"] == pytest.approx(0.5)


def test_a_round_without_demand_keeps_the_last_shares() -> None:
    """A tenant between bursts (or holding long calls) offers nothing for a round: each
    gateway keeps the share it had, so the one serving all its calls still takes its next
    burst whole and replaces a finished long call, where 1 / N refused most of them."""
    busy = fleet_shares("a", {"a": {"search": 40.0}, "b": {}}, frozenset({"search"}))
    assert busy["search"] == pytest.approx(1.0)
    idle = {"a": {}, "b": {}}
    assert fleet_shares("a", idle, frozenset({"search"}), busy) == busy
    # With no share of its own yet (just started), an equal split, as before.
    assert fleet_shares("a", idle, frozenset({"search"}), {}) == {"search": 0.5}

    quotas = TenantQuotas()
    policy = make_policy(requests_per_s=100.0, burst_s=1.0)
    quotas.set_shares(fleet_shares("a", idle, frozenset({"search"}), busy))
    assert sum(quotas.acquire(policy, now_s=0.0) is None for _ in range(100)) == 100


def test_a_gateway_without_demand_keeps_a_floor_so_a_first_call_is_not_refused() -> None:
    demands = {"a": {"search": 50.0}, "b": {}, "c": {}, "d": {}}
    share = fleet_shares("b", demands, frozenset({"search"}))["search"]
    assert share == pytest.approx(MIN_SHARE_OF_EQUAL / 4)
    # Shares across the fleet sum to at most 1 + MIN_SHARE_OF_EQUAL: the stated tolerance.
    total = sum(fleet_shares(g, demands, frozenset({"search"}))["search"] for g in demands)
    assert total <= 1.0 + MIN_SHARE_OF_EQUAL + 1e-9


def test_a_gateway_that_has_not_heard_from_redis_counts_itself() -> None:
    assert fleet_shares("a", {}, frozenset({"search"})) == {"search": 1.0}


def test_tenant_tables_parse_with_defaults_and_priority_grants() -> None:
    tenants = parse_tenants(
        {
            "search": {"weight": 3, "requests_per_s": 50, "priorities": ["critical"]},
            "offline": {"default_priority": "batch", "models": ["minilm"]},
        },
        "keys.toml",
    )
    search, offline = tenants["search"], tenants["offline"]
    assert search.weight == 3.0 and search.requests_per_s == 50.0 and search.is_limited
    # The default class is always granted.
    assert search.priorities == {PriorityClass.CRITICAL, PriorityClass.INTERACTIVE}
    assert search.priority_for(None) is PriorityClass.INTERACTIVE
    assert search.priority_for(PriorityClass.CRITICAL) is PriorityClass.CRITICAL
    assert offline.priority_for(None) is PriorityClass.BATCH
    assert offline.models == {"minilm"} and not offline.is_limited
    with pytest.raises(PermissionDenied, match="may not use priority 'critical'"):
        offline.priority_for(PriorityClass.CRITICAL)


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ({"weight": 0}, "weight must be positive"),
        ({"requests_per_s": "fast"}, "requests_per_s must be a number"),
        ({"max_concurrency": 1.5}, "max_concurrency must be an integer"),
        ({"priorities": ["urgent"]}, "unknown priority 'urgent'"),
        ({"rate": 5}, "unknown settings"),
    ],
)
def test_a_bad_tenant_table_is_refused_naming_the_setting(table: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_tenants({"search": table}, "keys.toml")


def test_metric_labels_are_bounded_to_configured_tenants() -> None:
    labels = TenantLabels({"search": make_policy()})
    assert labels("search") == "search"
    assert labels("someone-else") == "other"
