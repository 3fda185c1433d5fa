"""Runs a canary rollout: steps the canary's traffic share in Redis, judges each step from the
versions' own metrics (services.rollout.policy), and promotes or rolls back by itself.

Every step and verdict is logged and counted (`inference_rollout_canary_percent{model}`,
`inference_rollout_decisions_total{model,decision}`). Rollback sends all traffic back to
`stable` (weight 0 for `canary`, its label kept for inspection); promotion moves `stable` to
the canary's version and drops the `canary` label.

A rollout that fails while stepping (a worker's metrics endpoint gone, Redis unreachable, the
task cancelled by a signal) aborts: the canary's share goes back to 0 and its pool is released,
as for a rollback, before the error goes on, each tried again through a Redis outage (for up to
`abort_timeout_s`). A canary is never left serving a share nobody is judging, but for two
cases the abort reports (exit 3, logged): Redis away for longer than that, and a routing record
another writer (an operator's `routing set` or `reset`, a second controller) changed while the
rollout ran, which the rollout then stops at and leaves as it finds it, pool included.

The last step sends stable no traffic, so there the canary is judged against stable's health
over the last step in which stable served enough calls (policy.baseline).

With a `pool` (services.rollout.cluster in a Kubernetes cluster), the canary's worker pool is
made ready before the first step, its pods' metrics endpoints join the ones given by hand, and
a rollback releases the pool. Promotion leaves the pools as they are: the canary's pool now
serves stable's version, and which pool to keep is an operator's choice.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.model_repository import ModelKind
from services.common.model_routing import ModelRouting
from services.common.telemetry import MetricFactory
from services.rollout.health import Snapshot, health_between
from services.rollout.policy import Decision, Health, Plan, Verdict, baseline, judge
from services.rollout.routing_store import RoutingStore

log = logging.getLogger(__name__)


class RolloutAborted(Exception):
    """The rollout failed while stepping (its cause, the error), or its traffic could not be
    sent back; its message says whether the canary's share was set back to 0."""


class RoutingChanged(Exception):
    """The model's routing record is no longer the one the rollout wrote last: another writer
    (an operator's `routing set` or `reset`, another controller) changed it meanwhile."""


class RolloutMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        new = MetricFactory(registry)
        self.canary_percent = new.gauge(
            names.ROLLOUT_CANARY_PERCENT, "Canary's share of the model's traffic now.", ("model",)
        )
        self.decisions_total = new.counter(
            names.ROLLOUT_DECISIONS_TOTAL, "Step verdicts, by decision.", ("model", "decision")
        )
        self.canary_replicas = new.gauge(
            names.ROLLOUT_CANARY_REPLICAS, "Replicas set on the canary pool.", ("deployment",)
        )
        self.pool_ready_pods = new.gauge(
            names.ROLLOUT_POOL_READY_PODS, "Ready pods of the canary pool.", ("deployment",)
        )


class Pool(Protocol):
    """The canary's worker pool in a cluster (services.rollout.cluster.CanaryPool)."""

    async def prepare(self) -> tuple[str, ...]:
        """Makes the pool ready to take traffic; the metrics endpoints to judge from. Raises
        ClusterError when it cannot."""
        ...

    async def release(self) -> None:
        """After a rollback, or a pool that never became ready."""
        ...


