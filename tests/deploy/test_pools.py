"""Worker pools and a model repository from a volume, rendered and checked without a cluster.

`deploy/k8s/overlays/pools` (rendered with `kubectl kustomize`) and the Helm chart with
values-prod.yaml + values-pools.yaml (`.tools/helm template`) both run one worker Deployment
per model group, with the repository from the PersistentVolumeClaim `model-repository`. Every
built-in object is validated strictly with kubernetes-validate; ServiceMonitors by hand. Then:
each pool's workers are told their models (WORKER_MODELS, as the worker's own parse_config reads
it), each pool has its own HPA on its own models' queue-wait series, its own PDB, Service and
ServiceMonitor, no selector reaches another pool's pods, the repository volume is mounted where
gateways and workers read it, the pools keep everything else prod has, and the chart agrees
with the overlay. The rendering helpers are test_manifests.py's.
"""

from __future__ import annotations

import json
import tomllib
from typing import Any

import kubernetes_validate
import pytest
from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.metrics import WorkerMetrics
from tests.deploy.test_manifests import (
    CHART_DIR,
    CRD_KINDS,
    K8S_DIR,
    KUBE_VERSION,
    Objects,
    _normalize,
    _pod_view,
    adapter_rules,
    check_prometheus_rule,
    component,
    env_entries,
    exposed_name,
    helm_command,
    load_all,
    main_container,
    of_kind,
    parse_tier_configs,
    pod_labels,
    resolve_env,
    run,
    selects,
    series_metric,
    staged_tls_files,
    volume_sources,
)
from tests.support.processes import REPO_ROOT
from tests.support.tools import venv_tool

pytestmark = pytest.mark.integration

POOLS_VALUES = CHART_DIR / "values-pools.yaml"
#: The label every selector of a pool carries (and nothing outside pools).
POOL = "inference-fabric/pool"
#: The pools both renders define, and the models each one's workers serve.
POOL_MODELS = {"minilm": ["minilm"], "tiny-llama": ["tiny-llama"]}
#: The claim the pools' model repository comes from, and its volume's name in the pods.
REPOSITORY_CLAIM = "model-repository"
REPOSITORY_VOLUME = "model-repository"
#: Each tier that reads the model repository, and the env variable naming where.
REPOSITORY_ENV = {"gateway": "GATEWAY_MODEL_REPOSITORY", "gpu-worker": "WORKER_MODEL_REPOSITORY"}
#: What a pool's worker objects are: one of each per pool.
POOL_KINDS = (
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "ServiceMonitor",
)
#: The pool objects that select pods (or, a ServiceMonitor, Services) by label.
SELECTING = ("Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor")


# -- rendering ---------------------------------------------------------------------------------


def kustomize(overlay: str) -> Objects:
    return load_all(
        run([venv_tool("kubectl"), "kustomize", str(K8S_DIR / "overlays" / overlay)], overlay)
    )


@pytest.fixture(scope="module")
def prod() -> Objects:
    return kustomize("prod")


@pytest.fixture(scope="module")
def pool_renders() -> dict[str, Objects]:
    """The pools overlay, and the chart with values-prod.yaml then values-pools.yaml."""
    return {
        "pools": kustomize("pools"),
        "helm-pools": load_all(run(helm_command("-f", str(POOLS_VALUES)), "helm (pools)")),
    }


# -- object helpers ----------------------------------------------------------------------------


def pool(obj: dict[str, Any]) -> str:
    return obj["metadata"].get("labels", {}).get(POOL, "")


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    """What an object is for, across renders: kind, component, pool ("" outside pools)."""
    return obj["kind"], component(obj), pool(obj)


def by_key(objects: Objects) -> dict[tuple[str, str, str], dict[str, Any]]:
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    for obj in objects:
        assert key(obj) not in found, f"two objects for {key(obj)}"
        found[key(obj)] = obj
    return found


def workers(objects: Objects) -> dict[str, dict[str, Any]]:
    """The worker Deployments by pool."""
    return {pool(d): d for d in of_kind(objects, "Deployment") if component(d) == "gpu-worker"}


def pods_selected(objects: Objects, match_labels: dict[str, str]) -> list[str]:
    """Names of the Deployments whose pods `match_labels` selects."""
    return [
        d["metadata"]["name"]
        for d in of_kind(objects, "Deployment")
        if selects(match_labels, pod_labels(d))
    ]


def selector_labels(obj: dict[str, Any]) -> dict[str, str]:
    """The pod (or, for a ServiceMonitor, Service) labels an object selects by."""
    spec = obj["spec"]
    if obj["kind"] == "Service":
        return dict(spec["selector"])
    return dict(spec["selector"]["matchLabels"])


