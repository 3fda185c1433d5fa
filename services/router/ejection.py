"""Outlier ejection of workers whose calls only time out.

A worker can be alive by its heartbeat yet answer nothing: its event loop stuck, a network path
that drops packets, a model wedged before the worker's own watchdog fires. Every call routed
there waits out its whole deadline. `TimeoutEjector` ejects such a worker from routing after
`timeouts_to_eject` consecutive timeouts with no success in between, counted only once the worker
has answered nothing for `min_silence_s`: an overloaded worker times out many calls in a row yet
keeps answering others, and ejecting it would turn overload into an outage. After the period
one request at a time probes it again. A probe that times out ejects it again for twice as
long (bounded by `max_eject_s`); a success restores it. Routing skips an ejected worker only
while another worker of the model version is routable (services.router.routing: Envoy's panic
mode, entered here only when none is left); an answer to a call routed there meanwhile
restores it at once.

Synchronous and pure: time comes in as `now_s` (the router's monotonic clock).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol, TypeVar

from services.common.registry_schema import WorkerRecord


@dataclass(frozen=True)
class TimeoutEjectionConfig:
    """When a worker whose calls time out is taken out of routing, and for how long."""

    #: Consecutive timeouts, with no success in between, that eject a worker (0: never).
    timeouts_to_eject: int = 5
    #: First ejection period, seconds; each repeat doubles it.
    eject_s: float = 10.0
    #: Longest ejection period, seconds. A worker that answers for this long after its last
    #: ejection starts again from `eject_s`.
    max_eject_s: float = 300.0
    #: A timeout counts only if the call waited at least this many times its predicted time: a
    #: call cut short by its caller's own tight deadline says nothing about the worker.
    min_wait_factor: float = 4.0
    #: A timeout counts only if the worker has answered nothing (success or error) for this
    #: long, seconds: a worker that answers is overloaded or slow, not wedged.
    min_silence_s: float = 2.0

    def __post_init__(self) -> None:
        if self.timeouts_to_eject < 0:
            raise ValueError("timeouts_to_eject must be >= 0")
        if not 0 < self.eject_s <= self.max_eject_s:
            raise ValueError("timeout ejection periods must satisfy 0 < eject_s <= max_eject_s")
        if self.min_wait_factor < 0 or self.min_silence_s < 0:
            raise ValueError("min_wait_factor and min_silence_s must be >= 0")


@dataclass
class _Health:
    """What the ejector knows of one worker that timed out lately."""

    num_timeouts: int = 0
    #: Ejections in the current run of repeats (sets the next period).
    num_ejections: int = 0
    #: While ejected: when the period ends; after it, the worker is on probation.
    ejected_until_s: float | None = None
    #: When the current ejection began (calls sent since are answers of the ejected worker).
    ejected_at_s: float = 0.0
    #: On probation, a probe is out until this time (then another may go).
    probe_until_s: float | None = None
    #: When the last ejection period ended (repeats within `max_eject_s` of it double).
    last_ejection_end_s: float = 0.0


class TimeoutEjector:
    def __init__(self, config: TimeoutEjectionConfig) -> None:
        self._config = config
        self._workers: dict[str, _Health] = {}
        #: When each worker last answered a call (any answer but a timeout).
        self._last_answer_s: dict[str, float] = {}
        #: Whether any worker was ever ejected: until then `may_route` is True for every
        #: worker, and a router need not ask about each one.
        self.has_ejected = False
        #: The workers of the registry's last snapshot (`retain`; None: every worker).
        self._known: AbstractSet[str] | None = None

    def may_route(self, worker_id: str, now_s: float) -> bool:
        """False while `worker_id` is ejected, or on probation with its probe out."""
        health = self._workers.get(worker_id)
        if health is None or health.ejected_until_s is None:
            return True
        if now_s < health.ejected_until_s:
            return False
        return health.probe_until_s is None or now_s >= health.probe_until_s

    def on_routed(self, worker_id: str, now_s: float) -> None:
        """A request was routed to `worker_id`: on probation, it is the probe, and no other
        request goes there until it answers (or for `eject_s`, should it never)."""
        health = self._workers.get(worker_id)
        until_s = None if health is None else health.ejected_until_s
        if health is not None and until_s is not None and now_s >= until_s:
            health.probe_until_s = now_s + self._config.eject_s

    def record_success(self, worker_id: str, now_s: float, sent_s: float = -math.inf) -> None:
        """A call to `worker_id`, sent at `sent_s`, was answered: the timeout streak ends, an
        ejection too once the answer is to a call sent while ejected (routed there because no
        other worker was routable: services.router.routing) or on probation. The worker is
        forgotten once it has answered for `max_eject_s` since its last ejection."""
        if self._known is not None and worker_id not in self._known:
            return  # a late answer of a worker that left: nothing is kept of it
        self._last_answer_s[worker_id] = now_s
        health = self._workers.get(worker_id)
        if health is None:
            return
        health.num_timeouts = 0
        if health.ejected_until_s is not None:
            # Else a late answer to a call sent before the ejection: it says nothing new.
            if now_s >= health.ejected_until_s or sent_s >= health.ejected_at_s:
                health.last_ejection_end_s = min(now_s, health.ejected_until_s)
                health.ejected_until_s = health.probe_until_s = None
            return
        if health.num_ejections == 0 or (
            now_s - health.last_ejection_end_s >= self._config.max_eject_s
        ):
            del self._workers[worker_id]

    def record_timeout(
        self, worker_id: str, now_s: float, *, waited_s: float, predicted_s: float
    ) -> float | None:
        """A call to `worker_id` timed out after `waited_s` (routing predicted `predicted_s`).
        Returns the ejection period when this timeout ejects the worker, else None."""
        config = self._config
        if config.timeouts_to_eject == 0 or waited_s < config.min_wait_factor * predicted_s:
            return None
        if self._known is not None and worker_id not in self._known:
            return None  # a call to a worker that left timed out: nothing is kept of it
        last_answer_s = self._last_answer_s.get(worker_id)
        if last_answer_s is not None and now_s - last_answer_s < config.min_silence_s:
            return None  # it answers others: overloaded or slow, not wedged
        health = self._workers.setdefault(worker_id, _Health())
        if health.ejected_until_s is not None:
            if now_s - waited_s < health.ejected_until_s:
                # Sent before probation (before the ejection, or while no other worker was
                # routable): already counted, and not the probe, whenever it times out.
                return None
            return self._eject(health, now_s)  # the probe timed out
        health.num_timeouts += 1
        if health.num_timeouts >= config.timeouts_to_eject:
            return self._eject(health, now_s)
        return None

    def _eject(self, health: _Health, now_s: float) -> float:
        # The doubling stops where it is surely past max_eject_s: 2**1,024 is no float (a
        # worker that black-holes calls for days got there, and its probe's timeout raised).
        doubled_s = self._config.eject_s * 2 ** min(health.num_ejections, 64)
        period_s = min(self._config.max_eject_s, doubled_s)
        health.num_ejections += 1
        self.has_ejected = True
        health.num_timeouts = 0
        health.ejected_at_s = now_s
        health.ejected_until_s = now_s + period_s
        health.probe_until_s = None
        return period_s

    def forget(self, worker_id: str) -> None:
        """Drops what is known of `worker_id` (a new process under its id)."""
        self._workers.pop(worker_id, None)
        self._last_answer_s.pop(worker_id, None)

    def retain(self, worker_ids: AbstractSet[str]) -> None:
        """Keeps only what is known of `worker_ids` (the registry's workers now), and from now
        on records nothing of any other: a worker id is its host and process, so a restarted
        pod is a new one, and what is kept of the old one would grow with every restart, as it
        would if a call to a worker that left timed out, or answered, after it left."""
        self._known = worker_ids
        for kept in (self._workers, self._last_answer_s):
            for worker_id in [w for w in kept if w not in worker_ids]:
                del kept[worker_id]

    def is_ejected(self, worker_id: str, now_s: float) -> bool:
        """Inside an ejection period now (probation not included)."""
        health = self._workers.get(worker_id)
        until_s = None if health is None else health.ejected_until_s
        return until_s is not None and now_s < until_s


class _Worker(Protocol):
    @property
    def worker_id(self) -> str: ...


W = TypeVar("W", bound=_Worker)


def routable_now(
    workers: list[W],
    now_s: float,
    exclude: AbstractSet[str],
    ejected_until_s: Mapping[str, float],
    timeouts: TimeoutEjector,
) -> tuple[list[W], bool]:
    """The `workers` a request may go to now, and whether they are first choices: not tried by
    the request (`exclude`), not ejected for UNAVAILABLE (`ejected_until_s`), not ejected for
    timeouts. Where none is, ejections skip a worker only while another is routable (Envoy's
    panic mode): ejecting the last turns late answers to none, and a last worker's stream reset
    once left its model with no worker for `eject_s`; one ejected for a reset comes before those
    that time out (all went to a wedged one: review finding). A request never goes back to a
    worker it tried."""
    untried = workers
    if exclude or ejected_until_s:
        untried = [c for c in workers if c.worker_id not in exclude]
        live = [c for c in untried if now_s >= ejected_until_s.get(c.worker_id, -math.inf)]
    elif not timeouts.has_ejected:
        return workers, bool(workers)  # the usual case; callers do not change the list
    else:
        live = untried
    may_route = timeouts.may_route
    kept = [c for c in live if may_route(c.worker_id, now_s)]
    if kept:
        return kept, True
    return [c for c in untried if may_route(c.worker_id, now_s)] or live or untried, False


def replaced(
    before: Iterable[tuple[WorkerRecord, float]], after: Iterable[tuple[WorkerRecord, float]]
) -> set[str]:
    """The worker ids of `before`'s snapshot that are another process's in `after`'s (another
    address or start): what was learnt of them is not the new process's. A worker restarted
    under its id (a container restarted in its pod) began ejected for what its wedged
    predecessor did, for up to max_timeout_eject_s (review finding)."""
    was = {w.worker_id: (w.address, w.started_at_ms) for w, _ in before}
    return {
        w.worker_id
        for w, _ in after
        if was.get(w.worker_id, (w.address, w.started_at_ms)) != (w.address, w.started_at_ms)
    }