@dataclass
class CanaryRollout:
    store: RoutingStore
    model: str
    canary_version: int
    plan: Plan
    #: One cumulative snapshot of the model's per-version metrics from these endpoints.
    scrape: Callable[[Sequence[str]], Awaitable[Snapshot]]
    metrics: RolloutMetrics
    #: Workers' /metrics given by hand (`--metrics-url`); the pool's are added to them.
    metrics_urls: tuple[str, ...] = ()
    pool: Pool | None = None
    #: How often a step in progress is checked for an early rollback, seconds.
    check_period_s: float = 5.0
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    #: How long an abort tries to set the share back, and then to release the pool, seconds
    #: each: longer than the Redis outages the fabric rides out (RELIABILITY.md: 30 s).
    abort_timeout_s: float = 120.0
    #: The revision of the routing record this rollout wrote last (None: none yet), and the
    #: labels and weights of the last it tried to write.
    _written: int | None = field(default=None, init=False)
    _attempted: tuple[dict[str, int], dict[str, float]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.check_period_s) and self.check_period_s > 0):
            # 0 would never end a step's hold: scrapes in a tight loop, for good.
            raise ValueError(f"the check period must be > 0 seconds, got {self.check_period_s}")

    async def run(self) -> Decision:
        """Runs the plan to PROMOTE or ROLLBACK. Raises ValueError if the model generates
        text (nothing judges its canary), has no `stable` label, the canary version is
        unknown or there is no metrics endpoint, and ClusterError if the pool cannot be made
        ready (the routing is unchanged then). An error while stepping aborts the rollout as
        a rollback would and raises RolloutAborted from it; cancellation aborts it the same
        way and stays a cancellation."""
        if self.store.kind(self.model) is ModelKind.GENERATION:
            # Judged blind, it served its share unjudged for every hold, then rolled back.
            raise ValueError(
                f"model {self.model!r} generates text: a canary is judged from the workers' "
                "per-version request counts and row latencies, which generation streams do "
                "not report; roll it out by labels and weights (`routing set`)"
            )
        routing = await self.store.routing(self.model)
        if "stable" not in routing.labels:
            raise ValueError(f"model {self.model!r} has no stable label to compare with")
        stable = str(routing.labels["stable"])
        if stable == str(self.canary_version):  # judged against itself, it would be promoted
            raise ValueError(f"model {self.model!r}: version {stable} is already stable")
        if _others_weighted(routing.traffic) and not _pair_weight(routing.traffic):
            raise ValueError(
                f"model {self.model!r}: stable takes no traffic beside other labels' "
                f"({routing.dumps()}): there is no share of stable's to give the canary"
            )
        if not self.store.has_version(self.model, self.canary_version):
            raise ValueError(f"model {self.model!r} has no version {self.canary_version}")
        if routing.traffic.get("canary", 0.0) > 0:
            # Another rollout's, running or killed: taken over silently, its controller then
            # stopped at its next write, its pool left up (review finding).
            raise ValueError(
                f"model {self.model!r}: a canary already takes traffic ({routing.dumps()}): "
                "another rollout runs, or one was stopped uncleanly; give its share back to "
                "stable first (`routing set` with --traffic stable=100, any other label's weight "
                "as it was; not `routing reset`, which also undoes the promotions since, back "
                "to the repository's labels)"
            )
        # The record read here is the one the first write changes: another writer's change
        # meanwhile (the pool's preparation may take minutes) stops the rollout at that write.
        self._written = routing.revision
        # The endpoints are fixed for the whole rollout: snapshots subtract endpoint by
        # endpoint.
        urls = self.metrics_urls
        if self.pool is not None:
            try:
                urls = (*urls, *await self.pool.prepare())
            except BaseException:  # ClusterError, or cancelled (SIGTERM) while it scaled
                await self.pool.release()
                raise
        # Each endpoint once: one given by hand and listed in a pool too counted twice.
        urls = tuple(dict.fromkeys(urls))
        if not urls:
            if self.pool is not None:
                await self.pool.release()
            raise ValueError("no worker metrics endpoint to judge from")
        try:
            decision = await self._steps(stable, urls)
        except BaseException as error:
            is_back = await self._send_traffic_back(error)
            if not isinstance(error, Exception):
                raise  # cancelled: still cancelled once aborted
            raise RolloutAborted(self._aborted(repr(error), is_back)) from error
        if decision is Decision.ROLLBACK:
            if not await self._send_traffic_back(None):
                raise RolloutAborted(self._aborted("rolled back", is_back=False))
            return decision
        self.metrics.canary_percent.labels(self.model).set(0)
        log.info("%s: promoted version %d to stable", self.model, self.canary_version)
        return Decision.PROMOTE

    async def _steps(self, stable: str, urls: Sequence[str]) -> Decision:
        """Every step, to the first rollback (ROLLBACK) or the promotion written (PROMOTE)."""
        earlier: Health | None = None
        for step, percent in enumerate(self.plan.steps):
            await self._set_share(percent)
            verdict, earlier = await self._run_step(step, stable, urls, earlier)
            if verdict.decision is Decision.ROLLBACK:
                return Decision.ROLLBACK
        # Tried again (the same record again: idempotent) while Redis fails: a promotion
        # written whose reply was lost, aborted, had the abort set the canary's share to 0 on
        # the promoted record, stable then naming the canary's version, its pool released
        # (review finding).
        await self._retried("promote the canary", lambda: self._change(self._promoted))
        return Decision.PROMOTE

    def _aborted(self, why: str, is_back: bool) -> str:
        back = "set back to 0" if is_back else "NOT set back to 0 (see the log)"
        return f"{self.model}: rollout aborted: {why} (the canary's share {back})"

    async def _run_step(
        self, step: int, stable: str, urls: Sequence[str], earlier: Health | None
    ) -> tuple[Verdict, Health | None]:
        """The step's verdict, and the stable health later steps may be judged against
        (policy.baseline): this step's, when stable served enough calls in it, else
        `earlier`."""
        before = await self.scrape(urls)
        holds, waited_s = 0, 0.0
        while True:
            await self.sleep(self.check_period_s)
            waited_s += self.check_period_s
            after = await self.scrape(urls)
            canary = health_between(before, after, str(self.canary_version))
            window = health_between(before, after, stable)
            reference = baseline(self.plan, window, earlier)
            final = waited_s >= self.plan.hold_s * (holds + 1)
            verdict = judge(self.plan, step, holds, canary, reference, final=final)
            if verdict.decision is not Decision.HOLD or final:
                self.metrics.decisions_total.labels(self.model, verdict.decision.value).inc()
                log.info(
                    "%s step %d (%g%%): %s: %s; canary %s, stable %s%s",
                    self.model, step, self.plan.steps[step], verdict.decision.value,
                    verdict.reason, canary, reference,
                    "" if reference is window else f" (an earlier step's; this one's {window})",
                )  # fmt: skip
            if verdict.decision is Decision.HOLD:
                holds += int(final)
                continue
            return verdict, window if window.requests >= self.plan.min_requests else earlier

    async def _send_traffic_back(self, error: BaseException | None) -> bool:
        """The canary's share back to 0, then its pool released, on a rollback (`error` None)
        or an abort; each tried again for up to `abort_timeout_s` (Redis may be what failed,
        for as long as an outage lasts: tried once, an abort left the canary serving its
        share, judged by nobody, once Redis was back). False, logged, if the share could not
        be set back: the pool then stays (released, the traffic still sent to it would fail),
        as does a routing another writer changed meanwhile (theirs now), or one the
        promotion was written to (its reply lost, then the abort). False too if the pool
        could not be released.

        Run whole: the rollout cancelled meanwhile (a signal, `cancel_once`) is cancelled
        once its traffic is back. A signal during a rollback, or during an abort for another
        cause, cancelled it half done, the canary left at its share (rollout review)."""
        sending = asyncio.ensure_future(self._traffic_back(error))
        cancelled: asyncio.CancelledError | None = None
        while True:
            try:
                is_back = await asyncio.shield(sending)
                break
            except asyncio.CancelledError as cancel:
                if sending.cancelled():
                    raise
                cancelled = cancel
                log.warning("%s: stopping once the canary's traffic is back", self.model)
        if cancelled is not None:
            raise cancelled
        return is_back

    async def _traffic_back(self, error: BaseException | None) -> bool:
        if error is not None:
            log.error(
                "%s: rollout aborted (%r); sending the canary's traffic back", self.model, error
            )
        try:
            await self._retried("set the canary's share back to 0", lambda: self._set_share(0))
        except RoutingChanged as changed:
            if self._attempted is not None:  # the canary had a share of ours: it may still
                log.error("%s; left as it is, and the canary pool too", changed)
                return False
            # Changed before this rollout wrote anything (while its pool was prepared): no
            # share of ours to take back, and its pool serves nothing (review finding: it
            # was left up).
            log.error("%s before the rollout's first write; left as it is", changed)
        except Exception as failure:
            log.error("%s: could not set the canary's share back to 0, nor release its pool "
                      "(traffic may still reach it): %r", self.model, failure)  # fmt: skip
            return False
        if self.pool is not None:
            try:
                await self._retried("release the canary pool", self.pool.release)
            except Exception as failure:
                log.error("%s: could not release the canary pool: %r", self.model, failure)
                return False
        return True

    async def _retried(self, what: str, step: Callable[[], Awaitable[None]]) -> None:
        """Runs `step` until it succeeds, within `abort_timeout_s`, a pause growing from
        0.5 s to 5 s after each failure (logged); raises its last failure (TimeoutError when
        time ran out first), or at once RoutingChanged and ValueError (a record that cannot
        be read, or no longer has a stable label)."""
        pause_s = 0.5
        async with asyncio.timeout(self.abort_timeout_s):
            while True:
                try:
                    return await step()
                except (RoutingChanged, ValueError):  # no retry changes these
                    raise
                except Exception as failure:
                    log.warning("%s: could not %s, trying again: %r", self.model, what, failure)
                await asyncio.sleep(pause_s)
                pause_s = min(5.0, 2 * pause_s)

    async def _set_share(self, percent: float) -> None:
        canary = self.canary_version

        def change(current: ModelRouting) -> ModelRouting:
            if current.labels.get("stable") == canary:  # its promotion written, reply lost
                raise RoutingChanged(f"{self.model}: version {canary} is stable already")
            labels = {**current.labels, "canary": canary}
            return ModelRouting(labels, canary_share(current.traffic, percent))

        await self._change(change)
        self.metrics.canary_percent.labels(self.model).set(percent)
        log.info("%s: canary version %d at %g%% of traffic", self.model, canary, percent)

    async def _change(self, change: Callable[[ModelRouting], ModelRouting]) -> None:
        """Stores `change` of the model's routing, raising RoutingChanged (nothing stored)
        once the record is not the one this rollout wrote last: an operator's reset, or a
        second controller, was overwritten at the next step (review finding)."""

        def own_change(current: ModelRouting) -> ModelRouting:
            # Its last write (or the record read at its start), or the one before whose reply
            # was lost (Redis failing): ours.
            is_ours = current.revision == self._written
            if not (is_ours or _weights(current) == self._attempted):
                raise RoutingChanged(
                    f"{self.model}: its routing was changed by another writer while the "
                    f"rollout ran (now {current.dumps()})"
                )
            changed = change(current)
            self._attempted = _weights(changed)
            return changed

        self._written = (await self.store.change(self.model, own_change)).revision

    def _promoted(self, current: ModelRouting) -> ModelRouting:
        labels = {k: v for k, v in current.labels.items() if k != "canary"}
        labels["stable"] = self.canary_version
        traffic = current.traffic
        # Other labels' weights kept, those at 0 too: dropped, a version held at 0 could
        # become a default again (catalog: its newest unweighted version; review finding).
        others = {k: w for k, w in traffic.items() if k not in _PAIR}
        pair = _pair_weight(traffic) if _others_weighted(traffic) else 1.0
        return ModelRouting(labels, {**others, "stable": pair})


