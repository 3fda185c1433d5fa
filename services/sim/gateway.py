"""The simulated gateways' tenant admission: the real quota code, in the real order.

A gateway checks a call against its tenant's table (services.gateway.tenants) as the real one
does: the request rate and calls in flight in the authentication stage (`TenantQuotas.acquire`),
then the priority class and the model (`admit`), then the adaptive throttle (the simulation's),
and only then the row rate (`take_rows`, one row per simulated request: a call the throttle
refuses spends none, predictor.py). A call refused downstream for load, unrun, gives its row
back (`give_back_rows`, admission.never_served). A granted call counts in flight until its
answer or refusal (`release`). Each gateway has its own `TenantQuotas` and enforces its
share of every fleet-wide limit; every `sync_period_s` the shares are recomputed from each
gateway's demand with `quotas.fleet_shares`, as `quota_sync.QuotaSync.sync_once` does through
Redis (no gateway is ever gone here, so no entry goes stale).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.common.priority import PriorityClass
from services.gateway.quotas import TenantQuotas, fleet_shares
from services.gateway.tenants import TenantPolicy
from services.sim.traffic import Arrival

#: 2**64 / the golden ratio: multiplying by it spreads every bit of a hash over the high bits.
_GOLDEN_64 = 0x9E3779B97F4A7C15


def gateway_index(at_s: float, num_gateways: int) -> int:
    """Which of `num_gateways` takes the call arriving at `at_s`: spread evenly as a load
    balancer would, the same for the same time in every run. `hash(at_s) % n` sent every call
    of a second to one gateway for any n a power of two (a float's hash is its whole part
    plus its fraction's bits shifted high)."""
    mixed = (hash(at_s) * _GOLDEN_64) & 0xFFFF_FFFF_FFFF_FFFF
    return (mixed * num_gateways) >> 64


@dataclass(frozen=True)
class QuotaRefused:
    """A call refused by its tenant's table at the gateway."""

    #: requests_per_s, rows_per_s or max_concurrency (RESOURCE_EXHAUSTED), priority (a class
    #: not granted) or models (a model not allowed; both PERMISSION_DENIED).
    reason: str


class GatewayAdmission:
    """Every simulated gateway's tenant quotas."""

    def __init__(
        self, tenants: Mapping[str, TenantPolicy], num_gateways: int, *, sync_period_s: float
    ) -> None:
        self._tenants = dict(tenants)
        self._quotas = [TenantQuotas() for _ in range(num_gateways)]
        self._limited = frozenset(name for name, p in self._tenants.items() if p.is_limited)
        self.sync_period_s = sync_period_s

    @property
    def needs_sync(self) -> bool:
        """Whether shares matter: a limited tenant, several gateways, and a sync period."""
        return bool(self._limited) and len(self._quotas) > 1 and self.sync_period_s > 0

    def admit(self, gateway: int, arrival: Arrival, now_s: float) -> QuotaRefused | None:
        """Runs the gateway's checks on one call; a granted call is in flight until
        `release`. A tenant without a table is unlimited and may use every model."""
        policy = self._tenants.get(arrival.tenant)
        if policy is None:
            return None
        quotas = self._quotas[gateway]
        refusal = quotas.acquire(policy, now_s)
        if refusal is not None:
            return QuotaRefused(refusal.quota)
        quotas.enter(policy.name)
        if not policy.is_granted(PriorityClass.parse(arrival.priority)):
            reason = "priority"
        elif policy.models is not None and arrival.model not in policy.models:
            reason = "models"
        else:
            return None
        quotas.release(policy.name)
        return QuotaRefused(reason)

    def take_rows(self, gateway: int, arrival: Arrival, now_s: float) -> QuotaRefused | None:
        """Charges an admitted call's row to its tenant's row rate, after the gateway's
        throttle (a call it refuses spends none, as in the predictor); a refused call is no
        longer in flight."""
        policy = self._tenants.get(arrival.tenant)
        if policy is None:
            return None
        quotas = self._quotas[gateway]
        refusal = quotas.take_rows(policy, 1, now_s)
        if refusal is None:
            return None
        quotas.release(policy.name)
        return QuotaRefused(refusal.quota)

    def give_back_rows(self, gateway: int, arrival: Arrival, now_s: float) -> None:
        """The row of a call never served (refused downstream for load, unrun) returns to its
        tenant's row rate (admission.never_served)."""
        if arrival.tenant in self._tenants:
            self._quotas[gateway].give_back_rows(arrival.tenant, 1, now_s)

    def release(self, gateway: int, tenant: str) -> None:
        """The call admitted at `gateway` was answered or refused downstream."""
        if tenant in self._tenants:
            self._quotas[gateway].release(tenant)

    def in_flight(self, gateway: int, tenant: str) -> int:
        return self._quotas[gateway].in_flight(tenant)

    def sync(self, now_s: float, _: object = None) -> None:
        """One round of every gateway's quota sync: publish demand, apply the new shares."""
        period_s = self.sync_period_s
        demands = {
            str(index): {
                tenant: count / period_s
                for tenant, count in quotas.take_offered().items()
                if tenant in self._limited
            }
            for index, quotas in enumerate(self._quotas)
        }
        for index, quotas in enumerate(self._quotas):
            quotas.set_shares(fleet_shares(str(index), demands, self._limited, quotas.shares))
