"""Fleet-wide tenant quotas: every gateway's recent demand, shared through Redis.

Every `period_s` each gateway writes, in one pipelined round trip, its calls per second per
tenant since the last write into one Redis hash (field: its id), and reads the whole hash
back. From it, `quotas.fleet_shares` gives the fraction of each tenant's limits this gateway
enforces until the next round. Nothing on the request path touches Redis.

A gateway's entry carries a sequence number; one whose number has not moved for
`stale_after_periods` rounds belongs to a gateway that is gone and is ignored (a gateway that
stops cleanly deletes its own; one that was killed has its entry deleted by the others after
`forget_after_periods` rounds), so clock skew between gateways does not matter. An entry a
gateway sees for the first time counts for two rounds, and from then on only while its number
moves. While rounds
fail (Redis unreachable, its credentials unreadable, a bug) the last shares stay in force for
`stale_after_periods` rounds; then, the
demand they followed being as stale as a gone gateway's, each tenant gets an equal share of
the gateways last seen (a tenant whose calls moved to a gateway that held it at the floor
would be refused nearly all of its quota for the whole outage). A gateway that never reached
Redis enforces whole limits, as if alone.

Tolerance: a tenant may exceed a fleet-wide limit by about MIN_SHARE_OF_EQUAL (10%), plus
what a shift of its demand between gateways admits during one period; `max_concurrency`,
counted in whole calls, by up to one call per gateway process (each admits at least one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from redis.exceptions import RedisError

from services.common.errors import MALFORMED_RECORD_ERRORS
from services.common.lifecycle import cancel_and_wait, sleep_unless_stopped, stop_if_cancelled
from services.common.redis_acl import GATEWAY, role_credentials
from services.common.registry_schema import connect
from services.gateway.admission import TenantAdmission
from services.gateway.quotas import fleet_shares
from services.gateway.tenants import TenantPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuotaSyncConfig:
    #: Redis shared by the gateways ("" keeps quotas per gateway: each enforces whole limits).
    redis_url: str = ""
    #: File with the password of Redis user `gateway` (or the URL's user).
    redis_password_file: Path | None = None
    #: Key prefix, shared with the registry's (`<prefix>:quota:demand`).
    key_prefix: str = "fabric"
    #: How often demand is published and shares recomputed, seconds.
    period_s: float = 0.5
    #: Rounds without a new sequence number after which a gateway's entry is stale.
    stale_after_periods: int = 4
    #: ... and after which any gateway deletes it: its gateway died without deleting it
    #: (killed), and each start is a new id, so such entries would pile up.
    forget_after_periods: int = 40

    def __post_init__(self) -> None:
        periods = (self.period_s, self.stale_after_periods, self.forget_after_periods)
        if not all(period > 0 for period in periods):
            # A period of 0: demand divided by it, every round's error logged in a tight loop.
            raise ValueError("quota sync: period_s and its counts of periods must be > 0")

    @property
    def demand_key(self) -> str:
        return f"{self.key_prefix}:quota:demand"


class QuotaSync:
    def __init__(
        self,
        config: QuotaSyncConfig,
        admission: TenantAdmission,
        tenants: Mapping[str, TenantPolicy],
    ) -> None:
        self.config = config
        #: Replaced when the keys file is reloaded.
        self.tenants = dict(tenants)
        self.gateway_id = uuid.uuid4().hex[:12]
        self._admission = admission
        credentials = role_credentials(GATEWAY, config.redis_url, config.redis_password_file)
        self._client = connect(config.redis_url, credentials=credentials)
        self._sequence = 0
        # gateway id -> (last sequence number seen, rounds since it last changed)
        self._seen: dict[str, tuple[int, int]] = {}
        #: Entries to delete in the next round (`forget_after_periods`).
        self._forgotten: list[str] = []
        self._task: asyncio.Task[None] | None = None
        #: Rounds failed in a row, and the gateways the last good round saw (itself included).
        self._failures = 0
        self._num_gateways = 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="quota-sync")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, "the quota sync")  # before its entry goes
        # Failing that (Redis, or its credentials), the entry goes stale and the others
        # ignore it; the gateway's stop goes on.
        try:
            await self._client.hdel(self.config.demand_key, self.gateway_id)
        except Exception as error:
            stop_if_cancelled()
            log.warning("quota sync entry not removed: %r", error)
        await self._client.aclose()

    async def _run(self) -> None:
        while True:
            await self.run_round()
            await sleep_unless_stopped(self.config.period_s)

    async def run_round(self) -> None:
        """One round, whose failure (Redis, its credentials, a bug) is logged and counted (see
        the module docstring)."""
        try:
            await self.sync_once()
        except Exception as error:  # Redis, its credentials (a password file being rotated
            stop_if_cancelled()  # raises ValueError), or a bug: every one a failed round
            self._failures += 1
            if self._failures < self.config.stale_after_periods:
                # A failure that is not Redis's (its credentials, a bug) with its traceback.
                is_redis = isinstance(error, (RedisError, OSError))
                log.warning(
                    "quota sync failed, last shares stay in force: %r", error, exc_info=not is_redis
                )
            elif self._failures == self.config.stale_after_periods:
                log.warning(
                    "quota sync failing (%s): each tenant's share is 1/%d until it succeeds",
                    error,
                    self._num_gateways,
                )
                self._apply(dict.fromkeys(self._limited(), 1.0 / self._num_gateways))
            return
        self._failures = 0

    async def sync_once(self) -> dict[str, float]:
        """One round: publish local demand, read everyone's, apply the new shares."""
        offered = self._admission.quotas.take_offered()
        limited = self._limited()
        # Calls per round, as a rate of the nominal period: every gateway's figure has the
        # same scale, whatever its round took.
        demand = {t: n / self.config.period_s for t, n in offered.items() if t in limited}
        self._sequence += 1
        entry = json.dumps({"seq": self._sequence, "demand": demand})
        async with self._client.pipeline(transaction=False) as pipe:
            if self._forgotten:
                pipe.hdel(self.config.demand_key, *self._forgotten)
            pipe.hset(self.config.demand_key, self.gateway_id, entry)
            pipe.hgetall(self.config.demand_key)
            *_, raw = await pipe.execute()
        demands = self._live_demands(raw)
        self._num_gateways = max(1, len(demands))
        shares = fleet_shares(self.gateway_id, demands, limited, self._admission.quotas.shares)
        self._apply(shares)
        return shares

    def _limited(self) -> frozenset[str]:
        """The tenants with a limit: the ones shares are computed for."""
        return frozenset(name for name, policy in self.tenants.items() if policy.is_limited)

    def _apply(self, shares: dict[str, float]) -> None:
        self._admission.quotas.set_shares(shares)
        for tenant, share in shares.items():
            self._admission.set_share_gauge(tenant, share)

    def _live_demands(self, raw: Mapping[bytes, bytes]) -> dict[str, dict[str, float]]:
        demands: dict[str, dict[str, float]] = {}
        seen: dict[str, tuple[int, int]] = {}
        forgotten: list[str] = []
        stale, forget = self.config.stale_after_periods, self.config.forget_after_periods
        for field, value in raw.items():
            try:
                gateway_id = field.decode()
                parsed = json.loads(value)
                sequence = int(parsed["seq"])
                demand = {str(t): float(d) for t, d in dict(parsed["demand"]).items()}
            except MALFORMED_RECORD_ERRORS:
                continue  # not ours to interpret (another version's, say); never fatal
            previous = self._seen.get(gateway_id)
            if previous is None:
                # First seen (this gateway has just started): live for two rounds, and then
                # only while its number moves, so a gone gateway's entry counts for two rounds,
                # not `stale`; two, not one: a live gateway's round may fall just after ours.
                rounds = max(0, stale - 2)
            else:
                rounds = 0 if previous[0] != sequence else previous[1] + 1
            seen[gateway_id] = (sequence, rounds)
            if rounds < stale or gateway_id == self.gateway_id:
                demands[gateway_id] = demand
            elif rounds >= forget:
                forgotten.append(gateway_id)
        self._seen, self._forgotten = seen, forgotten
        return demands
