"""The rollout's Kubernetes side, through the official `kubernetes` client: scale the canary
worker pool's Deployment, wait for its pods to be Ready, and find each serving pod's metrics
endpoint (its IP and the container port named `metrics`). Weights stay in Redis
(services.rollout.routing_store); what counts as ready is services.rollout.pool's rule.

Thin I/O: `Deployments` makes the API calls (the client's typed objects: `V1Scale`, `V1Pod`,
...) and converts pods once into `PodState`; `CanaryPool` runs scale -> wait -> discover and the
scale-down after a rollback. The client is synchronous (urllib3), so each call runs in a thread.

Needs RBAC on the pool's namespace: `get`/`patch` on `deployments/scale`, `get` on
`deployments`, `list` on `pods`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import urllib3.exceptions
from kubernetes import client, config
from kubernetes.client import (
    ApiClient,
    AppsV1Api,
    CoreV1Api,
    V1LabelSelector,
    V1Pod,
    V1Scale,
    V1ScaleSpec,
)
from kubernetes.client.exceptions import ApiException

from services.rollout.controller import RolloutMetrics
from services.rollout.pool import (
    METRICS_PORT_NAME,
    ClusterError,
    PodState,
    PoolConfig,
    PoolReady,
    PoolTimedOut,
    judge_pool,
    metrics_urls,
    ready_pods,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A scale is a JSON merge patch of `spec.replicas` (what `kubectl scale` sends). Named because
#: newer clients otherwise pick `json-patch+json`, which the API server rejects for an object.
_MERGE_PATCH = "application/merge-patch+json"


def api_client(kube_api_url: str | None) -> ApiClient:
    """A client for `kube_api_url` as given (no credentials: `kubectl proxy`, or a test's fake
    API server); else the pod's service account in a cluster; else the kubeconfig
    ($KUBECONFIG or ~/.kube/config, current context). Called once, from __main__."""
    configuration = client.Configuration()
    if kube_api_url is not None:
        configuration.host = kube_api_url.rstrip("/")
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            try:
                config.load_kube_config(client_configuration=configuration)
            except config.ConfigException as error:
                raise ClusterError(f"not in a pod, and no usable kubeconfig: {error}") from error
    return ApiClient(configuration)


def label_selector(selector: V1LabelSelector | None) -> str:
    """A Deployment's selector in the `labelSelector` query syntax. Raises ClusterError for an
    empty one (it would select every pod in the namespace)."""
    labels = (selector.match_labels if selector else None) or {}
    parts = [f"{key}={value}" for key, value in sorted(labels.items())]
    for requirement in (selector.match_expressions if selector else None) or []:
        values = ",".join(requirement.values or [])
        match requirement.operator:
            case "In":
                parts.append(f"{requirement.key} in ({values})")
            case "NotIn":
                parts.append(f"{requirement.key} notin ({values})")
            case "Exists":
                parts.append(requirement.key)
            case "DoesNotExist":
                parts.append(f"!{requirement.key}")
            case operator:
                raise ClusterError(f"unknown label selector operator {operator!r}")
    if not parts:
        raise ClusterError("the Deployment has an empty selector")
    return ",".join(parts)


def pod_state(pod: V1Pod) -> PodState:
    """The rollout's view of one pod of the API."""
    metadata, spec, status = pod.metadata, pod.spec, pod.status
    conditions = (status.conditions if status else None) or []
    ports = [port for c in (spec.containers if spec else []) for port in c.ports or []]
    return PodState(
        name=(metadata.name if metadata else None) or "?",
        ip=status.pod_ip if status else None,
        is_ready=any(c.type == "Ready" and c.status == "True" for c in conditions),
        is_terminating=bool(metadata and metadata.deletion_timestamp),
        metrics_port=next((p.container_port for p in ports if p.name == METRICS_PORT_NAME), None),
    )


