"""A worker pool as the rollout sees it: which of its pods count as serving, whether there are
enough of them yet, where each one's metrics are, and the pool's settings. Pure: no clock, no
I/O, no Kubernetes client (services.rollout.cluster converts the API's pods into `PodState`
once).

A pod counts when its `Ready` condition is True and it is not being deleted: a pod that is
terminating can still be Ready for its grace period, but its traffic and counters are on their
way out. The rule for waiting is Kubernetes' own: the pool is ready once at least the wanted
number of pods count, and a wait that outlasts its timeout is a failure, never a silent
"good enough".
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Sequence
from dataclasses import dataclass

#: The container port name a worker declares for its Prometheus `/metrics` (deploy/k8s).
METRICS_PORT_NAME = "metrics"


class ClusterError(RuntimeError):
    """The cluster refused or did not do what the rollout needs (an API error, a pool that never
    became ready, pods without a metrics port). Nothing was promoted; the message says what and
    where, so that an operator can fix it and run the rollout again."""


@dataclass(frozen=True)
class PoolConfig:
    """The canary pool's Deployment and what the rollout does with it (`canary` flags)."""

    namespace: str
    #: The Deployment of the workers that serve the canary version.
    canary_deployment: str
    #: The Deployment of the workers that serve stable, whose ready pods are scraped too; None
    #: when stable's workers are given by `--metrics-url` (or are the canary pool's own).
    stable_deployment: str | None = None
    #: Replicas to scale the canary pool to before the first step; None keeps its own count.
    num_canary_replicas: int | None = None
    #: How long the canary pool may take to have that many Ready pods, seconds.
    ready_timeout_s: float = 600.0
    #: How often its pods are listed while waiting, seconds.
    poll_period_s: float = 2.0
    #: Scale the canary pool to 0 after a rollback (or a pool that never became ready).
    is_scaled_down_on_rollback: bool = False

    def __post_init__(self) -> None:
        if self.num_canary_replicas is not None and self.num_canary_replicas < 1:
            raise ValueError("--canary-replicas must be >= 1")
        # NaN passed the comparisons (every one is false): an endless wait, a sleep(nan).
        if not (0 <= self.ready_timeout_s < math.inf and 0 < self.poll_period_s < math.inf):
            raise ValueError("--ready-timeout-s must be finite and >= 0, --pool-poll-s > 0")


@dataclass(frozen=True)
class PodState:
    """One pod of a worker pool, as much of it as the rollout needs."""

    name: str
    #: The pod's IP; None until it is scheduled and has one.
    ip: str | None
    #: Its `Ready` condition is True (every container passes its readiness probe).
    is_ready: bool
    #: It has a deletion timestamp: never counted, even while still Ready.
    is_terminating: bool
    #: The container port named `metrics`; None when no container declares one.
    metrics_port: int | None


@dataclass(frozen=True)
class PoolReady:
    """Enough pods count: these ones."""

    pods: tuple[PodState, ...]


@dataclass(frozen=True)
class PoolWait:
    """Not yet: ask again later. `reason` says how far the pool is."""

    num_ready: int
    reason: str


@dataclass(frozen=True)
class PoolTimedOut:
    """The timeout passed without enough pods: give up."""

    num_ready: int
    reason: str


PoolDecision = PoolReady | PoolWait | PoolTimedOut


def ready_pods(pods: Sequence[PodState]) -> tuple[PodState, ...]:
    """The pods that count (Ready, not terminating), by name."""
    return tuple(sorted((p for p in pods if p.is_ready and not p.is_terminating), key=_name))


def judge_pool(
    pods: Sequence[PodState], *, num_wanted: int, waited_s: float, timeout_s: float
) -> PoolDecision:
    """Whether a pool asked for `num_wanted` pods is ready, after `waited_s` of a wait allowed
    `timeout_s` (seconds)."""
    if num_wanted < 1:
        raise ValueError("a pool to wait for needs at least 1 pod")
    ready = ready_pods(pods)
    if len(ready) >= num_wanted:
        return PoolReady(ready)
    pending = sorted(p.name for p in pods if p not in ready and not p.is_terminating)
    reason = f"{len(ready)} of {num_wanted} pods Ready"
    if pending:
        reason += f" (not Ready: {', '.join(pending)})"
    if waited_s >= timeout_s:
        return PoolTimedOut(len(ready), f"{reason} after {timeout_s:g}s")
    return PoolWait(len(ready), reason)


def metrics_url(pod: PodState) -> str:
    """`http://<pod IP>:<metrics port>/metrics`. Raises ClusterError for a pod without an IP or
    a metrics port: a ready worker always has both, so either means a misconfigured pool."""
    if pod.ip is None:
        raise ClusterError(f"pod {pod.name} has no IP yet")
    if pod.metrics_port is None:
        raise ClusterError(f"pod {pod.name} declares no container port named {METRICS_PORT_NAME!r}")
    host = f"[{pod.ip}]" if ipaddress.ip_address(pod.ip).version == 6 else pod.ip
    return f"http://{host}:{pod.metrics_port}/metrics"


def metrics_urls(pods: Sequence[PodState]) -> tuple[str, ...]:
    return tuple(metrics_url(pod) for pod in sorted(pods, key=_name))


def _name(pod: PodState) -> str:
    return pod.name
