"""The routing policy: which worker gets a request, or why none does.

`RouteTable` holds the last registry snapshot plus what this router knows that the registry does
not yet: rows it has reserved on each worker and workers whose calls just failed. `route()`
picks the ready worker with the least predicted wait and admits the request only if it can
finish inside its remaining deadline, as `RoutingConfig` (routing_config.py) sets it.
`RetryBudget` (retry_budget.py) bounds retries.

Synchronous and pure: time comes in as `now_s` (the driver's monotonic clock, the same clock
as the heartbeat times it passes to `update`), randomness from an injected `random.Random`.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.registry_schema import ModelRecord, WorkerRecord
from services.router.ejection import TimeoutEjector, replaced, routable_now
from services.router.reservations import Reservations
from services.router.retry_budget import RetryBudget
from services.router.routing_config import RoutingConfig

__all__ = ["Reject", "RejectReason", "RetryBudget", "Route", "RouteTable"]


class RejectReason(enum.Enum):
    """Why a request was not routed. Values are Prometheus label values."""

    #: No ready worker serves it now (UNAVAILABLE): retrying later may succeed.
    NO_WORKER = "no_worker"
    #: This router has read no registry snapshot yet (just started): UNAVAILABLE marked not
    #: started, as another router may route it. (A snapshot too old to trust, Redis unreachable
    #: past `max_snapshot_age_s`, is NO_WORKER: every router is likely in the same state, and
    #: gateways resending to each would multiply the load for as long as the outage lasts.)
    NO_REGISTRY = "no_registry"
    #: Predicted completion misses the remaining deadline (RESOURCE_EXHAUSTED + retry hint).
    DEADLINE = "deadline"
    #: No worker has advertised this name@version since the router started (NOT_FOUND).
    UNKNOWN_MODEL = "unknown_model"


@dataclass(frozen=True)
class Route:
    """Send the request to this worker; call `release(reservation_id)` when the call ends."""

    worker_id: str
    #: host:port to dial.
    address: str
    #: Identifies the rows reserved for this request on the worker.
    reservation_id: int
    #: Predicted queue wait plus compute on that worker when routed (seconds).
    predicted_s: float


@dataclass(frozen=True)
class Reject:
    """Do not send the request anywhere."""

    reason: RejectReason
    #: When a retry could plausibly succeed (seconds from now); 0 when retrying cannot help.
    retry_after_s: float
    message: str


class _Candidate:
    """A worker of the snapshot serving the model being routed, priced for the route being
    decided: `RouteTable._price` sets the prices, and only the synchronous `route` reads them.
    Built once per snapshot and model, so a route prices only the workers it compares."""

    __slots__ = ("has_room", "is_idle", "model", "predicted_s", "worker", "worker_id")

    def __init__(self, worker: WorkerRecord, model: ModelRecord) -> None:
        self.worker = worker
        self.worker_id = worker.worker_id
        self.model = model
        #: Predicted queue wait plus compute there (seconds).
        self.predicted_s = 0.0
        #: Generation models: the worker's free KV blocks hold the prompt now (always True for
        #: fixed-cost models). Workers with room are preferred whatever their predicted wait.
        self.has_room = True
        #: Nothing queued there, by its last heartbeat and by this router's reservations.
        self.is_idle = False


class RouteTable:
    """The last registry snapshot, this router's reservations and ejections, and the choice."""

    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        self._config = config
        self._rng = rng
        # Sorted by worker_id, so exact-minimum ties and seeded sampling are reproducible.
        self._workers: tuple[tuple[WorkerRecord, float], ...] = ()
        self._refreshed_at_s: float | None = None
        # worker_id -> monotonic time until which it is skipped. Survives `update`: a fresh
        # heartbeat does not prove the worker answers calls.
        self._ejected_until_s: dict[str, float] = {}
        #: Ejects workers whose calls only time out; the forwarder reports call outcomes here.
        self.timeouts = TimeoutEjector(config.timeout_ejection)
        # Rows this router sent per (worker_id, "name@version") and tenant, not yet answered.
        self._reservations = Reservations()
        # Every "name@version" served since start: one no worker serves now is UNAVAILABLE
        # (it may come back), never NOT_FOUND (permanent to clients).
        self._ever_served: set[str] = set()
        # (name, version) -> the snapshot's routable workers for it (alive, not draining,
        # ready) and whether any serves it: built once per snapshot and model, not per route.
        self._routable: dict[tuple[str, str], tuple[list[_Candidate], list[_Candidate], bool]] = {}

    def update(self, records: Sequence[tuple[WorkerRecord, float]], now_s: float) -> set[str]:
        """Replace the snapshot with `records`, each paired with its heartbeat time (seconds);
        returns the ids of the workers that left it (what is kept of them is dropped here).
        An empty read never replaces a non-empty snapshot: a restarted, empty Redis refills
        within one heartbeat period, and until then the last workers stay routable for as long
        as their heartbeats would have stayed fresh (`stale_after_s`), then time out as dead."""
        gone: set[str] = set()
        if records or not self._workers:
            gone = {w.worker_id for w, _ in self._workers} - {w.worker_id for w, _ in records}
            for worker_id in replaced(self._workers, records):  # its ejections were another's
                self._ejected_until_s.pop(worker_id, None)
                self.timeouts.forget(worker_id)
            self._workers = tuple(sorted(records, key=lambda pair: pair[0].worker_id))
            self.timeouts.retain(frozenset(w.worker_id for w, _ in self._workers))
        self._ever_served.update(m.key for worker, _ in records for m in worker.models)
        self._refreshed_at_s = now_s
        self._ejected_until_s = {w: t for w, t in self._ejected_until_s.items() if t > now_s}
        self._routable.clear()
        return gone

    def route(
        self,
        name: str,
        version: str,
        num_rows: int,
        remaining_s: float,
        now_s: float,
        exclude: frozenset[str] = frozenset(),
        *,
        is_batch: bool = False,
        tenant: str = "",
        weight: float = 1.0,
    ) -> Route | Reject:
        """Choose a worker for `num_rows` rows of name@version and reserve them, or reject.

        `remaining_s` is what is left of the request's deadline (math.inf for none); `exclude`
        names workers already tried for this request. Rows of class `batch` (`is_batch`) run
        after every other class, so they wait behind the workers' batch rows too. The wait is
        the caller's `tenant`'s (of fair-share `weight`): of the rows queued there, those fair
        share serves before its own (a flooding tenant's backlog is mostly behind a light
        tenant's request, as the worker's batcher orders it).
        """
        cfg = self._config
        if (stale := self._stale(now_s)) is not None:
            return stale
        refreshed_at_s = self._refreshed_at_s
        assert refreshed_at_s is not None  # not stale: loaded

        key = f"{name}@{version}"
        eligible, is_known = self._eligible(name, version, now_s, exclude)
        if not eligible:
            if not is_known and key not in self._ever_served:
                return Reject(RejectReason.UNKNOWN_MODEL, 0.0, f"no worker serves {key}")
            message = f"no ready worker for {key}"
            return Reject(RejectReason.NO_WORKER, cfg.stale_after_s, message)

        # Candidates are priced only where compared: the two power-of-two samples, or all of
        # them for the exact minimum and for the fallback below.
        pricing = (key, num_rows, now_s, refreshed_at_s, is_batch, tenant, weight)
        is_all_priced = len(eligible) <= cfg.power_of_two_threshold
        if is_all_priced:
            best = min(self._price(eligible, *pricing), key=_rank)
        else:
            # Power-of-two-choices: many routers with similar views would all pick the same
            # exact minimum; two random samples spread load and still avoid the worst.
            best = min(self._price(self._rng.sample(eligible, 2), *pricing), key=_rank)
        if not self._admits(best, remaining_s):
            # Power-of-two may have sampled two busy workers: before rejecting, fall back to the
            # best that admits, so a request is refused only when no candidate can take it.
            candidates = eligible if is_all_priced else self._price(eligible, *pricing)
            admitting = [c for c in candidates if self._admits(c, remaining_s)]
            best = min(admitting or candidates, key=_rank)
        if not self._admits(best, remaining_s):
            return self._too_late(best, key, remaining_s)
        if len(eligible) > 1 and self._rng.random() < cfg.explore_share:
            # One other worker, drawn at random and priced alone: exploring stays O(1).
            other = self._rng.choice([c for c in eligible if c is not best])
            if not is_all_priced:
                self._price([other], *pricing)
            # Idle means no prompt waits, not that KV blocks are free for this one.
            is_roomy = other.has_room or not best.has_room
            if other.is_idle and is_roomy and self._admits(other, remaining_s):
                best = other
        self.timeouts.on_routed(best.worker.worker_id, now_s)
        return self._reserve(best, key, num_rows, tenant, weight, is_batch)

    def can_take(
        self,
        name: str,
        version: str,
        num_rows: int,
        remaining_s: float,
        now_s: float,
        *,
        is_batch: bool = False,
        tenant: str = "",
        weight: float = 1.0,
    ) -> bool:
        """Whether some worker would take `num_rows` rows in time now, as `route` judges it;
        nothing is reserved. (A router that cannot place one row of a refused bundle has no
        part of it to place either.)"""
        refreshed_at_s = self._refreshed_at_s
        if refreshed_at_s is None or self._stale(now_s) is not None:
            return False
        eligible, _ = self._eligible(name, version, now_s, frozenset())
        key = f"{name}@{version}"
        priced = self._price(
            eligible, key, num_rows, now_s, refreshed_at_s, is_batch, tenant, weight
        )
        return any(self._admits(c, remaining_s) for c in priced)

    def _stale(self, now_s: float) -> Reject | None:
        """The refusal while no snapshot is fresh enough to route on (none read yet, or Redis
        unreachable past `max_snapshot_age_s`); None otherwise."""
        cfg = self._config
        if self._refreshed_at_s is None:
            return Reject(RejectReason.NO_REGISTRY, cfg.stale_after_s, "registry not loaded yet")
        age_s = now_s - self._refreshed_at_s
        if age_s > cfg.max_snapshot_age_s:
            message = f"registry stale: last refresh {age_s:.1f}s ago"
            return Reject(RejectReason.NO_WORKER, cfg.stale_after_s, message)
        return None

    def _eligible(
        self, name: str, version: str, now_s: float, exclude: frozenset[str]
    ) -> tuple[list[_Candidate], bool]:
        """Workers that may take name@version now, in worker_id order, not priced yet; and
        whether any worker of the snapshot serves it at all. Workers failing it (their batches
        of it all fail: `ModelRecord.is_failing`) come after every first choice of the others,
        and before the others' panic-mode fallback (services.router.ejection.routable_now)."""
        routable = self._routable.get((name, version))
        if routable is None:
            routable = self._routable[(name, version)] = self._routable_for(name, version)
        healthy, failing, is_known = routable
        ejected = self._ejected_until_s
        workers, is_first = routable_now(healthy, now_s, exclude, ejected, self.timeouts)
        if failing and not is_first:
            others, others_first = routable_now(failing, now_s, exclude, ejected, self.timeouts)
            if others_first or not workers:
                workers = others
        return workers, is_known

    def _routable_for(
        self, name: str, version: str
    ) -> tuple[list[_Candidate], list[_Candidate], bool]:
        """The snapshot's workers alive, not draining and ready for name@version: those not
        failing it, those failing it; and whether any worker serves it at all."""
        refreshed_at_s = self._refreshed_at_s
        workers: list[_Candidate] = []
        failing: list[_Candidate] = []
        is_known = False
        for worker, heartbeat_s in self._workers:
            model = worker.model(name, version)
            if model is None:
                continue
            is_known = True
            if (
                refreshed_at_s is not None
                and self._is_alive(heartbeat_s, refreshed_at_s)
                and not worker.is_draining
                and model.is_ready
            ):
                (failing if model.is_failing else workers).append(_Candidate(worker, model))
        return workers, failing, is_known

    def _price(
        self,
        candidates: list[_Candidate],
        key: str,
        num_rows: int,
        now_s: float,
        refreshed_at_s: float,
        is_batch: bool,
        tenant: str,
        weight: float,
    ) -> list[_Candidate]:
        """Sets each candidate's predicted wait for `num_rows` rows of `key`; returns them."""
        is_frozen = now_s - refreshed_at_s > self._config.queue_report_ttl_s
        for candidate in candidates:
            model = candidate.model
            # The heartbeat is up to a period stale but counts every router's traffic; the
            # local count is fresh but only ours: both count, while reads keep coming (see
            # RoutingConfig.queue_report_ttl_s).
            reported = None if is_frozen else (model.queued_rows, model.queued_batch_rows)
            queued_rows, ahead_rows = self._reservations.queue_ahead(
                (candidate.worker_id, key), reported, is_batch, tenant, weight
            )
            candidate.is_idle = queued_rows == 0
            wait_s = (ahead_rows + num_rows) * model.per_row_s
            candidate.predicted_s = max(model.min_batch_s, wait_s)
            # Generation: num_rows is a prompt's tokens; a frozen report's room is not known.
            candidate.has_room = is_frozen or model.kv_block_size == 0
            if not candidate.has_room:  # its free blocks, less the prompts reserved, not started
                reserved = self._reservations.place_rows((candidate.worker_id, key))
                room = model.kv_blocks_free * model.kv_block_size
                candidate.has_room = room >= num_rows + reserved
        return candidates

    def _too_late(self, best: _Candidate, key: str, remaining_s: float) -> Reject:
        """The refusal when even the best candidate cannot finish in time, with a retry hint
        of at least one batch's time. Past the model's SLO, the backlog beyond it must drain
        first. Past the caller's own deadline, waiting shortens what is left of it as fast as
        the backlog drains, so a retry within that deadline can never fit: the hint is the
        whole predicted time (as the worker's is), which a retrying client compares with
        what its deadline leaves, and gives up at once instead of sending a futile retry."""
        budget_s = self._budget_s(best.model, remaining_s)
        is_slo_bound = best.model.shed_past_slo and budget_s < (
            remaining_s - self._config.deadline_margin_s
        )
        limit = "the model's SLO" if best.model.shed_past_slo else "the remaining deadline"
        message = (
            f"{key}: predicted {best.predicted_s:.3f}s on {best.worker.worker_id}, "
            f"past {limit} ({remaining_s:.3f}s left)"
        )
        wait_s = best.predicted_s - budget_s if is_slo_bound else best.predicted_s
        return Reject(RejectReason.DEADLINE, max(wait_s, best.model.min_batch_s), message)

    def _reserve(
        self, best: _Candidate, key: str, num_rows: int, tenant: str, weight: float, is_batch: bool
    ) -> Route:
        # Check and reserve happen in one synchronous route() call, with no await between
        # them: that is the atomicity guarantee. Two routes in the same tick see each other's
        # rows.
        worker_id = best.worker.worker_id
        slot = (worker_id, key, is_batch)
        reservation_id = self._reservations.reserve(slot, num_rows, tenant, weight)
        return Route(worker_id, best.worker.address, reservation_id, best.predicted_s)

    def _budget_s(self, model: ModelRecord, remaining_s: float) -> float:
        """Seconds a request may be predicted to take there: its remaining deadline, and the
        model's SLO too when the model sheds past it; less the margin."""
        slo_s = model.slo_p99_ms / 1000.0 if model.shed_past_slo else math.inf
        return min(remaining_s, slo_s) - self._config.deadline_margin_s

    def _admits(self, candidate: _Candidate, remaining_s: float) -> bool:
        """An idle worker (nothing queued by its last heartbeat or by us) takes any request its
        one batch can finish in time: estimates learn only from work that runs, so refusing
        idle workers on a prediction could lock a model out for good. A busy one takes what
        its predicted wait lets finish within the budget."""
        if candidate.is_idle:
            return candidate.model.min_batch_s <= remaining_s
        return candidate.predicted_s <= self._budget_s(candidate.model, remaining_s)

    def release(self, reservation_id: int) -> None:
        """Return a reservation's rows. Idempotent: unknown or released ids are ignored."""
        self._reservations.release(reservation_id)

    def eject(self, worker_id: str, now_s: float) -> None:
        """Skip `worker_id` until now_s + eject_s: a call to it failed with UNAVAILABLE."""
        self._ejected_until_s[worker_id] = now_s + self._config.eject_s

    def inflight_rows(self, worker_id: str) -> int:  # reserved there by us, not released
        return self._reservations.worker_rows(worker_id)

    def live_workers(self, now_s: float) -> tuple[WorkerRecord, ...]:
        """Workers whose heartbeat is fresh, draining or not, in worker_id order."""
        del now_s  # Liveness is judged at the last refresh; see `_is_alive`.
        refreshed_at_s = self._refreshed_at_s
        if refreshed_at_s is None:
            return ()
        return tuple(w for w, hb_s in self._workers if self._is_alive(hb_s, refreshed_at_s))

    def served_models(self, now_s: float) -> dict[str, list[tuple[WorkerRecord, ModelRecord]]]:
        """Every live worker's models, ready or not, keyed by "name@version" (for a catalog)."""
        served: dict[str, list[tuple[WorkerRecord, ModelRecord]]] = {}
        for worker in self.live_workers(now_s):
            for model in worker.models:
                served.setdefault(model.key, []).append((worker, model))
        return served

    @property
    def has_snapshot(self) -> bool:
        """Whether a registry read has loaded this table (empty or not)."""
        return self._refreshed_at_s is not None

    def snapshot_age_s(self, now_s: float) -> float | None:
        """Seconds since the last `update`, or None before the first one."""
        return None if self._refreshed_at_s is None else now_s - self._refreshed_at_s

    def _is_alive(self, heartbeat_s: float, refreshed_at_s: float) -> bool:
        # Judged at the last refresh, not at now_s: while Redis is unreachable the snapshot is
        # frozen, and the router keeps routing to the workers alive at the last good read (for
        # up to max_snapshot_age_s; failed calls eject). While refreshes arrive every period,
        # this lags the now_s comparison by at most one refresh period.
        return refreshed_at_s - heartbeat_s <= self._config.stale_after_s


def _rank(candidate: _Candidate) -> tuple[bool, float, str]:
    return not candidate.has_room, candidate.predicted_s, candidate.worker.worker_id
