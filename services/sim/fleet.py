"""The simulated fleet: gateways, routers and workers, and a request's path through them.

A request takes the real path: its tenant's quotas at the gateway may refuse it (gateway.py),
then the gateway's `AdaptiveThrottle` (per model, class and tenant), then its row rate; a router's
`RouteTable` picks a worker from its last registry snapshot (heartbeats every
`heartbeat_period_s`, read every `refresh_period_s`, stale after `stale_after_s`) or refuses it;
`upstream_s` later the worker's batcher admits or refuses it; its answer returns `downstream_s`
after the batch ends. A call to a dead or draining worker fails UNAVAILABLE: the router ejects
that worker and retries elsewhere as `router.retry.decide_retry` allows, as the forwarder does.

At scale, routers may be split into cells of `cell_size` workers (each router sees only its
cell); a real router sees the whole fleet. Cells once kept routing affordable; now a route
prices only the two workers it samples (the table filters its snapshot once per refresh), so a
table over 1,000 workers costs about what one over 50 does, a few microseconds per request.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.fair_rows import DEFAULT_WEIGHT
from services.gateway.throttle import AdaptiveThrottle
from services.gpu_worker.admission import RejectReason as WorkerReject
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.slo_shedding import PAST_SLO
from services.router.retry import RetryElsewhere, decide_retry
from services.router.routing import Reject, RejectReason, RetryBudget, RouteTable
from services.sim.curve import LatencyCurve
from services.sim.events import EventLoop
from services.sim.fleet_config import FleetConfig
from services.sim.gateway import GatewayAdmission, gateway_index
from services.sim.host import SharedHost
from services.sim.results import Recorder
from services.sim.tier_queues import TierQueues
from services.sim.traffic import Arrival
from services.sim.worker import ModelSpec, SimRequest, SimWorker


@dataclass
class _Cell:
    table: RouteTable
    #: worker_id -> (last heartbeat record, its time): what Redis holds for this cell.
    registry: dict[str, tuple[Any, float]] = field(default_factory=dict)


class Fleet:
    """Workers, the registry, routers and gateways on one event loop."""

    def __init__(
        self,
        config: FleetConfig,
        models: Sequence[tuple[ModelSpec, LatencyCurve]],
        driver: DriverConfig,
        loop: EventLoop,
        recorder: Recorder,
        *,
        seed: int,
        max_workers: int,
    ) -> None:
        self.config = config
        #: Every worker serves every model: (spec, its latency curve), in lane order.
        self.models = tuple(models)
        self._spec_of = {spec.name: spec for spec, _ in self.models}
        self._driver = driver
        self._loop = loop
        self._recorder = recorder
        self._rng = random.Random(seed)
        num_cells = 1 if config.cell_size <= 0 else math.ceil(max_workers / config.cell_size)
        self._cells = [
            _Cell(RouteTable(config.routing, random.Random(seed + i))) for i in range(num_cells)
        ]
        self._budgets = [RetryBudget() for _ in self._cells]
        self._throttles = [AdaptiveThrottle(config.throttle) for _ in range(config.gateways)]
        # Hops of the fixed `upstream_s`, scheduled in routing order: a line of the loop.
        self._upstream = loop.line()
        self._tiers = TierQueues(
            config.tier_cpu,
            gateways=config.gateways,
            routers=config.routers,
            worker_processes=config.worker_processes,
        )
        self._admission = GatewayAdmission(
            config.tenants, config.gateways, sync_period_s=config.quota_sync_period_s
        )
        if self._admission.needs_sync:
            loop.every(config.quota_sync_period_s, self._admission.sync)
        self.workers: dict[str, SimWorker] = {}
        self._cell_of: dict[str, int] = {}
        self._born_s: dict[str, float] = {}
        #: Workers created and not yet serving (starting up).
        self.starting: set[str] = set()
        self._draining: set[str] = set()
        self._worker_seconds = 0.0
        self._next_worker = 0
        #: Workers retired or dead, for the run's totals.
        self._gone: list[SimWorker] = []
        for cell in self._cells:
            offset = self._rng.uniform(0, config.refresh_period_s)
            loop.every(config.refresh_period_s, self._refresher(cell), start_s=offset)

    # -- membership ------------------------------------------------------------------------

    def add_worker(self, now_s: float, *, startup_s: float | None = None) -> str:
        """Creates a worker; it heartbeats (and so becomes routable) after its start-up."""
        number = self._next_worker
        self._next_worker += 1
        worker_id = f"w{number:04d}"
        worker = SimWorker(
            worker_id,
            self.models,
            self._driver,
            self._loop,
            self._answer,
            noise_sigma=self.config.noise_sigma,
            rng=random.Random(self._rng.random()),
            host=SharedHost(self.config.host) if self.config.host.is_shared else None,
        )
        self.workers[worker_id] = worker
        self._cell_of[worker_id] = number % len(self._cells)
        self._born_s[worker_id] = now_s
        self.starting.add(worker_id)
        delay_s = self.config.startup_s if startup_s is None else startup_s
        self._loop.at(now_s + delay_s, self._started, worker_id)
        return worker_id

    def _started(self, now_s: float, worker_id: str) -> None:
        self.starting.discard(worker_id)
        if worker_id in self.workers:
            self._heartbeat(now_s, worker_id)

    def _heartbeat(self, now_s: float, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is None or not worker.is_alive:
            return
        cell = self._cells[self._cell_of[worker_id]]
        cell.registry[worker_id] = (worker.record(now_s, is_ready=True), now_s)
        self._loop.at(now_s + self.config.heartbeat_period_s, self._heartbeat, worker_id)

    def _refresher(self, cell: _Cell) -> Any:
        def refresh(now_s: float, _: object) -> None:
            cell.table.update(list(cell.registry.values()), now_s)

        return refresh

    @property
    def bundle_slices(self) -> float:
        """Callers per bundle at the gateways' load now (1 without tier costs)."""
        return self._tiers.slices

    @property
    def serving(self) -> list[str]:
        """Workers started, alive and not draining."""
        return [
            w
            for w, worker in self.workers.items()
            if worker.is_alive and w not in self.starting and w not in self._draining
        ]

    @property
    def num_replicas(self) -> int:
        """Workers the deployment counts: starting or serving (not draining, not dead)."""
        return sum(
            1 for w, worker in self.workers.items() if worker.is_alive and w not in self._draining
        )

    def remove_worker(self, now_s: float) -> None:
        """Scale-down: the newest worker drains, publishes that at once, leaves when done."""
        candidates = [w for w in self.workers if w not in self._draining]
        if not candidates:
            return
        worker_id = max(candidates, key=lambda w: (self._born_s[w], w))
        self._draining.add(worker_id)
        worker = self.workers[worker_id]
        if worker_id in self.starting:
            self._retire(now_s, worker_id)
            return
        worker.begin_drain(now_s)
        self._heartbeat_once(now_s, worker_id)
        self._loop.at(now_s, self._retire_when_drained, worker_id)

    def _heartbeat_once(self, now_s: float, worker_id: str) -> None:
        cell = self._cells[self._cell_of[worker_id]]
        cell.registry[worker_id] = (self.workers[worker_id].record(now_s, is_ready=False), now_s)

    def _retire_when_drained(self, now_s: float, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        if worker.is_drained:
            self._retire(now_s, worker_id)
        else:
            self._loop.at(now_s + 0.05, self._retire_when_drained, worker_id)

    def _retire(self, now_s: float, worker_id: str) -> None:
        worker = self.workers.pop(worker_id)
        worker.is_alive = False
        self._gone.append(worker)
        self.starting.discard(worker_id)
        self._draining.discard(worker_id)
        self._cells[self._cell_of[worker_id]].registry.pop(worker_id, None)
        self._worker_seconds += now_s - self._born_s.pop(worker_id)

    def kill_workers(self, now_s: float, count: int) -> None:
        """`count` serving workers die at once (no drain, no deregistration)."""
        for worker_id in sorted(self.serving)[:count]:
            worker = self.workers[worker_id]
            for request in worker.kill(now_s):
                self._unavailable(now_s, request)
            self._worker_seconds += now_s - self._born_s.pop(worker_id)
            self._gone.append(self.workers.pop(worker_id))

    @property
    def all_workers(self) -> list[SimWorker]:
        """Every worker the run created, gone or not."""
        return [*self._gone, *self.workers.values()]

    def worker_seconds(self, now_s: float) -> float:
        return self._worker_seconds + sum(now_s - born for born in self._born_s.values())

    # -- a request's path ------------------------------------------------------------------

    def arrive(self, now_s: float, arrival: Arrival) -> None:
        self._recorder.arrived(now_s, arrival.tenant, arrival.model)
        gateway = self._gateway_of(arrival)
        refusal = self._admission.admit(gateway, arrival, now_s)
        if refusal is not None:
            return self._gateway_refused(now_s, f"gateway_quota_{refusal.reason}")
        throttle = self._gateway(arrival)
        if throttle.admit(_throttle_key(arrival), now_s, self._rng.random()) is not None:
            self._done(arrival)
            return self._gateway_refused(now_s, "gateway_throttled")
        # After the throttle, as in the predictor: a call it sheds spends none of its rows.
        if (refusal := self._admission.take_rows(gateway, arrival, now_s)) is not None:
            return self._gateway_refused(now_s, f"gateway_quota_{refusal.reason}")  # released
        spec = self._spec_of[arrival.model]  # scenarios refuse streams of other models
        timeout_s = spec.default_timeout_s if arrival.timeout_s is None else arrival.timeout_s
        request = SimRequest(arrival, now_s + timeout_s)
        request.cell = self._rng.randrange(len(self._cells))
        self._budgets[request.cell].record_request(now_s)
        self._route(now_s, request)

    def _gateway_refused(self, now_s: float, reason: str) -> None:
        if self._tiers.is_set:
            self._tiers.refused_at_gateway(now_s)
        self._recorder.refused(now_s, reason)

    def _route(self, now_s: float, request: SimRequest) -> None:
        """An attempt of `request` leaves the gateway's door at `now_s`. With tier costs, the
        router decides once the gateway's and the router's CPU queues have done their work on
        it (each attempt), on what the workers hold by then: a decision taken at the door
        would route on a state as old as those queues are long."""
        if self._tiers.is_set:
            request.tiers_s = self._tiers.at_gateway_and_router(now_s)
            self._loop.at(now_s + request.tiers_s, self._decide, request)
            return
        self._decide(now_s, request)

    def _decide(self, now_s: float, request: SimRequest) -> None:
        """The router's decision for `request` at `now_s`, and its trip to the worker."""
        spec = self._spec_of[request.arrival.model]
        tenant = request.arrival.tenant
        policy = self.config.tenants.get(tenant)
        decision = self._cells[request.cell].table.route(
            spec.name,
            spec.version,
            1,
            request.deadline_s - now_s,
            now_s,
            request.tried,
            tenant=tenant,
            weight=DEFAULT_WEIGHT if policy is None else policy.weight,
        )
        budget = self._budgets[request.cell]  # a retry spends its token once routed
        if request.tried and not isinstance(decision, Reject) and not budget.try_spend(now_s):
            self._cells[request.cell].table.release(decision.reservation_id)
            self._gave_up(request, now_s)  # the budget ran out since the retry was decided
            return
        if isinstance(decision, Reject):
            is_overload = decision.reason is RejectReason.DEADLINE
            self._answered(request.arrival, now_s, is_accepted=not is_overload,
                           retry_after_s=decision.retry_after_s)  # fmt: skip
            self._done(request.arrival, unserved_s=now_s if is_overload else None)
            self._recorder.refused(request.arrival.at_s, f"router_{decision.reason.value}")
            return
        request.worker_id = decision.worker_id
        request.reservation_id = decision.reservation_id
        request.tried = request.tried | {decision.worker_id}
        upstream_s = self.config.upstream_s
        worker = self.workers.get(decision.worker_id)  # None: it died since the snapshot
        host = None if worker is None else worker.host
        if self._tiers.is_set:  # the worker's processes' CPU queue, after the hop to it
            upstream_s += self._tiers.at_worker(decision.worker_id, now_s + upstream_s)
            request.upstream_s = request.tiers_s + upstream_s
            self._loop.at(now_s + upstream_s, self._at_worker, request)
            return
        if host is None:
            request.upstream_s = upstream_s
            self._upstream.at(now_s + upstream_s, self._at_worker, request)
            return
        host.request(now_s)
        upstream_s *= host.hop_stretch(now_s)
        request.upstream_s = upstream_s
        self._loop.at(now_s + upstream_s, self._at_worker, request)

    def _at_worker(self, now_s: float, request: SimRequest) -> None:
        worker = self.workers.get(request.worker_id)
        if worker is None or not worker.is_alive or worker.is_draining:
            self._unavailable(now_s, request)
            return
        reason = worker.submit(request, now_s)
        if reason is None:
            return
        if reason is WorkerReject.DRAINING:
            self._unavailable(now_s, request)
            return
        self._release(request)
        self._done(request.arrival, unserved_s=now_s)
        self._answered(request.arrival, now_s, is_accepted=False)
        self._recorder.refused(request.arrival.at_s, f"worker_{reason.value}")

    def _answer(self, now_s: float, request: SimRequest, outcome: str) -> None:
        """A worker answered: "ok" (the batch ran), "expired" (DEADLINE_EXCEEDED unrun) or
        "past_slo" (refused unrun: past the SLO bound admission set)."""
        arrival = request.arrival
        self._release(request)
        is_accepted = outcome != PAST_SLO  # refused, as admission refuses
        self._done(arrival, unserved_s=None if is_accepted else now_s)
        self._answered(arrival, now_s, is_accepted=is_accepted)
        arrival_s = arrival.at_s
        if outcome == "ok":
            downstream_s = self.config.downstream_s
            worker = self.workers.get(request.worker_id)
            if worker is not None and worker.host is not None:
                downstream_s *= worker.host.hop_stretch(now_s)
            latency_s = now_s + downstream_s - arrival_s
            self._recorder.answered(
                arrival_s,
                latency_s,
                arrival.tenant,
                arrival.model,
                hops_s=request.upstream_s + downstream_s,
            )
        else:
            self._recorder.refused(arrival_s, f"worker_{outcome}")

    def _unavailable(self, now_s: float, request: SimRequest) -> None:
        """The call failed UNAVAILABLE: eject the worker, retry elsewhere if allowed."""
        self._release(request)
        self._cells[request.cell].table.eject(request.worker_id, now_s)
        decision = decide_retry(
            is_worker_unavailable=True,
            attempt=request.num_attempts,
            max_retries=self.config.max_retries,
            deadline_s=request.deadline_s,
            now_s=now_s,
            budget=self._budgets[request.cell],
        )
        request.num_attempts += 1
        if isinstance(decision, RetryElsewhere):
            self._route(now_s, request)
        else:
            self._gave_up(request, now_s)

    def _gave_up(self, request: SimRequest, now_s: float) -> None:
        """No retry after UNAVAILABLE: the caller gets it."""
        self._done(request.arrival)
        self._answered(request.arrival, now_s, is_accepted=True)
        self._recorder.refused(request.arrival.at_s, "unavailable")

    def _release(self, request: SimRequest) -> None:
        self._cells[request.cell].table.release(request.reservation_id)

    def _done(self, arrival: Arrival, unserved_s: float | None = None) -> None:
        """The call's answer or refusal left its gateway: it is no longer in flight there;
        refused unrun for load at `unserved_s`, its row returns then (admission.never_served)."""
        if unserved_s is not None:
            self._admission.give_back_rows(self._gateway_of(arrival), arrival, unserved_s)
        self._admission.release(self._gateway_of(arrival), arrival.tenant)

    def _gateway_of(self, arrival: Arrival) -> int:
        # The request's gateway, stable for it: its throttle also counts the answer, and its
        # quotas count the call in flight until then.
        return gateway_index(arrival.at_s, len(self._throttles))

    def _gateway(self, arrival: Arrival) -> AdaptiveThrottle:
        return self._throttles[self._gateway_of(arrival)]

    def _answered(self, arrival: Arrival, now_s: float, **answer: Any) -> None:
        """Its gateway's throttle counts how downstream answered the call (`record`)."""
        self._gateway(arrival).record(_throttle_key(arrival), now_s, **answer)


def _throttle_key(arrival: Arrival) -> str:
    """The gateway throttle's key, as the real gateway's `_throttle_check` builds it: per model,
    class and tenant, so one tenant's flood does not teach it to refuse everyone else."""
    return f"{arrival.model}/{arrival.priority}/{arrival.tenant}"