def repository_mount(deployment: dict[str, Any]) -> dict[str, Any]:
    (mount,) = [
        m
        for m in main_container(deployment).get("volumeMounts", [])
        if m["name"] == REPOSITORY_VOLUME
    ]
    return mount


def hpa_metric_selector(hpa: dict[str, Any]) -> tuple[str, list[str]]:
    """(label, values admitted) of the worker HPA's queue-wait metric selector (its first
    metric): one `In` expression."""
    metric = hpa["spec"]["metrics"][0]
    selector = metric["pods"]["metric"]["selector"]
    assert set(selector) == {"matchExpressions"}, selector
    (expression,) = selector["matchExpressions"]
    assert expression["operator"] == "In", expression
    return expression["key"], list(expression["values"])


# -- the tests ---------------------------------------------------------------------------------


def test_pool_renders_validate_strictly(pool_renders: dict[str, Objects]) -> None:
    errors = []
    for name, objects in pool_renders.items():
        for obj in objects:
            if obj["kind"] == "PrometheusRule":
                check_prometheus_rule(obj)
                continue
            if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
                # As test_manifests checks them: exactly one Service, on its metrics port.
                services = [
                    s
                    for s in of_kind(objects, "Service")
                    if selects(selector_labels(obj), s["metadata"].get("labels", {}))
                ]
                assert len(services) == 1, f"{name}: {obj['metadata']['name']} selects {services}"
                ports = {p["name"] for p in services[0]["spec"]["ports"]}
                assert [e["port"] for e in obj["spec"]["endpoints"]] == ["metrics"]
                assert "metrics" in ports
                continue
            try:
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(p) for p in error.path)
                errors.append(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {path}: {error}")
    assert not errors, "\n".join(errors)


def test_each_pool_has_a_deployment_hpa_pdb_service_and_monitor_of_its_own(
    pool_renders: dict[str, Objects],
) -> None:
    for name, objects in pool_renders.items():
        found = by_key(objects)
        for kind in POOL_KINDS:
            pools = {p for k, c, p in found if k == kind and c == "gpu-worker"}
            assert pools == set(POOL_MODELS), f"{name}: {kind} for pools {pools}"
        # prod's single worker is gone, but for the NetworkPolicy covering every pool.
        single = [
            o["kind"]
            for o in objects
            if component(o) == "gpu-worker" and not pool(o) and o["kind"] != "NetworkPolicy"
        ]
        assert not single, f"{name}: prod's single worker left {single}"
        for pool_name, deployment in workers(objects).items():
            prefix = deployment["metadata"]["name"]
            assert prefix.endswith(f"gpu-worker-{pool_name}"), prefix
            for kind in POOL_KINDS:
                obj = found[(kind, "gpu-worker", pool_name)]
                assert obj["metadata"]["name"] == prefix, f"{name}: {kind} named apart"


@pytest.fixture(scope="module")
def pool_configs(
    pool_renders: dict[str, Objects], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Each pool worker's and each gateway's config, parsed by their own parse_config from the
    rendered env (TLS files staged, as test_manifests does)."""
    tls_root = tmp_path_factory.mktemp("pools-tls-root")
    requests = {}
    for name, objects in pool_renders.items():
        tiers = {
            f"{name}/gateway": ("gateway", by_key(objects)[("Deployment", "gateway", "")]),
            **{f"{name}/{p}": ("gpu-worker", d) for p, d in workers(objects).items()},
        }
        for label, (tier, deployment) in tiers.items():
            env = resolve_env(
                main_container(deployment),
                objects,
                pod_name=f"{deployment['metadata']['name']}-7d9f-abcde",
                pod_ip="10.1.2.3",
            )
            requests[label] = (tier, staged_tls_files(env, tls_root))
    return parse_tier_configs(requests)


def test_each_pool_serves_its_models_from_the_mounted_repository(
    pool_renders: dict[str, Objects], pool_configs: dict[str, dict[str, Any]]
) -> None:
    for name, objects in pool_renders.items():
        gateway = by_key(objects)[("Deployment", "gateway", "")]
        readers = [("gateway", gateway), *(("gpu-worker", d) for d in workers(objects).values())]
        for tier, deployment in readers:
            where = f"{name}/{deployment['metadata']['name']}"
            # The repository volume: the claim, read-only, where the tier reads its repository.
            volume = volume_sources(deployment)[REPOSITORY_VOLUME]
            assert volume["persistentVolumeClaim"] == {
                "claimName": REPOSITORY_CLAIM,
                "readOnly": True,
            }, where
            mount = repository_mount(deployment)
            assert mount.get("readOnly") is True, where
            read_at = env_entries(main_container(deployment))[REPOSITORY_ENV[tier]]["value"]
            assert mount["mountPath"] == read_at, f"{where}: mounted apart from {read_at}"
        assert (
            pool_configs[f"{name}/gateway"]["model_repository"]
            == repository_mount(gateway)["mountPath"]
        )
        for pool_name, deployment in workers(objects).items():
            models = POOL_MODELS[pool_name]
            env = env_entries(main_container(deployment))
            assert env["WORKER_MODELS"]["value"] == ",".join(models), pool_name
            config = pool_configs[f"{name}/{pool_name}"]
            assert config["models"] == models, f"{name}/{pool_name}: the worker reads {config}"
            assert config["model_repository"] == repository_mount(deployment)["mountPath"]


def waiting_signal(models: list[str]) -> tuple[str, set[str]]:
    """The histogram a pool of `models` scales on, and the labels of its series (from the
    metrics classes): queue wait for fixed-cost models, time to first token for generation
    models, which have no batching queue and so no queue-wait series at all."""
    kinds = {model_config(model)["kind"] for model in models}
    if kinds == {"generation"}:
        registry = CollectorRegistry()
        GenerationMetrics(registry).ttft_seconds.labels("m", "1").observe(0)
        name = names.GENERATION_TTFT_SECONDS
    else:
        assert "generation" not in kinds, f"a pool mixes generation and fixed-cost: {models}"
        worker = WorkerMetrics(CollectorRegistry())
        worker.queue_wait_seconds.labels("m", "1").observe(0)
        registry, name = worker.registry, names.WORKER_QUEUE_WAIT_SECONDS
    (family,) = [f for f in registry.collect() if f.name == name]
    return name, {label for sample in family.samples for label in sample.labels} - {"le"}


def model_config(model: str) -> dict[str, Any]:
    return tomllib.loads((REPO_ROOT / "models" / model / "config.toml").read_text())


def test_each_pool_scales_on_its_own_models_waiting(pool_renders: dict[str, Objects]) -> None:
    rules = {exposed_name(rule): rule for rule in adapter_rules()}
    for name, objects in pool_renders.items():
        found = by_key(objects)
        selected_models: list[str] = []
        for pool_name, deployment in workers(objects).items():
            hpa = found[("HorizontalPodAutoscaler", "gpu-worker", pool_name)]
            spec = hpa["spec"]
            where = f"{name}/{hpa['metadata']['name']}"
            assert spec["scaleTargetRef"] == {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": deployment["metadata"]["name"],
            }, where
            assert "replicas" not in deployment["spec"], f"{where}: the HPA owns the count"
            assert 2 <= spec["minReplicas"] < spec["maxReplicas"], where
            metric, duty_cycle = spec["metrics"]
            assert metric["type"] == "Pods", where
            rule = rules[metric["pods"]["metric"]["name"]]
            waiting, waiting_labels = waiting_signal(POOL_MODELS[pool_name])
            assert series_metric(rule) == f"{waiting}_bucket", where
            # And the device's duty cycle: the pool's pods serve only its models, so their
            # devices' busy time needs no selector.
            assert duty_cycle["type"] == "Pods", where
            assert "selector" not in duty_cycle["pods"]["metric"], where
            duty_rule = rules[duty_cycle["pods"]["metric"]["name"]]
            assert series_metric(duty_rule) == names.WORKER_DEVICE_BUSY_SECONDS_TOTAL
            # A share of time, at most 1, however many models time overlapping spans.
            duty_query = duty_rule["metricsQuery"].strip()
            assert duty_query.startswith("clamp_max(") and duty_query.endswith(", 1)"), where
            # The metric selector narrows the series to the pool's models: prometheus-adapter
            # adds it to <<.LabelMatchers>>, which every series the query reads must carry, and
            # its label must be one the worker puts on the series.
            label, models = hpa_metric_selector(hpa)
            assert label == "model" and label in waiting_labels, where
            assert models == POOL_MODELS[pool_name], where
            selected_models += models
            query = rule["metricsQuery"]
            assert query.count("<<.Series>>") == query.count("<<.Series>>{<<.LabelMatchers>>")
            behavior = spec["behavior"]
            assert behavior["scaleUp"]["stabilizationWindowSeconds"] <= 60, where
            assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300, where
        assert len(selected_models) == len(set(selected_models)), f"{name}: series shared"
        maxima = {
            p: found[("HorizontalPodAutoscaler", "gpu-worker", p)]["spec"]["maxReplicas"]
            for p in POOL_MODELS
        }
        assert maxima == {"minilm": 8, "tiny-llama": 16}, f"{name}: per-pool bounds {maxima}"


def test_no_pool_selector_reaches_another_pools_pods(pool_renders: dict[str, Objects]) -> None:
    for name, objects in pool_renders.items():
        found = workers(objects)
        for obj in objects:
            if component(obj) != "gpu-worker" or not pool(obj) or obj["kind"] not in SELECTING:
                continue
            own = found[pool(obj)]["metadata"]["name"]
            labels = selector_labels(obj)
            assert labels.get(POOL) == pool(obj), f"{name}: {obj['kind']} lacks the pool label"
            if obj["kind"] == "ServiceMonitor":
                services = [
                    s["metadata"]["name"]
                    for s in of_kind(objects, "Service")
                    if selects(labels, s["metadata"].get("labels", {}))
                ]
                assert services == [own], f"{name}: {obj['metadata']['name']} scrapes {services}"
            else:
                selected = pods_selected(objects, labels)
                assert selected == [own], f"{name}: {obj['kind']} {own} selects {selected}"
        # Every worker pod is still one of the tier's: isolated by the worker NetworkPolicy,
        # allowed to reach Redis.
        policies = {component(p): p["spec"] for p in of_kind(objects, "NetworkPolicy")}
        isolating = policies["gpu-worker"]["podSelector"]["matchLabels"]
        redis_peers = [
            peer["podSelector"]["matchLabels"]
            for rule in policies["redis"]["ingress"]
            for peer in rule["from"]
        ]
        for deployment in found.values():
            assert selects(isolating, pod_labels(deployment)), name
            assert any(selects(peer, pod_labels(deployment)) for peer in redis_peers), name


def without_pool_changes(view: dict[str, Any]) -> dict[str, Any]:
    """A worker's pod view less what a pool changes: WORKER_MODELS, the repository volume, and
    its pool label in the selectors (its spread over nodes)."""
    view = json.loads(json.dumps(view))
    for spread in view["pod"].get("topologySpreadConstraints", []):
        spread["labelSelector"]["matchLabels"].pop(POOL, None)
    volumes = view["pod"]["volumes"]
    view["pod"]["volumes"] = [v for v in volumes if json.loads(v)["name"] != REPOSITORY_VOLUME]
    for container in view["containers"]:
        container["env"] = [e for e in container["env"] if e[0] != "WORKER_MODELS"]
        mounts = container["volumeMounts"]
        container["volumeMounts"] = [
            m for m in mounts if json.loads(m)["name"] != REPOSITORY_VOLUME
        ]
    return view


def test_pools_keep_everything_else_prod_has(
    pool_renders: dict[str, Objects], prod: Objects
) -> None:
    """A pool's worker is prod's (GPU, TLS, probes, drain) serving fewer models; every other
    object is prod's, the gateway but for the repository volume."""
    ours, theirs = by_key(pool_renders["pools"]), by_key(prod)
    prod_worker = without_pool_changes(_pod_view(theirs[("Deployment", "gpu-worker", "")]))
    for pool_name, deployment in workers(pool_renders["pools"]).items():
        assert without_pool_changes(_pod_view(deployment)) == prod_worker, pool_name
    for obj_key, obj in theirs.items():
        if obj_key[1] == "gpu-worker" and obj_key[0] != "NetworkPolicy":
            continue
        if obj_key == ("Deployment", "gateway", ""):
            assert without_pool_changes(_pod_view(ours[obj_key])) == without_pool_changes(
                _pod_view(obj)
            )
            continue
        assert ours[obj_key] == obj, f"pools changed prod's {obj_key}"


def test_helm_chart_renders_the_pools_overlay(pool_renders: dict[str, Objects]) -> None:
    kustomized, helm = pool_renders["pools"], pool_renders["helm-pools"]

    def keys(objects: Objects) -> list[tuple[str, str, str]]:
        return sorted(
            (k, c if k != "ConfigMap" else "config", p)
            for k, c, p in map(key, objects)
            if k != "Namespace"
        )

    assert keys(helm) == keys(kustomized)
    ours, theirs = by_key(kustomized), by_key(helm)
    for obj_key, obj in ours.items():
        if obj_key[0] == "Deployment":
            assert _pod_view(obj) == _pod_view(theirs[obj_key]), obj_key
        elif obj_key[0] in {"Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"}:
            assert _normalize(obj["spec"]) == _normalize(theirs[obj_key]["spec"]), obj_key
        elif obj_key[0] == "HorizontalPodAutoscaler":
            spec, other = dict(obj["spec"]), dict(theirs[obj_key]["spec"])
            spec.pop("scaleTargetRef"), other.pop("scaleTargetRef")
            assert _normalize(spec) == _normalize(other), obj_key
