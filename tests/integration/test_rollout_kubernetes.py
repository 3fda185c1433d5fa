"""The rollout controller's Kubernetes side (services.rollout.cluster) against a FAKE API server,
not a cluster: an in-process HTTP server on 127.0.0.1 that answers the few endpoints the
official `kubernetes` client calls here (a Deployment, its scale subresource, pods by label
selector) with the client's own models (`V1Deployment`, `V1Scale`, `V1PodList`) serialized by
its `ApiClient`, so the JSON is shaped as the real API's and parsed by the real client.

What the fake does NOT do: authentication, RBAC, watches, resource versions, real controllers.
A PATCH of the scale makes or drops pods at once (a crude stand-in for the ReplicaSet
controller), and they turn Ready only when a test says so. Scheduling, probes and the API
server's own validation are not exercised; that needs a real cluster (kind), which these
tests do not have.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes.client import (
    ApiClient,
    V1Container,
    V1ContainerPort,
    V1Deployment,
    V1DeploymentSpec,
    V1LabelSelector,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodSpec,
    V1PodStatus,
    V1PodTemplateSpec,
    V1Scale,
    V1ScaleSpec,
    V1ScaleStatus,
    V1Status,
)
from prometheus_client import CollectorRegistry

from services.common.model_repository import load_repository
from services.common.model_routing import ModelRouting
from services.common.registry_schema import connect
from services.rollout.__main__ import main
from services.rollout.cluster import CanaryPool, Deployments, api_client
from services.rollout.controller import CanaryRollout, RolloutMetrics
from services.rollout.health import Snapshot
from services.rollout.policy import Decision, Plan
from services.rollout.pool import ClusterError, PoolConfig
from services.rollout.routing_store import RoutingStore
from tests.support.models import write_versioned_affine_model
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration

NAMESPACE = "fabric"
CANARY, STABLE = "gpu-worker-canary", "gpu-worker"
_SERIALIZER = ApiClient()


@dataclass
class Recorded:
    method: str
    path: str
    content_type: str | None
    body: Any


@dataclass
class FakeApiServer:
    """A fake Kubernetes API server, not a cluster (see the module's docstring)."""

    url: str = ""
    deployments: dict[str, V1Deployment] = field(default_factory=dict)
    pods: dict[str, V1Pod] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Set on every pod listing, for a test to await "the controller has looked".
    pods_listed: threading.Event = field(default_factory=threading.Event)

    def add_deployment(self, name: str, *, num_replicas: int, is_ready: bool = False) -> None:
        labels = {"app.kubernetes.io/name": "inference-fabric", "pool": name}
        container = V1Container(
            name="gpu-worker",
            image="inference-fabric-worker",
            ports=[
                V1ContainerPort(name="grpc", container_port=8201),
                V1ContainerPort(name="metrics", container_port=8202),
            ],
        )
        self.deployments[name] = V1Deployment(
            api_version="apps/v1",
            kind="Deployment",
            metadata=V1ObjectMeta(name=name, namespace=NAMESPACE),
            spec=V1DeploymentSpec(
                replicas=num_replicas,
                selector=V1LabelSelector(match_labels=labels),
                template=V1PodTemplateSpec(
                    metadata=V1ObjectMeta(labels=labels), spec=V1PodSpec(containers=[container])
                ),
            ),
        )
        self._reconcile(name)
        self.set_ready(name, is_ready=is_ready)

    def set_ready(self, deployment: str, *, is_ready: bool = True) -> None:
        with self.lock:
            for pod in self._pods_of(deployment):
                assert pod.status is not None
                pod.status.conditions = [
                    V1PodCondition(type="Ready", status="True" if is_ready else "False")
                ]

    def patches(self) -> list[Recorded]:
        with self.lock:
            return [r for r in self.requests if r.method == "PATCH"]

    def handle(self, method: str, raw_path: str, content_type: str | None, body: Any) -> Any:
        """(status, the object to answer) of one request."""
        parts = urlsplit(raw_path)
        path = parts.path.strip("/").split("/")
        with self.lock:
            self.requests.append(Recorded(method, parts.path, content_type, body))
            match method, path:
                case "GET", ["api", "v1", "namespaces", _, "pods"]:
                    selector = parse_qs(parts.query).get("labelSelector", [""])[0]
                    answer = self._list_pods(selector)
                    self.pods_listed.set()
                    return answer
                case "GET", ["apis", "apps", "v1", "namespaces", _, "deployments", name]:
                    return self.deployments.get(name) or _not_found(name)
                case "GET", ["apis", "apps", "v1", "namespaces", _, "deployments", name, "scale"]:
                    return self._scale(name)
                case "PATCH", ["apis", "apps", "v1", "namespaces", _, "deployments", name, "scale"]:
                    if name not in self.deployments:
                        return _not_found(name)
                    if content_type not in _OBJECT_PATCHES or not isinstance(body, dict):
                        return 415, _status(415, f"unsupported patch {content_type}")
                    spec = self.deployments[name].spec
                    assert spec is not None
                    spec.replicas = int(body["spec"]["replicas"])
                    self._reconcile(name)
                    return self._scale(name)
            return 404, _status(404, f"the fake does not serve {method} {parts.path}")

    def _scale(self, name: str) -> Any:
        deployment = self.deployments.get(name)
        if deployment is None or deployment.spec is None:
            return _not_found(name)
        return V1Scale(
            api_version="autoscaling/v1",
            kind="Scale",
            metadata=V1ObjectMeta(name=name, namespace=NAMESPACE),
            spec=V1ScaleSpec(replicas=deployment.spec.replicas),
            status=V1ScaleStatus(replicas=len(self._pods_of(name))),
        )

    def _list_pods(self, selector: str) -> Any:
        wanted = {}
        for term in selector.split(","):
            key, sep, value = term.partition("=")
            if not sep or "!" in key or " " in term:
                return 400, _status(400, f"the fake takes only key=value selectors: {term!r}")
            wanted[key] = value
        items = [
            pod
            for pod in self.pods.values()
            if pod.metadata is not None and wanted.items() <= (pod.metadata.labels or {}).items()
        ]
        return V1PodList(api_version="v1", kind="PodList", items=items)

    def _pods_of(self, deployment: str) -> list[V1Pod]:
        return [p for name, p in self.pods.items() if name.startswith(f"{deployment}-")]

    def _reconcile(self, name: str) -> None:
        """Makes the pods match the replica count at once (new pods not Ready)."""
        deployment = self.deployments[name]
        assert deployment.spec is not None and deployment.spec.template.metadata is not None
        num_replicas = deployment.spec.replicas or 0
        subnet = list(self.deployments).index(name) + 1
        for index in range(max(num_replicas, len(self._pods_of(name)))):
            pod_name = f"{name}-{index}"
            if index >= num_replicas:
                self.pods.pop(pod_name, None)
            elif pod_name not in self.pods:
                self.pods[pod_name] = V1Pod(
                    api_version="v1",
                    kind="Pod",
                    metadata=V1ObjectMeta(
                        name=pod_name,
                        namespace=NAMESPACE,
                        labels=dict(deployment.spec.template.metadata.labels or {}),
                    ),
                    spec=deployment.spec.template.spec,
                    status=V1PodStatus(
                        phase="Running",
                        pod_ip=f"10.0.{subnet}.{index + 10}",
                        conditions=[V1PodCondition(type="Ready", status="False")],
                    ),
                )


#: Patch types the API server takes for an object (a json-patch+json body is a list).
_OBJECT_PATCHES = {"application/merge-patch+json", "application/strategic-merge-patch+json"}


def _status(code: int, message: str) -> V1Status:
    reason = {404: "NotFound", 415: "UnsupportedMediaType"}.get(code, "BadRequest")
    return V1Status(
        api_version="v1", kind="Status", status="Failure", message=message, reason=reason, code=code
    )


def _not_found(name: str) -> tuple[int, V1Status]:
    return 404, _status(404, f'deployments.apps "{name}" not found')


def _handler(fake: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            answer = fake.handle(method, self.path, self.headers.get("Content-Type"), body)
            code, obj = answer if isinstance(answer, tuple) else (200, answer)
            data = json.dumps(_SERIALIZER.sanitize_for_serialization(obj)).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_PATCH(self) -> None:
            self._answer("PATCH")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def pools(fake_api: FakeApiServer) -> FakeApiServer:
    """Stable with 2 Ready pods; the canary pool at 0 replicas."""
    fake_api.add_deployment(STABLE, num_replicas=2, is_ready=True)
    fake_api.add_deployment(CANARY, num_replicas=0)
    return fake_api


def make_pool(
    fake: FakeApiServer, registry: CollectorRegistry | None = None, **config: Any
) -> tuple[CanaryPool, ApiClient]:
    config = {"namespace": NAMESPACE, "canary_deployment": CANARY, "poll_period_s": 0.01} | config
    api = api_client(fake.url)
    metrics = RolloutMetrics(registry or CollectorRegistry())
    return CanaryPool(Deployments(api, NAMESPACE), PoolConfig(**config), metrics), api


STABLE_URLS = ("http://10.0.1.10:8202/metrics", "http://10.0.1.11:8202/metrics")
CANARY_URLS = ("http://10.0.2.10:8202/metrics", "http://10.0.2.11:8202/metrics")


async def test_scaling_reaches_the_api_as_a_merge_patch_of_the_replicas(
    pools: FakeApiServer,
) -> None:
    with api_client(pools.url) as api:
        deployments = Deployments(api, NAMESPACE)
        await deployments.scale(CANARY, 3)
        assert await deployments.replicas(CANARY) == 3

    (patch,) = pools.patches()
    assert patch.path == f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{CANARY}/scale"
    assert patch.content_type == "application/merge-patch+json"
    assert patch.body == {"spec": {"replicas": 3}}


async def test_the_pool_is_scaled_then_waited_for_until_its_pods_are_ready(
    pools: FakeApiServer,
) -> None:
    registry = CollectorRegistry()
    pool, api = make_pool(
        pools, registry, stable_deployment=STABLE, num_canary_replicas=2, ready_timeout_s=60
    )
    with api:
        preparing = asyncio.create_task(pool.prepare())
        assert await asyncio.to_thread(pools.pods_listed.wait, 30)
        assert not preparing.done(), "ready before its pods were"
        pools.set_ready(CANARY)
        urls = await asyncio.wait_for(preparing, 30)

    assert [p.body for p in pools.patches()] == [{"spec": {"replicas": 2}}]
    # Discovered from the pods' IPs and their container port named `metrics`.
    assert urls == CANARY_URLS + STABLE_URLS
    assert registry.get_sample_value(
        "inference_rollout_canary_replicas", {"deployment": CANARY}
    ) == 2  # fmt: skip
    assert registry.get_sample_value(
        "inference_rollout_pool_ready_pods", {"deployment": CANARY}
    ) == 2  # fmt: skip


async def test_a_pool_that_never_gets_ready_times_out_and_says_why(pools: FakeApiServer) -> None:
    pool, api = make_pool(pools, num_canary_replicas=2, ready_timeout_s=0.2)
    with api, pytest.raises(ClusterError) as raised:
        await pool.prepare()

    message = str(raised.value)
    assert f"canary pool {NAMESPACE}/{CANARY}: 0 of 2 pods Ready" in message
    assert f"not Ready: {CANARY}-0, {CANARY}-1" in message and "after 0.2s" in message


async def test_an_api_error_names_the_call_and_the_api_s_message(pools: FakeApiServer) -> None:
    pool, api = make_pool(pools, canary_deployment="no-such-pool", num_canary_replicas=1)
    with api, pytest.raises(ClusterError) as raised:
        await pool.prepare()

    assert str(raised.value) == (
        f'get scale of deployment {NAMESPACE}/no-such-pool: 404 deployments.apps "no-such-pool"'
        " not found"
    )


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    repository = tmp_path / "repo"
    write_versioned_affine_model(repository, "affine", versions=(1, 2))
    return repository


def failing_canary(calls: list[Sequence[str]]) -> Any:
    """A scrape whose canary (version 2) fails half its calls; records the endpoints asked."""

    async def scrape(urls: Sequence[str]) -> Snapshot:
        calls.append(tuple(urls))
        n = 100.0 * len(calls)
        return [{"1": {"code:OK": n}, "2": {"code:OK": n, "code:INTERNAL": n}}]

    return scrape


async def no_wait(_: float) -> None:
    pass


async def test_a_rollback_scales_the_canary_pool_back_to_zero(
    pools: FakeApiServer, redis_server: RedisServer, repository: Path
) -> None:
    client = connect(redis_server.url, timeout_s=5.0)
    store = RoutingStore(client, "fabric", load_repository(repository))
    await store.change("affine", lambda _: ModelRouting({"stable": 1}, {"stable": 1.0}))
    pool, api = make_pool(
        pools, stable_deployment=STABLE, num_canary_replicas=2, is_scaled_down_on_rollback=True
    )
    scraped: list[Sequence[str]] = []
    rollout = CanaryRollout(
        store,
        "affine",
        2,
        Plan(steps=(50.0, 100.0), hold_s=0.0, min_requests=10),
        scrape=failing_canary(scraped),
        metrics=RolloutMetrics(CollectorRegistry()),
        pool=pool,
        check_period_s=1.0,  # not slept: `no_wait`
        sleep=no_wait,
    )
    try:
        with api:
            running = asyncio.create_task(rollout.run())
            assert await asyncio.to_thread(pools.pods_listed.wait, 30)
            pools.set_ready(CANARY)
            decision = await asyncio.wait_for(running, 30)
        routing = (await store.show())["affine"]
    finally:
        await client.aclose()

    assert decision is Decision.ROLLBACK
    assert [p.body["spec"]["replicas"] for p in pools.patches()] == [2, 0]
    assert scraped and all(urls == CANARY_URLS + STABLE_URLS for urls in scraped)
    assert routing.traffic == {"stable": 100.0, "canary": 0.0}


async def test_an_unknown_canary_version_is_refused_before_the_pool_is_touched(
    pools: FakeApiServer, redis_server: RedisServer, repository: Path
) -> None:
    client = connect(redis_server.url, timeout_s=5.0)
    store = RoutingStore(client, "fabric", load_repository(repository))
    await store.change("affine", lambda _: ModelRouting({"stable": 1}, {"stable": 1.0}))
    pool, api = make_pool(pools, num_canary_replicas=2)
    rollout = CanaryRollout(
        store,
        "affine",
        7,
        Plan(),
        scrape=failing_canary([]),
        metrics=RolloutMetrics(CollectorRegistry()),
        pool=pool,
    )
    try:
        with api, pytest.raises(ValueError, match="has no version 7"):
            await rollout.run()
    finally:
        await client.aclose()

    assert pools.requests == []


def test_dry_run_prints_the_scale_it_would_do_and_changes_nothing(
    pools: FakeApiServer,
    redis_server: RedisServer,
    repository: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main([
        "--redis-url", redis_server.url, "--model-repository", str(repository),
        "canary", "affine", "--version", "2", "--dry-run", "--kube-api-url", pools.url,
        "--namespace", NAMESPACE, "--canary-deployment", CANARY, "--canary-replicas", "2",
        "--stable-deployment", STABLE, "--scale-down-on-rollback",
    ])  # fmt: skip

    out = capsys.readouterr().out
    assert status == 0
    assert "step 0: canary at 1% for 60s" in out
    assert (
        f"canary pool {NAMESPACE}/{CANARY}: would scale from 0 to 2 replicas, then wait up to"
        " 600s for 2 Ready pods"
    ) in out
    assert f"stable pool {NAMESPACE}/{STABLE}: 2 Ready pods now; metrics at" in out
    assert all(url in out for url in STABLE_URLS)
    assert f"on rollback: scale {NAMESPACE}/{CANARY} to 0 replicas" in out
    assert pools.patches() == []
    assert {r.method for r in pools.requests} == {"GET"}