class Deployments:
    """The API calls on one namespace's Deployments and their pods. Every failure (an API
    error, an unreachable API server) is a ClusterError naming the call."""

    def __init__(self, api: ApiClient, namespace: str) -> None:
        self.namespace = namespace
        self._apps = AppsV1Api(api)
        self._core = CoreV1Api(api)
        #: Deployment -> its selector query; apps/v1 selectors are immutable, so read once.
        self._selectors: dict[str, str] = {}

    async def replicas(self, deployment: str) -> int:
        """The Deployment's desired replica count (its scale subresource's spec)."""
        scale: V1Scale = await self._call(
            f"get scale of {self._path(deployment)}",
            lambda: self._apps.read_namespaced_deployment_scale(deployment, self.namespace),
        )
        return (scale.spec.replicas if scale.spec else None) or 0

    async def scale(self, deployment: str, num_replicas: int) -> None:
        """Sets the Deployment's desired replica count (a PATCH of its scale subresource)."""
        body = V1Scale(spec=V1ScaleSpec(replicas=num_replicas))
        await self._call(
            f"scale {self._path(deployment)} to {num_replicas}",
            lambda: self._apps.patch_namespaced_deployment_scale(
                deployment, self.namespace, body, _content_type=_MERGE_PATCH
            ),
        )

    async def pods(self, deployment: str) -> list[PodState]:
        """The pods the Deployment's selector matches (every ReplicaSet's, as `kubectl rollout
        status` sees them)."""
        if deployment not in self._selectors:
            found = await self._call(
                f"get {self._path(deployment)}",
                lambda: self._apps.read_namespaced_deployment(deployment, self.namespace),
            )
            self._selectors[deployment] = label_selector(
                found.spec.selector if found.spec else None
            )
        selector = self._selectors[deployment]
        listed = await self._call(
            f"list pods of {self._path(deployment)} ({selector})",
            lambda: self._core.list_namespaced_pod(self.namespace, label_selector=selector),
        )
        return [pod_state(pod) for pod in listed.items]

    def _path(self, deployment: str) -> str:
        return f"deployment {self.namespace}/{deployment}"

    async def _call(self, what: str, call: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(call)
        except ApiException as error:
            raise ClusterError(f"{what}: {error.status} {_message(error)}") from error
        except urllib3.exceptions.HTTPError as error:
            raise ClusterError(f"{what}: API server unreachable: {error}") from error


def _message(error: ApiException) -> str:
    """The API's Status message when the body is one, else the HTTP reason."""
    try:
        return str(json.loads(error.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(error.reason)


class CanaryPool:
    """Makes the canary pool ready before the first traffic step, and tears it down after a
    rollback when asked. Logs every step; exports the replicas it set and the Ready pods it saw
    (`RolloutMetrics`)."""

    def __init__(
        self,
        deployments: Deployments,
        pool: PoolConfig,
        metrics: RolloutMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._deployments = deployments
        self._pool = pool
        self._metrics = metrics
        self._clock = clock
        self._sleep = sleep

    async def prepare(self) -> tuple[str, ...]:
        """Scales the canary pool (when asked), waits for its pods to be Ready, and returns the
        metrics endpoints of its ready pods and of stable's. Raises ClusterError if the pool is
        not ready within the timeout, or the API refuses."""
        canary = self._pool.canary_deployment
        num_wanted = self._pool.num_canary_replicas
        if num_wanted is None:
            num_wanted = await self._deployments.replicas(canary)
            if num_wanted < 1:
                raise ClusterError(f"{self._name(canary)} has 0 replicas: pass --canary-replicas")
        else:
            await self._scale(canary, num_wanted)
        urls = metrics_urls(await self._wait_ready(canary, num_wanted))
        log.info("canary pool %s: metrics at %s", self._name(canary), ", ".join(urls))
        stable = self._pool.stable_deployment
        if stable is not None:
            stable_pods = ready_pods(await self._deployments.pods(stable))
            if not stable_pods:
                raise ClusterError(f"stable pool {self._name(stable)} has no Ready pod")
            stable_urls = metrics_urls(stable_pods)
            log.info("stable pool %s: metrics at %s", self._name(stable), ", ".join(stable_urls))
            urls += stable_urls
        return urls

    async def release(self) -> None:
        """After a rollback: scale the canary pool to 0 if configured to, else leave it."""
        canary = self._pool.canary_deployment
        if self._pool.is_scaled_down_on_rollback:
            await self._scale(canary, 0)
        else:
            log.info(
                "canary pool %s left as it is (no --scale-down-on-rollback)", self._name(canary)
            )

    async def describe(self) -> str:
        """The dry run's text: what `prepare` and `release` would do, from reads only."""
        canary = self._pool.canary_deployment
        num_now = await self._deployments.replicas(canary)
        num_wanted = self._pool.num_canary_replicas
        lines = [
            f"canary pool {self._name(canary)}: "
            + (
                f"would scale from {num_now} to {num_wanted} replicas"
                if num_wanted is not None and num_wanted != num_now
                else f"stays at {num_now} replicas"
            )
            + f", then wait up to {self._pool.ready_timeout_s:g}s for"
            f" {num_now if num_wanted is None else num_wanted} Ready pods",
        ]
        for role, deployment in (("canary", canary), ("stable", self._pool.stable_deployment)):
            if deployment is not None:
                urls = metrics_urls(ready_pods(await self._deployments.pods(deployment)))
                lines.append(
                    f"{role} pool {self._name(deployment)}: {len(urls)} Ready pods now"
                    + (f"; metrics at {', '.join(urls)}" if urls else "")
                )
        lines.append(
            f"on rollback: scale {self._name(canary)} to 0 replicas"
            if self._pool.is_scaled_down_on_rollback
            else f"on rollback: leave {self._name(canary)} as it is"
        )
        return "\n".join(lines)

    async def _scale(self, deployment: str, num_replicas: int) -> None:
        num_before = await self._deployments.replicas(deployment)
        log.info(
            "scaling %s from %d to %d replicas", self._name(deployment), num_before, num_replicas
        )
        await self._deployments.scale(deployment, num_replicas)
        self._metrics.canary_replicas.labels(deployment).set(num_replicas)

    async def _wait_ready(self, deployment: str, num_wanted: int) -> tuple[PodState, ...]:
        started_s = self._clock()
        last_reason = ""
        while True:
            pods = await self._deployments.pods(deployment)
            waited_s = self._clock() - started_s
            decision = judge_pool(
                pods,
                num_wanted=num_wanted,
                waited_s=waited_s,
                timeout_s=self._pool.ready_timeout_s,
            )
            num_ready = (
                len(decision.pods) if isinstance(decision, PoolReady) else decision.num_ready
            )
            self._metrics.pool_ready_pods.labels(deployment).set(num_ready)
            if isinstance(decision, PoolReady):
                log.info(
                    "canary pool %s: %d Ready pods after %.1fs",
                    self._name(deployment), num_ready, waited_s,
                )  # fmt: skip
                return decision.pods
            if isinstance(decision, PoolTimedOut):
                raise ClusterError(f"canary pool {self._name(deployment)}: {decision.reason}")
            if decision.reason != last_reason:
                log.info("canary pool %s: waiting: %s", self._name(deployment), decision.reason)
                last_reason = decision.reason
            await self._sleep(self._pool.poll_period_s)

    def _name(self, deployment: str) -> str:
        return f"{self._deployments.namespace}/{deployment}"
