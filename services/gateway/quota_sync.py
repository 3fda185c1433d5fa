"""Fleet-wide tenant quotas: every gateway's recent demand, shared through Redis.

Every `period_s` each gateway writes, in one pipelined round trip, its calls and rows per
second per tenant since the last write (over the time the round really took: a gateway whose
loop lags under load reported its calls of 1.5 s as half a second's, and took three times its
share from the others), and the calls it has in flight, into one Redis hash (field: its id),
and reads the whole hash back. From it, `quotas.fleet_shares` gives the fraction of each
tenant's limits this gateway enforces until the next round: by calls for the request rate and
calls in flight, by rows for the row rate (split by calls, a tenant sending big batches to
one gateway and single rows to another was refused most of its rows there, well under its
limit); and calls in flight are held to what the other gateways left of the limit (a share
follows new calls, so a tenant could hold its whole limit of long calls on one gateway, move
its new calls to another, and hold the limit again there). Nothing on the request path
touches Redis.

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
While k of N gateways cannot reach Redis, by up to k/N more: the others count them gone, and
each of them enforces its equal share (fail open: an outage refuses no tenant within quota).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from redis.exceptions import RedisError

from services.common.errors import MALFORMED_RECORD_ERRORS
from services.common.lifecycle import cancel_and_wait, sleep_unless_stopped, stop_if_cancelled
from services.common.redis_acl import GATEWAY, role_credentials
from services.common.registry_schema import connect
from services.gateway.admission import TenantAdmission
from services.gateway.quotas import fleet_shares
from services.gateway.tenants import TenantPolicy

log = logging.getLogger(__name__)

N = TypeVar("N", int, float)


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
        #: When demand was last taken (time.monotonic), for the rates of the next round.
        self._taken_s = time.monotonic()

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
        quotas = self._admission.quotas
        now_s = time.monotonic()
        # Rates over the time since the last take, a round's period at least (back to back,
        # as in tests, a round of a few milliseconds would make a burst's calls a huge rate).
        elapsed_s = max(self.config.period_s, now_s - self._taken_s)
        self._taken_s = now_s
        limited = self._limited()

        def rates(offered: Mapping[str, int]) -> dict[str, float]:
            return {t: n / elapsed_s for t, n in offered.items() if t in limited}

        calls, rows = rates(quotas.take_offered()), rates(quotas.take_offered_rows())
        running = {t: n for t in limited if (n := quotas.in_flight(t))}
        self._sequence += 1
        entry = json.dumps(
            {"seq": self._sequence, "demand": calls, "rows": rows, "in_flight": running}
        )
        async with self._client.pipeline(transaction=False) as pipe:
            if self._forgotten:
                pipe.hdel(self.config.demand_key, *self._forgotten)
            pipe.hset(self.config.demand_key, self.gateway_id, entry)
            pipe.hgetall(self.config.demand_key)
            *_, raw = await pipe.execute()
        reports = self._live_reports(raw)
        self._num_gateways = max(1, len(reports))
        local = self.gateway_id
        calls_of = {g: r.calls for g, r in reports.items()}
        shares = fleet_shares(local, calls_of, limited, quotas.shares)
        row_shares = fleet_shares(
            local, {g: r.rows for g, r in reports.items()}, limited, quotas.row_shares
        )
        others: Counter[str] = Counter()
        for gateway_id, report in reports.items():
            if gateway_id != local:
                others.update(report.in_flight)
        self._apply(shares, row_shares, others)
        return shares

    def _limited(self) -> frozenset[str]:
        """The tenants with a limit: the ones shares are computed for."""
        return frozenset(name for name, policy in self.tenants.items() if policy.is_limited)

    def _apply(
        self,
        shares: dict[str, float],
        row_shares: Mapping[str, float] | None = None,
        others_in_flight: Mapping[str, int] | None = None,
    ) -> None:
        quotas = self._admission.quotas
        quotas.set_shares(shares, row_shares, others_in_flight, num_gateways=self._num_gateways)
        for tenant, share in shares.items():
            self._admission.set_share_gauge(tenant, share)

    def _live_reports(self, raw: Mapping[bytes, bytes]) -> dict[str, _Report]:
        demands: dict[str, _Report] = {}
        seen: dict[str, tuple[int, int]] = {}
        forgotten: list[str] = []
        stale, forget = self.config.stale_after_periods, self.config.forget_after_periods
        for field, value in raw.items():
            try:
                gateway_id = field.decode()
                parsed = json.loads(value)
                sequence = int(parsed["seq"])
                demand = _Report(
                    _numbers(parsed["demand"], float),
                    # Absent from the entries of gateways older than row shares: no rows.
                    _numbers(parsed.get("rows", {}), float),
                    _numbers(parsed.get("in_flight", {}), int),
                )
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


@dataclass(frozen=True)
class _Report:
    """A gateway's entry: per tenant, calls/s and rows/s offered, and calls in flight."""

    calls: dict[str, float]
    rows: dict[str, float]
    in_flight: dict[str, int]


def _numbers(raw: Any, kind: Callable[[Any], N]) -> dict[str, N]:
    """tenant -> number of an entry's field (raises what MALFORMED_RECORD_ERRORS holds): a
    count or rate, so finite and not negative. A peer's -5 against a local 10 made this
    gateway's share 2.0, twice the whole limit, and a NaN sent every gateway to the floor
    (review finding)."""
    numbers = {str(tenant): kind(value) for tenant, value in dict(raw).items()}
    if not all(0 <= number < math.inf for number in numbers.values()):  # NaN fails too
        raise ValueError("a count or rate that is negative or not finite")
    return numbers
