"""Per-tenant quotas at the gateway: request and row rates (token buckets) and calls in flight.

Limits in the tenant configuration are fleet-wide. Each gateway enforces its `share` of them:
the fraction of the tenant's recent demand that reached this gateway, computed in the
background from what every gateway reports (services.gateway.quota_sync, `fleet_shares`):
calls for the request rate and calls in flight, rows for the row rate. Calls in flight are
also held to what the other gateways left of the limit at their last report: a share follows
new calls, not the calls still running where the demand was. A gateway alone, or one that has
not heard from the others, enforces the whole limit.

Pure: time comes in as `now_s`; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.gateway.tenants import TenantPolicy

#: A gateway with no recent demand for a tenant still enforces this fraction of 1/N of its
#: limits, so a first request is not refused while the shares catch up. The fleet-wide
#: tolerance this allows: limits may be exceeded by up to this fraction, plus one refresh
#: period of a demand shift.
MIN_SHARE_OF_EQUAL = 0.1
#: The longest retry hint a rate refusal gives while this gateway enforces a share of the
#: tenant's limit below the whole: the shares are set again every sync round (0.5 s). While
#: Redis is lost, an equal share stands, and callers refused are told a second all the same.
MAX_SHARED_WAIT_S = 1.0


@dataclass(frozen=True)
class QuotaRefusal:
    """A call refused by its tenant's quota (RESOURCE_EXHAUSTED)."""

    #: The quota's setting name: requests_per_s, rows_per_s or max_concurrency.
    quota: str
    message: str
    retry_after_s: float
    #: No retry sooner than `retry_after_s` can succeed (a rate's bucket refills no sooner).
    is_least: bool = False


@dataclass
class TokenBucket:
    """`rate_per_s` tokens a second, at most `capacity` banked. A take larger than the
    capacity is granted once the bucket is full and leaves it in debt, so a big request is
    slow rather than impossible."""

    rate_per_s: float
    capacity: float
    level: float
    updated_s: float

    def refill(self, now_s: float) -> None:
        elapsed_s = max(0.0, now_s - self.updated_s)
        self.level = min(self.capacity, self.level + elapsed_s * self.rate_per_s)
        self.updated_s = now_s

    def take(self, amount: float, now_s: float) -> float:
        """Takes `amount`; returns 0.0 if granted, else the seconds until it would be."""
        self.refill(now_s)
        needed = min(amount, self.capacity)
        if self.level >= needed:
            self.level -= amount
            return 0.0
        return (needed - self.level) / self.rate_per_s

    def give_back(self, amount: float, now_s: float) -> None:
        """Returns `amount` taken for what was never served (at most up to the capacity)."""
        self.refill(now_s)
        self.level = min(self.capacity, self.level + amount)

    def resize(self, rate_per_s: float, capacity: float, now_s: float) -> None:
        """New limits take effect at once; tokens above the new capacity are dropped."""
        self.refill(now_s)
        self.rate_per_s, self.capacity = rate_per_s, capacity
        self.level = min(self.level, capacity)


def _bucket_for(
    buckets: dict[str, TokenBucket], name: str, rate_per_s: float, capacity: float, now_s: float
) -> TokenBucket:
    bucket = buckets.get(name)
    if bucket is None:
        bucket = buckets[name] = TokenBucket(rate_per_s, capacity, capacity, now_s)
    elif (bucket.rate_per_s, bucket.capacity) != (rate_per_s, capacity):
        bucket.resize(rate_per_s, capacity, now_s)
    return bucket


@dataclass
class _TenantState:
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    in_flight: int = 0