#: The labels a rollout moves traffic between; any other label's weight it keeps.
_PAIR = ("stable", "canary")


def _others_weighted(traffic: Mapping[str, float]) -> bool:
    return any(w > 0 for label, w in traffic.items() if label not in _PAIR)


def _pair_weight(traffic: Mapping[str, float]) -> float:
    return traffic.get("stable", 0.0) + traffic.get("canary", 0.0)


def canary_share(traffic: Mapping[str, float], percent: float) -> dict[str, float]:
    """The weights with the canary at `percent` of what stable and canary take together, the
    rest stable's; other labels keep their weights (`{stable: 90, beta: 10}` at 50%: stable
    45, canary 45, beta 10), where a rollout dropped them, beta's callers then all sent to
    stable and the canary (review finding). Without another label weighted, the pair's
    weights are 100 - percent and percent."""
    others = {k: w for k, w in traffic.items() if k not in _PAIR}
    pair = _pair_weight(traffic) if _others_weighted(traffic) else 100.0
    return {**others, "stable": pair * (100.0 - percent) / 100.0, "canary": pair * percent / 100.0}


def _weights(routing: ModelRouting) -> tuple[dict[str, int], dict[str, float]]:
    return dict(routing.labels), dict(routing.traffic)


def describe_plan(plan: Plan, model: str, canary_version: int, routing: ModelRouting) -> str:
    """The dry run's text: what would happen, step by step."""
    lines = [
        f"model {model}: routing now {routing.dumps()}",
        f"canary version {canary_version}; stable stays "
        f"{routing.labels.get('stable', '(none: the rollout would refuse to start)')}",
    ]
    for step, percent in enumerate(plan.steps):
        lines.append(
            f"  step {step}: canary at {percent:g}% for {plan.hold_s:g}s; roll back if its error"
            f" rate exceeds stable's by {plan.max_error_rate_increase:.2%}, its refusal rate by"
            f" {plan.max_refusal_rate_increase:.2%}, or its p99 is over"
            f" {plan.max_p99_ratio:g}x stable's and {plan.p99_slack_s * 1000:g} ms past it"
            f" (judged from {plan.min_requests} requests;"
            f" up to {plan.max_holds} extra holds)"
        )
    if _others_weighted(routing.traffic):
        kept = ", ".join(sorted(k for k in routing.traffic if k not in _PAIR))
        lines.append(f"  (each share is of what stable takes; {kept} keep their weights)")
    lines.append("  then: stable -> canary's version, canary label dropped")
    return "\n".join(lines)
