"""The router's side of the registry: keeps the route table's registry snapshot fresh, one
pipelined Redis read per period.

When Redis is unreachable the last good snapshot stays in force (the route table bounds how
long), health reports the registry degraded, and reads retry with capped backoff. Should it come
back empty (restarted), that snapshot stays frozen until the first worker has re-registered, and
its workers stay in it for REFILL_S more while the others re-register; or, should none have
re-registered after REFILL_S of empty reads, the empty registry is taken. A Redis that lost the
registry with no read failing (restarted between two reads, flushed, failed over to an empty
replica) is told by the registry's epoch changing (RegistryKeys.epoch), and refilled alike.

Records whose address is outside the allowed worker networks (services.router.worker_networks)
never reach the route table: each such read counts them, and each is logged once while it stays.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.backoff import doubled_s
from services.common.errors import MALFORMED_RECORD_ERRORS
from services.common.lifecycle import sleep_unless_stopped, stop_if_cancelled
from services.common.registry_schema import (
    ACL_BEHIND,
    INTERNAL_API,
    RegistryKeys,
    WorkerRecord,
)
from services.common.sparse_log import SparseLog
from services.router.metrics import RouterMetrics
from services.router.routing import RouteTable
from services.router.worker_networks import WorkerNetworks, admit_records

log = logging.getLogger(__name__)
#: A lasting fault of a refresh (every period): at most once a period per error.
_sparse = SparseLog(log)
#: A Redis ACL older than this release: said hourly while it lasts.
_hourly = SparseLog(log, period_s=3600.0)

#: Longest pause between reads while Redis is unreachable.
_MAX_BACKOFF_S = 5.0
#: Once Redis is back after an outage, how long the workers of the snapshot held through it
#: stay routable without having re-registered: their heartbeats' retry backoff (5 s at most)
#: spreads their return over seconds, and the first to return must not stand for the fleet.
#: The reads cannot tell a worker that left meanwhile (deregistered, or its record expired)
#: from one not back yet: after an outage that cut the workers off too, every record has
#: expired while every worker is still registered, and holding only those with a record let
#: the first worker back stand for the fleet (diff review). So it stays: its calls fail
#: UNAVAILABLE, which ejects it and sends them to another worker.
REFILL_S = 10.0
#: How long a model version no live worker serves keeps its series (a rollout's old version,
#: or one every worker of dropped for a while), seconds.
FORGET_VERSION_S = 600.0


class RegistrySync:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: RegistryKeys,
        table: RouteTable,
        metrics: RouterMetrics,
        *,
        period_s: float,
        on_degraded_change: Callable[[bool], Awaitable[None]],
        worker_networks: WorkerNetworks,
        on_refresh: Callable[[AbstractSet[str], float], Awaitable[None]] | None = None,
    ) -> None:
        """`on_refresh(addresses, now_s)` runs after each read that replaced the snapshot,
        with the addresses of its live workers (the router closes links to workers gone)."""
        self._client = client
        self._keys = keys
        self._table = table
        self._metrics = metrics
        self._period_s = period_s
        self._on_degraded_change = on_degraded_change
        self._on_refresh = on_refresh
        self._worker_networks = worker_networks
        #: (worker_id, address) of the records the last read rejected: logged once each.
        self._rejected: set[tuple[str, str]] = set()
        #: A read failed and no read has found a worker since (see `refresh_once`).
        self._awaits_refill = False
        #: The workers held through an outage that have not re-registered since, by id, each
        #: with when its hold ends (REFILL_S after the read that began it).
        self._held: dict[str, tuple[WorkerRecord, float]] = {}
        #: When the reads after an outage began to find Redis empty; None otherwise.
        self._empty_since_s: float | None = None
        #: The registry's epoch at the last read (RegistryKeys.epoch).
        self._epoch: str | None = None
        self._heartbeats = HeartbeatClock()
        #: When each (model, version) was last served by a live worker (forgotten past
        #: FORGET_VERSION_S, its metrics with it).
        self._served_at_s: dict[tuple[str, str], float] = {}
        self.is_degraded = True  # until the first good read
        metrics.registry_degraded.set(1)

    async def refresh_once(self) -> None:
        """Reads the registry and replaces the snapshot. Raises on Redis errors."""
        read = await read_fleet(self._client, self._keys, self._worker_networks)
        records, redis_now_s = read.records, read.now_s
        now_s = time.monotonic()
        if read.epoch != self._epoch:
            if self._epoch is not None and self._table.has_snapshot and not self._awaits_refill:
                # Redis lost the registry though no read failed (restarted between two reads,
                # their client reconnecting; flushed; failed over to an empty replica): as
                # after an outage, the snapshot's workers stay while they re-register. Taken
                # as it came, the first worker back stood for the fleet (review finding).
                log.warning("registry: Redis lost the registry (its epoch changed); refilling")
                self._awaits_refill, self._empty_since_s = True, None
            self._epoch = read.epoch
        if not records and self._awaits_refill and self._table.has_snapshot:
            # Redis is back, empty (restarted): workers re-register at their next heartbeat,
            # which their retry backoff may hold back for seconds. An update now would judge
            # every heartbeat of the outage's snapshot stale and refuse every call; so that
            # snapshot stays frozen, as during the outage, until a worker is back. (A router
            # that started during the outage has none to keep: it takes the empty registry,
            # as its readiness already says it has read it.) Not past REFILL_S of empty reads:
            # none back by then, the fleet is gone (its node lost with Redis), not slow, and
            # its dead workers were routed to for up to max_snapshot_age_s.
            if self._empty_since_s is None:
                self._empty_since_s = now_s
            if now_s - self._empty_since_s < REFILL_S:
                return
            log.warning("registry: no worker re-registered %gs after Redis came back", REFILL_S)
            self._awaits_refill = False  # the empty registry is the fleet: none held
        self._empty_since_s = None
        if self._awaits_refill and self._table.has_snapshot:
            # A worker still held through an earlier outage keeps that hold's end: restarted at
            # every outage, a Redis failing every few seconds would hold a worker gone before
            # the first one for good.
            until_s, held = now_s + REFILL_S, self._held
            self._held = {
                w.worker_id: (w, held[w.worker_id][1] if w.worker_id in held else until_s)
                for w in self._table.live_workers(now_s)
            }
        self._awaits_refill = False
        split = admit_records(records, self._worker_networks)
        self._note_rejected(split.rejected)
        admitted = self._heartbeats.on_our_clock(split.admitted, redis_now_s, now_s)
        gone = self._table.update([*admitted, *self._not_back_yet(admitted, now_s)], now_s)
        if gone:
            self._metrics.forget_workers(gone)
            _warned_older.difference_update(gone)
        live = self._table.live_workers(now_s)
        self._metrics.live_workers.set(len(live))
        self._forget_unserved(live, now_s)
        if self._on_refresh is not None:
            try:  # its failure is not the registry's: it must not read as an outage
                await self._on_refresh({worker.address for worker in live}, now_s)
            except Exception as error:
                stop_if_cancelled()
                _sparse.exception(repr(error), "registry: after-refresh hook failed")

    def _not_back_yet(
        self, admitted: list[tuple[WorkerRecord, float]], now_s: float
    ) -> list[tuple[WorkerRecord, float]]:
        """The workers held through an outage that have not re-registered since, alive as of
        now, for REFILL_S after Redis came back (a restarted Redis is refilled by each worker's
        next heartbeat): until each is back, its models stay served."""
        if not self._held:
            return []
        back = {record.worker_id for record, _ in admitted}
        self._held = {
            worker_id: (record, until_s)
            for worker_id, (record, until_s) in self._held.items()
            if worker_id not in back and now_s < until_s
        }
        return [(record, now_s) for record, _ in self._held.values()]

    def _forget_unserved(self, live: tuple[WorkerRecord, ...], now_s: float) -> None:
        served = self._served_at_s
        served.update(((m.name, m.version), now_s) for worker in live for m in worker.models)
        # A version no worker serves whose series came back (calls still asking for it,
        # refused) is forgotten FORGET_VERSION_S after they did, again (diff review).
        for key in self._metrics.versions() - served.keys():
            served[key] = now_s
        gone = [key for key, at_s in served.items() if now_s - at_s > FORGET_VERSION_S]
        for key in gone:
            del served[key]
        self._metrics.forget_versions(gone)

    def _note_rejected(self, rejected: list[WorkerRecord]) -> None:
        self._metrics.rejected_worker_records_total.inc(len(rejected))
        now_rejected = {(r.worker_id, r.address) for r in rejected}
        for worker_id, address in sorted(now_rejected - self._rejected):
            log.warning(
                "registry: ignoring worker %r at %r: address outside --worker-networks (%s)",
                worker_id,
                address,
                self._worker_networks,
            )
        self._rejected = now_rejected

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                await self.refresh_once()
                failures = 0
                await self._set_degraded(False)
            except (RedisError, OSError) as error:
                stop_if_cancelled()
                if failures == 0:
                    log.warning(
                        "registry: Redis unreachable (%s); routing from last snapshot", error
                    )
                failures += 1
                self._awaits_refill = True
                self._empty_since_s = None  # REFILL_S of empty reads counts from Redis's return
                await self._set_degraded(True)
            except Exception as error:  # our bug, or a record past the parser: the next round
                stop_if_cancelled()  # may do better, and a stopped refresh would freeze routing
                _sparse.exception(
                    repr(error), "registry: refresh failed; routing from last snapshot"
                )
            age_s = self._table.snapshot_age_s(time.monotonic())
            self._metrics.registry_snapshot_age_seconds.set(age_s or 0.0)
            await sleep_unless_stopped(doubled_s(self._period_s, failures - 1, _MAX_BACKOFF_S))

    async def _set_degraded(self, is_degraded: bool) -> None:
        if is_degraded != self.is_degraded:
            self.is_degraded = is_degraded
            self._metrics.registry_degraded.set(1 if is_degraded else 0)
            if not is_degraded:
                log.info("registry: Redis reachable again")
            await self._on_degraded_change(is_degraded)


class HeartbeatClock:
    """Each heartbeat's time on the router's clock (time.monotonic). A heartbeat is scored by
    Redis's clock when it was written; the age it has at the first read that sees it converts
    it, so clocks never have to agree, clamped at 0 (a score ahead of Redis's `now` was written
    before Redis's clock stepped back). A score read again keeps the time of its first read, so
    it ages on the router's clock whatever Redis's clock does since: a dead worker's last
    heartbeat goes stale `stale_after_s` after the router first read it. Converted afresh at
    every read, a clock stepped back by D kept a dead worker routable D longer (registry
    review), and one stepped forward aged every heartbeat by D until its worker's next."""

    def __init__(self) -> None:
        #: By worker id: its last heartbeat's score (Redis's seconds) and our time for it.
        self._seen: dict[str, tuple[float, float]] = {}

    def on_our_clock(
        self, records: list[tuple[WorkerRecord, float]], redis_now_s: float, now_s: float
    ) -> list[tuple[WorkerRecord, float]]:
        """`records` with their heartbeat scores, read at Redis's `redis_now_s` and our
        `now_s`: each with its heartbeat's time on our clock. Forgets workers not in them."""
        seen, timed = self._seen, []
        self._seen = {}
        for record, score_s in records:
            known = seen.get(record.worker_id)
            if known is not None and known[0] == score_s:
                at_s = known[1]
            else:
                at_s = now_s - max(0.0, redis_now_s - score_s)
            self._seen[record.worker_id] = (score_s, at_s)
            timed.append((record, at_s))
        return timed


class RegistryRead(NamedTuple):
    """One read of the registry."""

    #: Every registered worker with its heartbeat time, seconds; those of an older internal API
    #: cut from what current ones serve (`_current_api_first`, counting only current workers
    #: whose address the read's networks admit, when given).
    records: list[tuple[WorkerRecord, float]]
    #: Redis's `now`, seconds.
    now_s: float
    #: The registry's epoch (RegistryKeys.epoch); None: none written (empty, or older workers).
    epoch: str | None


async def read_fleet(
    client: aioredis.Redis, keys: RegistryKeys, networks: WorkerNetworks | None = None
) -> RegistryRead:
    """Every registered worker's record with its heartbeat time, Redis's `now`, and the
    registry's epoch.

    Two round trips (ids+scores+time, then records), once per refresh period: never per request.
    """
    async with client.pipeline(transaction=False) as pipe:
        pipe.zrange(keys.workers, 0, -1, withscores=True)
        pipe.time()
        pipe.get(keys.epoch)
        members, clock, raw_epoch = await pipe.execute(raise_on_error=False)
    for result in (members, clock):
        if isinstance(result, Exception):
            raise result
    # A Redis on an older ACL (not reloaded since an upgrade) refuses the epoch (NOPERM): read
    # as none; raised, it failed every read, the registry taken for unreachable (diff review).
    if isinstance(raw_epoch, Exception):
        _hourly.warning(ACL_BEHIND, f"registry: {ACL_BEHIND}: {raw_epoch}")
    epoch = raw_epoch.decode(errors="replace") if isinstance(raw_epoch, bytes) else raw_epoch
    epoch = epoch if isinstance(epoch, str) else None
    now_s = clock[0] + clock[1] / 1e6
    if not members:
        return RegistryRead([], now_s, epoch)
    # A member that is not UTF-8 (anyone holding the worker credential can write one) reads
    # as its replacement, whose record key holds nothing: decoded strictly, it failed every
    # router's refresh, for good (review finding).
    ids = [m.decode(errors="replace") if isinstance(m, bytes) else m for m, _ in members]
    raw_records = await client.mget([keys.worker(i) for i in ids])
    records, malformed = [], {}
    for worker_id, (_, score_ms), raw in zip(ids, members, raw_records, strict=True):
        if raw is None:
            continue  # record key expired: the worker stopped long ago
        try:
            record = WorkerRecord.from_json(raw)
            if record.worker_id != worker_id:  # forged, or copied: one id twice in the table
                raise ValueError(f"its worker_id is {record.worker_id!r}")
            records.append((record, score_ms / 1000.0))
        except MALFORMED_RECORD_ERRORS as error:
            malformed[worker_id] = str(error)
            if _warned_malformed.get(worker_id) != malformed[worker_id]:  # once while it lasts
                log.warning("skipping malformed registry record of %s: %s", worker_id, error)
    _warned_malformed.clear()  # a record that reads again, or whose worker left, is forgotten
    _warned_malformed.update(malformed)
    _warned_older.intersection_update(ids)  # older workers gone (never in the table: kept)
    return RegistryRead(_current_api_first(records, networks), now_s, epoch)


def _current_api_first(
    records: list[tuple[WorkerRecord, float]], networks: WorkerNetworks | None = None
) -> list[tuple[WorkerRecord, float]]:
    """The records with each model version served by workers of this build's internal API
    once any of them serves it: a worker of an older API refuses every bundle (INVALID_
    ARGUMENT), so while both serve a version, the older one is left out of it (warned about
    once per worker) and sits idle instead of failing calls. A version no current worker
    serves (routers and some workers upgraded before the rest) keeps its older workers:
    older gateways' calls, which they serve, keep being served (the cut was fleet-wide, and
    a model only older workers served got no worker at all: review finding). Only a current
    worker that serves the version now counts: not one draining, nor a version it is still
    loading (older workers were cut for the length of an upgraded worker's drain), nor one
    whose address the router will not route to (a forged record cut every older worker)."""
    current = {(m.name, m.version) for r, _ in records
               if r.internal_api >= INTERNAL_API and not r.is_draining
               and (networks is None or networks.admits(r.address))
               for m in r.models if m.is_ready}  # fmt: skip
    if not current:
        return records
    kept = []
    for record, at_s in records:
        if record.internal_api >= INTERNAL_API:
            kept.append((record, at_s))
            continue
        models = tuple(m for m in record.models if (m.name, m.version) not in current)
        if len(models) < len(record.models) and record.worker_id not in _warned_older:
            _warned_older.add(record.worker_id)
            log.warning(
                "worker %s serves internal API %d, this router %d: not routed to for the "
                "model versions upgraded workers serve",
                record.worker_id,
                record.internal_api,
                INTERNAL_API,
            )
        if models:
            kept.append((dataclasses.replace(record, models=models), at_s))
    return kept


#: Workers of an older internal API already warned about (once each per process).
_warned_older: set[str] = set()
#: Workers whose record does not read -> the error last warned of (it was warned at every
#: refresh, twice a second per router, for as long as it lasted).
_warned_malformed: dict[str, str] = {}