class TenantQuotas:
    """This gateway's part of every tenant's quotas."""

    def __init__(self) -> None:
        self._tenants: dict[str, _TenantState] = {}
        #: tenant -> fraction of its fleet-wide limits this gateway enforces (default below).
        self._shares: dict[str, float] = {}
        #: The share of a tenant the last round did not know (1 alone, else 1 / gateways).
        self._default_share = 1.0
        #: tenant -> fraction of its fleet-wide row rate (default: its share).
        self._row_shares: dict[str, float] = {}
        #: tenant -> calls the other gateways had in flight at their last report.
        self._others_in_flight: dict[str, int] = {}
        #: Calls and rows offered per tenant (granted or refused) since the last take.
        self._offered: Counter[str] = Counter()
        self._offered_rows: Counter[str] = Counter()

    def set_shares(
        self,
        shares: Mapping[str, float],
        row_shares: Mapping[str, float] | None = None,
        others_in_flight: Mapping[str, int] | None = None,
        *,
        num_gateways: int = 1,
    ) -> None:
        """The fleet's view, every round: each tenant's share of its limits, of its row rate
        (None: the same shares) and the calls the other gateways have in flight (None: none
        known). A tenant none of them names (newly limited by a keys reload) gets an equal
        share of `num_gateways` until a round names it: with 1, every gateway admitted its
        whole fleet-wide limit meanwhile, each bucket new and full (review finding)."""
        self._default_share = 1.0 / max(1, num_gateways)
        self._shares = dict(shares)
        self._row_shares = dict(shares if row_shares is None else row_shares)
        self._others_in_flight = dict(others_in_flight or {})

    @property
    def shares(self) -> Mapping[str, float]:
        """The shares set last (`set_shares`; empty before the first)."""
        return self._shares

    @property
    def row_shares(self) -> Mapping[str, float]:
        return self._row_shares

    def share(self, tenant: str) -> float:
        return self._shares.get(tenant, self._default_share)

    def row_share(self, tenant: str) -> float:
        return self._row_shares.get(tenant, self.share(tenant))

    def take_offered(self) -> Counter[str]:
        """Calls offered per tenant since the last take (the demand this gateway reports)."""
        offered, self._offered = self._offered, Counter()
        return offered

    def take_offered_rows(self) -> Counter[str]:
        """Rows offered per tenant with a row rate since the last take."""
        offered, self._offered_rows = self._offered_rows, Counter()
        return offered

    def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return 0 if state is None else state.in_flight

    def acquire(
        self, policy: TenantPolicy, now_s: float, *, has_place: bool = False
    ) -> QuotaRefusal | None:
        """Admits one call (room in flight, and one request token), or says which quota
        refused it. The call counts in flight from `enter` to `release`, entered in the same
        step as the check (nothing may be admitted between them, or a burst would pass the
        check together) and released once the call ends, however it ends. A call that
        `has_place` (it runs in a place in flight already held for it) takes a token only."""
        self._offered[policy.name] += 1
        if not policy.is_limited:
            return None
        state = self._tenants.setdefault(policy.name, _TenantState())
        share = self.share(policy.name)
        if policy.max_concurrency is not None and not has_place:
            left = policy.max_concurrency - self._others_in_flight.get(policy.name, 0)
            limit = max(1, min(math.ceil(policy.max_concurrency * share), left))
            if state.in_flight >= limit:
                return QuotaRefusal(
                    "max_concurrency",
                    f"tenant {policy.name!r} is at its limit of {policy.max_concurrency} calls "
                    f"in flight (max_concurrency)",
                    retry_after_s=0.05,
                )
        return self._take(state, policy, "requests_per_s", 1, now_s)

    def enter(self, tenant: str) -> None:
        self._tenants.setdefault(tenant, _TenantState()).in_flight += 1

    def release(self, tenant: str) -> None:
        state = self._tenants.get(tenant)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def take_rows(self, policy: TenantPolicy, num_rows: int, now_s: float) -> QuotaRefusal | None:
        """Charges a call's input rows to the tenant's row rate."""
        if policy.rows_per_s is None:
            return None
        self._offered_rows[policy.name] += num_rows
        state = self._tenants.setdefault(policy.name, _TenantState())
        return self._take(state, policy, "rows_per_s", num_rows, now_s)

    def give_back_rows(self, tenant: str, rows: int, now_s: float) -> None:
        """The `rows` of a call refused for load, never served, return. Its request token does
        not: every call made counts, so a flood is still refused before its body is read."""
        state = self._tenants.get(tenant)
        bucket = None if state is None else state.buckets.get("rows_per_s")
        if bucket is not None:
            bucket.give_back(rows, now_s)

    def _take(
        self, state: _TenantState, policy: TenantPolicy, quota: str, amount: int, now_s: float
    ) -> QuotaRefusal | None:
        fleet_rate = getattr(policy, quota)
        if fleet_rate is None:
            return None
        share = self.row_share(policy.name) if quota == "rows_per_s" else self.share(policy.name)
        rate = fleet_rate * share
        bucket = _bucket_for(state.buckets, quota, rate, rate * policy.burst_s, now_s)
        wait_s = bucket.take(amount, now_s)
        if wait_s == 0.0:
            return None
        # A share below the whole is set again at the next sync round: a wait counted at a
        # floor share (the tenant's calls newly moved here) may be seconds, over in one round.
        is_least = share >= 1.0 or wait_s <= MAX_SHARED_WAIT_S
        unit = "requests" if quota == "requests_per_s" else "rows"
        return QuotaRefusal(
            quota,
            f"tenant {policy.name!r} is over its quota of {fleet_rate:g} {unit}/s ({quota})",
            retry_after_s=wait_s if is_least else MAX_SHARED_WAIT_S,
            is_least=is_least,
        )


def fleet_shares(
    local_id: str,
    demands: Mapping[str, Mapping[str, float]],
    tenants: frozenset[str],
    previous: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Each tenant's share for gateway `local_id`, from every live gateway's recent demand
    (gateway id -> tenant -> calls/s, or rows/s for the row rate's shares; the local
    gateway's own entry included). A tenant's
    share is its local demand over its fleet demand, at least MIN_SHARE_OF_EQUAL / N. With no
    demand anywhere, it keeps its `previous` share (this gateway's last), else 1 / N: a round
    without new calls (a tenant between bursts, or holding long calls) says nothing about
    where its calls go. Reset to 1 / N, a gateway serving all of a tenant's calls refused most
    of its next burst (its bucket clipped to the share) and the replacement of a finished long
    call under max_concurrency, until the next round."""
    num_gateways = max(1, len(demands) if local_id in demands else len(demands) + 1)
    floor = MIN_SHARE_OF_EQUAL / num_gateways
    local = demands.get(local_id, {})
    kept = previous or {}
    shares = {}
    for tenant in tenants:
        total = sum(d.get(tenant, 0.0) for d in demands.values())
        if total <= 0.0:
            shares[tenant] = kept.get(tenant, 1.0 / num_gateways)
        else:
            shares[tenant] = max(floor, local.get(tenant, 0.0) / total)
    return shares
