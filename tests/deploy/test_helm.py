"""The Helm chart's own promises, beyond agreeing with the prod overlay (test_manifests.py):
`helm lint --strict` is clean; the default values install on a vanilla cluster (no Secrets to
create first, no Prometheus Operator, no GPUs, no TLS material); the Secrets the chart makes are
ones the tiers accept; ServiceMonitors only where their CRD is served; no replicas field where
an HPA owns the count; worker pools (workerPools) on a vanilla cluster; the model repository
from a claim or an init container, mounted where the tiers read it; Redis's AOF on a claim sized
and classed by the values (an emptyDir only when asked, with a warning); the job runner with
its own key; values.schema.json refuses a wrong type; NOTES.txt says how to reach the gateway,
waits for each pool and shouts when auth, TLS or Redis persistence is off. (Pools with
values-prod.yaml against the kustomize pools overlay: test_pools.py.)

Rendered with `.tools/helm` (`make .tools/helm`) and validated strictly with kubernetes-validate.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.common.lifecycle import STOP_OVERRUN_S
from services.common.priority import PriorityClass
from services.common.redis_acl import ACL_FILE_NAME, ROLES, acl_lines, password_file_name
from services.gateway.auth import KeyStore
from services.gateway.config import GatewayConfig
from services.router.config import RouterConfig

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "inference-fabric"
PROD_VALUES = CHART_DIR / "values-prod.yaml"
POOLS_VALUES = CHART_DIR / "values-pools.yaml"
HELM = REPO_ROOT / ".tools" / "helm"
KUBE_VERSION = "1.32.0"
RELEASE = "fabric"
MONITORING_API = "monitoring.coreos.com/v1"
#: Deployment component -> the key of its values.
TIER_VALUES = {"gateway": "gateway", "router": "router", "gpu-worker": "worker"}
#: Every role with an image of its own: the tiers and the job runner.
ROLE_VALUES = {**TIER_VALUES, "jobs": "jobs"}

Objects = list[dict[str, Any]]


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    if not HELM.is_file():
        pytest.fail(f"{HELM.relative_to(REPO_ROOT)} is missing: run `make .tools/helm`")
    return subprocess.run(
        [str(HELM), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def render(*extra: str, chart: Path = CHART_DIR) -> Objects:
    result = helm(
        "template", RELEASE, str(chart), "--namespace", "inference-fabric",
        "--kube-version", KUBE_VERSION, *extra,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def of_kind(objects: Objects, kind: str) -> Objects:
    return [o for o in objects if o["kind"] == kind]


def deployments(objects: Objects) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in of_kind(objects, "Deployment")
    }


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(deployment)["containers"]
    return container


def env_values(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def secret_data(objects: Objects, name: str) -> dict[str, str]:
    (secret,) = [s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == name]
    return {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}


def referenced_secrets(objects: Objects) -> set[str]:
    """Every Secret a pod needs: volumes, env and envFrom references, image pull secrets."""
    names: set[str] = set()
    for deployment in [*of_kind(objects, "Deployment"), *of_kind(objects, "StatefulSet")]:
        spec = pod_spec(deployment)
        names.update(v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v)
        names.update(s["name"] for s in spec.get("imagePullSecrets", []))
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    names.add(ref["name"])
            names.update(
                e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e
            )
    return names


def validate_strictly(objects: Objects) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


# -- lint and schema -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values", [(), (PROD_VALUES,), (PROD_VALUES, POOLS_VALUES)], ids=["defaults", "prod", "pools"]
)
def test_helm_lint_strict_is_clean(values: tuple[Path, ...]) -> None:
    extra = [arg for path in values for arg in ("-f", str(path))]
    result = helm("lint", "--strict", str(CHART_DIR), *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"gateway": {"replicas": "two"}}, "gateway.replicas"),
        ({"tls": {"enabled": "yes"}}, "tls.enabled"),
        ({"image": {"repositories": {"worker": 5}}}, "image.repositories.worker"),
        ({"worker": {"gpu": 0.5}}, "worker.gpu"),
        ({"gateway": {"grpcPort": 70000}}, "gateway.grpcPort"),
        ({"registryPrefix": "fab ric"}, "registryPrefix"),
        ({"auth": {"secretName": "gateway-api-keys"}}, "secretName"),
        ({"workerPools": [{"name": "MiniLM", "models": ["minilm"]}]}, "workerPools.0.name"),
        ({"workerPools": [{"name": "minilm", "models": "minilm"}]}, "workerPools.0.models"),
        ({"workerPools": [{"name": "minilm", "models": []}]}, "workerPools.0.models"),
        ({"modelRepository": {"source": "s3"}}, "modelRepository.source"),
        ({"redis": {"appendfsync": "no"}}, "redis.appendfsync"),
        ({"redis": {"persistence": {"size": 2}}}, "redis.persistence.size"),
        ({"jobs": {"replicas": -1}}, "jobs.replicas"),
    ],
    ids=["string-for-int", "string-for-bool", "int-for-string", "fraction-gpu", "port-range",
         "prefix-pattern", "unknown-key", "pool-name-pattern", "string-for-models",
         "pool-without-models", "repository-source", "aof-fsync-off", "unitless-claim-size",
         "negative-runners"],
)  # fmt: skip
def test_schema_refuses_wrong_values(
    values: dict[str, Any], complaint: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(values))
    template = ["template", RELEASE, str(CHART_DIR), "--kube-version", KUBE_VERSION]
    for command in (template, ["lint", "--strict", str(CHART_DIR)]):
        result = helm(*command, "-f", str(bad))
        output = result.stdout + result.stderr
        assert result.returncode != 0, f"{command[0]} accepted {values}"
        assert complaint in output, output


# -- defaults: a vanilla cluster -------------------------------------------------------------------


@pytest.fixture(scope="module")
def defaults() -> Objects:
    return render()


def test_defaults_need_nothing_the_chart_does_not_create(defaults: Objects) -> None:
    created = {s["metadata"]["name"] for s in of_kind(defaults, "Secret")}
    assert referenced_secrets(defaults) <= created, referenced_secrets(defaults) - created
    assert not [o for o in defaults if o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert not of_kind(defaults, "HorizontalPodAutoscaler"), "HPAs need metrics APIs"
    for tier, deployment in deployments(defaults).items():
        assert deployment["spec"]["replicas"] == 1, tier
        spec = pod_spec(deployment)
        assert not spec.get("nodeSelector") and not spec.get("tolerations"), tier
        resources = main_container(deployment)["resources"]
        assert "nvidia.com/gpu" not in {*resources["requests"], *resources["limits"]}, tier
        assert not any(k.endswith(("_TLS_CERT_FILE", "_TLS_KEY_FILE"))
                       for k in env_values(main_container(deployment))), tier  # fmt: skip
    validate_strictly(defaults)


def test_defaults_run_each_role_from_its_own_image(defaults: Objects) -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    images = {tier: main_container(d)["image"] for tier, d in deployments(defaults).items()}
    for tier, key in ROLE_VALUES.items():
        assert images[tier] == f"{values['image']['repositories'][key]}:{chart['appVersion']}"
    assert len({images[tier] for tier in ROLE_VALUES}) == len(ROLE_VALUES)
    prod = deployments(render("-f", str(PROD_VALUES)))
    assert (
        main_container(prod["router"])["image"]
        == "registry.example.com/inference-fabric-router:0.1.0"
    )


def test_chart_made_redis_users_are_the_ones_redis_acl_writes() -> None:
    for prefix in ("fabric", "team-b"):
        objects = render("--set", f"registryPrefix={prefix}")
        data = secret_data(objects, f"{RELEASE}-redis-acl")
        passwords = {role: data[password_file_name(role)] for role in ROLES}
        assert len(set(passwords.values())) == len(ROLES), "one password per role"
        assert all(len(p) >= 32 for p in passwords.values())
        assert data[ACL_FILE_NAME].splitlines() == acl_lines(passwords, registry_prefix=prefix), (
            "templates/secrets.yaml must write what services/common/redis_acl.py does"
        )
        assert not any(p in data[ACL_FILE_NAME] for p in passwords.values()), "hashes only"


def test_chart_made_api_key_authenticates_as_its_tenant(defaults: Objects, tmp_path: Path) -> None:
    name = f"{RELEASE}-gateway-api-keys"
    data = secret_data(defaults, name)
    keys_file = tmp_path / "api-keys.toml"
    keys_file.write_text(data["api-keys.toml"])
    assert data["api-key"] not in data["api-keys.toml"], "the gateway's file holds hashes only"
    keys = KeyStore.from_file(keys_file)
    assert keys.authenticate(data["api-key"]).tenant == "default"
    # The gateway mounts the hashes, never the key itself.
    gateway = deployments(defaults)["gateway"]
    (volume,) = [
        v for v in pod_spec(gateway)["volumes"] if v.get("secret", {}).get("secretName") == name
    ]
    assert volume["secret"]["items"] == [{"key": "api-keys.toml", "path": "api-keys.toml"}]
    assert env_values(main_container(gateway))["GATEWAY_API_KEYS_FILE"].endswith("/api-keys.toml")
    # The job runner has a key of its own, for a tenant granted the batch class, and mounts
    # that key alone where JOBS_API_KEY_FILE points.
    assert data["jobs-api-key"] not in data["api-keys.toml"]
    runner = keys.authenticate(data["jobs-api-key"])
    assert runner.tenant == "jobs"
    assert PriorityClass.BATCH in runner.policy.priorities
    jobs = deployments(defaults)["jobs"]
    (volume,) = [
        v for v in pod_spec(jobs)["volumes"] if v.get("secret", {}).get("secretName") == name
    ]
    (item,) = volume["secret"]["items"]
    assert item["key"] == "jobs-api-key"
    (mount,) = [m for m in main_container(jobs)["volumeMounts"] if m["name"] == volume["name"]]
    key_file = env_values(main_container(jobs))["JOBS_API_KEY_FILE"]
    assert key_file == f"{mount['mountPath']}/{item['path']}" and mount["readOnly"] is True


def test_defaults_run_one_worker_for_every_model_from_the_image(defaults: Objects) -> None:
    worker = deployments(defaults)["gpu-worker"]
    assert worker["metadata"]["name"] == f"{RELEASE}-gpu-worker"
    assert "WORKER_MODELS" not in env_values(main_container(worker)), "every model"
    for deployment in deployments(defaults).values():
        assert "initContainers" not in pod_spec(deployment)
        volumes = {v["name"] for v in pod_spec(deployment)["volumes"]}
        assert "model-repository" not in volumes, "the repository is the image's"


def test_existing_secrets_are_used_and_not_created() -> None:
    objects = render("--set", "auth.existingSecret=keys", "--set", "redisAuth.existingSecret=acl")
    assert not of_kind(objects, "Secret")
    assert referenced_secrets(objects) == {"keys", "acl"}


# -- ServiceMonitor CRD guard, HPA-owned replicas -----------------------------------------------


def test_service_monitors_only_where_their_crd_is_served() -> None:
    def monitors(*extra: str) -> Objects:
        return of_kind(render(*extra), "ServiceMonitor")

    assert not monitors()
    served = monitors("--api-versions", MONITORING_API)
    assert sorted(m["metadata"]["name"] for m in served) == [
        f"{RELEASE}-gateway", f"{RELEASE}-gpu-worker", f"{RELEASE}-jobs", f"{RELEASE}-router",
    ]  # fmt: skip
    assert not monitors("--api-versions", MONITORING_API, "--set", "serviceMonitor.enabled=false")


@pytest.mark.parametrize("tier", sorted(TIER_VALUES))
def test_no_replicas_field_where_an_hpa_owns_the_count(tier: str) -> None:
    key = TIER_VALUES[tier]
    objects = render("--set", f"{key}.hpa.enabled=true", "--set", f"{key}.replicas=3")
    found = deployments(objects)
    assert "replicas" not in found[tier]["spec"]
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == found[tier]["metadata"]["name"]
    for other, deployment in found.items():
        if other not in {tier, "redis"}:
            assert deployment["spec"]["replicas"] == 1, f"{other} has no HPA: it keeps its field"
    validate_strictly(objects)


# -- Redis persistence and the job runner --------------------------------------------------------


def redis_stateful_set(objects: Objects) -> dict[str, Any]:
    (redis,) = of_kind(objects, "StatefulSet")
    return redis


def data_volume(redis: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """("claim", the claim template's spec) or ("pod", the pod volume) behind Redis's --dir."""
    container = main_container(redis)
    args = container["args"]
    (mount,) = [
        m for m in container["volumeMounts"] if m["mountPath"] == args[args.index("--dir") + 1]
    ]
    templates = {t["metadata"]["name"]: t for t in redis["spec"].get("volumeClaimTemplates", [])}
    if mount["name"] in templates:
        return "claim", templates[mount["name"]]["spec"]
    (volume,) = [v for v in pod_spec(redis)["volumes"] if v["name"] == mount["name"]]
    return "pod", volume


def test_redis_persistence_follows_the_values(tmp_path: Path) -> None:
    kind, claim = data_volume(redis_stateful_set(render()))
    assert kind == "claim", "on by default"
    assert claim["resources"]["requests"]["storage"] == "2Gi"
    assert "storageClassName" not in claim, "the cluster's default class"

    objects = render("--set", "redis.persistence.size=20Gi",
                     "--set", "redis.persistence.storageClass=fast-ssd",
                     "--set", "redis.appendfsync=always")  # fmt: skip
    redis = redis_stateful_set(objects)
    kind, claim = data_volume(redis)
    assert kind == "claim"
    assert claim["resources"]["requests"]["storage"] == "20Gi"
    assert claim["storageClassName"] == "fast-ssd"
    args = main_container(redis)["args"]
    assert args[args.index("--appendfsync") + 1] == "always"
    # Claim templates cannot change after install: only labels no upgrade changes.
    (template,) = redis["spec"]["volumeClaimTemplates"]
    assert template["metadata"]["labels"] == redis["spec"]["selector"]["matchLabels"]
    validate_strictly(objects)

    objects = render("--set", "redis.persistence.enabled=false")
    redis = redis_stateful_set(objects)
    kind, volume = data_volume(redis)
    assert kind == "pod" and "emptyDir" in volume, "off: an emptyDir"
    assert "volumeClaimTemplates" not in redis["spec"]
    validate_strictly(objects)
    assert "WARNING: REDIS PERSISTENCE IS OFF" in render_notes(
        tmp_path, "--set", "redis.persistence.enabled=false"
    )


def test_a_worker_may_keep_torchs_own_thread_count() -> None:
    """WORKER_TORCH_THREADS=0 keeps torch's default, which the worker and the kustomize
    overlays accept; the chart's schema refused it (review finding)."""
    worker = main_container(deployments(render("--set", "worker.torchThreads=0"))["gpu-worker"])
    assert env_values(worker)["WORKER_TORCH_THREADS"] == "0"


def test_job_runner_replicas_follow_the_values_and_its_grace_covers_the_drain() -> None:
    assert deployments(render())["jobs"]["spec"]["replicas"] == 1
    assert deployments(render("--set", "jobs.replicas=3"))["jobs"]["spec"]["replicas"] == 3
    result = helm("template", RELEASE, str(CHART_DIR), "--kube-version", KUBE_VERSION,
                  "--set", "jobs.terminationGracePeriodSeconds=20")  # fmt: skip
    assert result.returncode != 0
    assert "jobs.terminationGracePeriodSeconds" in result.stderr


@pytest.mark.parametrize("tier", ["gateway", "router"])
def test_a_grace_period_shorter_than_a_cpu_tiers_stop_is_refused(tier: str) -> None:
    """The preStop sleep, the tier's drain and a hung stop's 15 s: a shorter grace had the
    kubelet SIGKILL it mid-drain, rendered without a word (the worker and job runner were
    checked; review finding)."""
    drain_s = {"gateway": GatewayConfig, "router": RouterConfig}[tier].drain_grace_s
    at_least = 5 + int(drain_s) + int(STOP_OVERRUN_S)
    for grace, refused in ((at_least, True), (at_least + 1, False)):
        result = helm("template", RELEASE, str(CHART_DIR), "--kube-version", KUBE_VERSION,
                      "--set", f"{tier}.terminationGracePeriodSeconds={grace}")  # fmt: skip
        assert (result.returncode != 0) == refused, (grace, result.stderr)
        assert (f"{tier}.terminationGracePeriodSeconds" in result.stderr) == refused


def test_job_runner_checks_the_gateways_certificate_name_when_told() -> None:
    objects = render(
        "--set", "tls.enabled=true", "--set", "jobs.gatewayTlsServerName=api.example.com"
    )
    env = env_values(main_container(deployments(objects)["jobs"]))
    assert env["JOBS_GATEWAY_TLS_SERVER_NAME"] == "api.example.com"
    assert env["JOBS_GATEWAY_TLS_CA_FILE"] == "/etc/fabric/tls/ca.crt"
    default = env_values(main_container(deployments(render("--set", "tls.enabled=true"))["jobs"]))
    assert "JOBS_GATEWAY_TLS_SERVER_NAME" not in default, "checks the host it dials"


# -- worker pools and the model repository ------------------------------------------------------

POOLS = ("--set", "workerPools[0].name=embed", "--set", "workerPools[0].models={minilm}",
         "--set", "workerPools[1].name=generate", "--set", "workerPools[1].models={tiny-llama}",
         "--set", "workerPools[1].replicas=3")  # fmt: skip
INIT = ("--set", "modelRepository.source=init", "--set", "modelRepository.init.image=fetch:1",
        "--set", "modelRepository.init.command={sh,-c,fetch-models}")  # fmt: skip


def workers(objects: Objects) -> dict[str, dict[str, Any]]:
    """The worker Deployments by pool label ("" for the single worker)."""
    return {
        d["metadata"]["labels"].get("inference-fabric/pool", ""): d
        for d in deployments_of(objects, "gpu-worker")
    }


def deployments_of(objects: Objects, component: str) -> Objects:
    return [
        d
        for d in of_kind(objects, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]


def test_worker_pools_on_a_vanilla_cluster_keep_replicas_and_models() -> None:
    """Without HPAs, each pool has its own replicas (its own, else worker.replicas)."""
    objects = render(*POOLS)
    found = workers(objects)
    assert set(found) == {"embed", "generate"}
    assert found["embed"]["spec"]["replicas"] == 1 and found["generate"]["spec"]["replicas"] == 3
    assert env_values(main_container(found["embed"]))["WORKER_MODELS"] == "minilm"
    assert env_values(main_container(found["generate"]))["WORKER_MODELS"] == "tiny-llama"
    assert not of_kind(objects, "HorizontalPodAutoscaler")
    validate_strictly(objects)


def test_a_fixed_gpu_pool_can_drain_before_it_surges() -> None:
    """The workers' rollout pace was fixed at a surge of one: on a GPU pool with no GPU free
    the new pod stayed Pending and the rollout hung (review finding). It is a value, a pool's
    own overriding it; both at 0 (which the API refuses) fails the render."""
    default = workers(render())[""]["spec"]["strategy"]["rollingUpdate"]
    assert default == {"maxSurge": 1, "maxUnavailable": 0}
    fixed = ("--set", "worker.rollingUpdate.maxSurge=0",
             "--set", "worker.rollingUpdate.maxUnavailable=1")  # fmt: skip
    assert workers(render(*fixed))[""]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }
    pools = workers(render(*POOLS, "--set", "workerPools[1].rollingUpdate.maxSurge=0",
                           "--set", "workerPools[1].rollingUpdate.maxUnavailable=25%"))  # fmt: skip
    assert pools["embed"]["spec"]["strategy"]["rollingUpdate"] == default
    assert pools["generate"]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": "25%",
    }
    validate_strictly(render(*fixed))
    both = helm("template", RELEASE, str(CHART_DIR), "--kube-version", KUBE_VERSION,
                "--set", "worker.rollingUpdate.maxSurge=0")  # fmt: skip
    assert both.returncode != 0 and "cannot both be 0" in both.stderr
    # As percentages too, which the API refuses alike (the render passed, the apply failed).
    percent = helm("template", RELEASE, str(CHART_DIR), "--kube-version", KUBE_VERSION,
                   "--set-string", "worker.rollingUpdate.maxSurge=0%",
                   "--set", "worker.rollingUpdate.maxUnavailable=0")  # fmt: skip
    assert percent.returncode != 0 and "cannot both be 0" in percent.stderr


def test_duplicate_pool_names_are_refused() -> None:
    result = helm("template", RELEASE, str(CHART_DIR), "--kube-version", KUBE_VERSION,
                  *POOLS, "--set", "workerPools[1].name=embed")  # fmt: skip
    assert result.returncode != 0
    assert 'two pools are named "embed"' in result.stderr


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (("--set", "modelRepository.source=pvc"), "modelRepository.pvc.claimName"),
        (("--set", "modelRepository.source=init"), "modelRepository.init.image and .command"),
    ],
    ids=["pvc-without-claim", "init-without-image"],
)
def test_model_repository_source_needs_its_settings(
    values: tuple[str, ...], complaint: str
) -> None:
    result = helm("template", RELEASE, str(CHART_DIR), "--kube-version", KUBE_VERSION, *values)
    assert result.returncode != 0
    assert complaint in result.stderr, result.stderr


def test_model_repository_from_a_claim_is_mounted_read_only_where_tiers_read_it() -> None:
    objects = render(*POOLS, "--set", "modelRepository.source=pvc",
                     "--set", "modelRepository.pvc.claimName=models",
                     "--set", "modelRepository.pvc.subPath=v2")  # fmt: skip
    for deployment in [*deployments_of(objects, "gateway"), *workers(objects).values()]:
        spec = pod_spec(deployment)
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model-repository"]
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        container = main_container(deployment)
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model-repository"]
        assert mount["readOnly"] is True and mount["subPath"] == "v2"
        read_at = [v for k, v in env_values(container).items() if k.endswith("_MODEL_REPOSITORY")]
        assert read_at == [mount["mountPath"]], deployment["metadata"]["name"]
    validate_strictly(objects)


def test_model_repository_from_an_init_container() -> None:
    """The init container fills an emptyDir at the repository path (told its role and the
    pool's models), locked down like every container; the tier then mounts it read-only."""
    objects = render(*POOLS, *INIT)
    pods = {"gateway": deployments_of(objects, "gateway")[0], **workers(objects)}
    for name, deployment in pods.items():
        spec = pod_spec(deployment)
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model-repository"]
        assert set(volume) == {"name", "emptyDir"}, name
        container = main_container(deployment)
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model-repository"]
        assert mount["readOnly"] is True, name
        read_at = [v for k, v in env_values(container).items() if k.endswith("_MODEL_REPOSITORY")]
        assert read_at == [mount["mountPath"]], name

        (init,) = spec["initContainers"]
        assert init["image"] == "fetch:1" and init["command"] == ["sh", "-c", "fetch-models"]
        (writes,) = [m for m in init["volumeMounts"] if m["name"] == "model-repository"]
        assert writes["mountPath"] == mount["mountPath"] and not writes.get("readOnly"), name
        env = env_values(init)
        assert env["MODEL_REPOSITORY"] == mount["mountPath"], name
        assert env["FABRIC_ROLE"] == ("gateway" if name == "gateway" else "worker"), name
        pool_models = {"gateway": "", "embed": "minilm", "generate": "tiny-llama"}
        assert env["FABRIC_MODELS"] == pool_models[name], name
        security = init["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, name
        assert security["allowPrivilegeEscalation"] is False, name
        assert security["capabilities"]["drop"] == ["ALL"], name
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(init["resources"][kind]), name
    validate_strictly(objects)


# -- NOTES.txt -------------------------------------------------------------------------------------


def render_notes(tmp_path: Path, *extra: str) -> str:
    """NOTES.txt as `helm install` prints it. `helm template` renders no notes, so a copy of
    the chart carries them as a template of a ConfigMap."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART_DIR, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes + "\n{{- end -}}\n"
    )
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ include "test.notes" . | quote }}\n'
    )
    (config,) = [
        o
        for o in render("--show-only", "templates/notes.yaml", *extra, chart=chart)
        if o["metadata"]["name"] == "notes"
    ]
    return str(config["data"]["notes"])


def test_notes_tell_how_to_reach_the_gateway_and_shout_when_tls_is_off(tmp_path: Path) -> None:
    notes = render_notes(tmp_path)
    assert f"port-forward svc/{RELEASE}-gateway 8001 8000" in notes
    assert f"rollout status deploy/{RELEASE}-gpu-worker   # workers load models" in notes
    assert f"get secret {RELEASE}-gateway-api-keys -o jsonpath='{{.data.api-key}}'" in notes
    assert "WARNING: TLS IS OFF" in notes
    assert "AUTHENTICATION IS OFF" not in notes
    assert "--target worker" in notes, "says how to build the role images"


def test_notes_shout_when_auth_is_off(tmp_path: Path) -> None:
    notes = render_notes(tmp_path, "--set", "auth.enabled=false")
    assert "WARNING: AUTHENTICATION IS OFF" in notes
    assert "api-key" not in notes


def test_notes_wait_for_each_worker_pool(tmp_path: Path) -> None:
    notes = render_notes(tmp_path, *POOLS, "--set", "modelRepository.source=pvc",
                         "--set", "modelRepository.pvc.claimName=models")  # fmt: skip
    assert f"rollout status deploy/{RELEASE}-gpu-worker-embed" in notes
    assert f"rollout status deploy/{RELEASE}-gpu-worker-generate" in notes
    assert f"deploy/{RELEASE}-gpu-worker " not in notes
    assert "PersistentVolumeClaim models" in notes


def test_notes_are_quiet_in_prod(tmp_path: Path) -> None:
    notes = render_notes(tmp_path, "-f", str(PROD_VALUES), "--api-versions", MONITORING_API)
    assert "WARNING" not in notes
    assert "Secret gateway-api-keys" in notes
    # Through a port-forward the address is 127.0.0.1: the certificate's name is checked.
    gateway = re.search(r"port-forward svc/(\S+) ", notes)
    assert gateway is not None
    assert f"--ca-file ca.crt --server-name {gateway[1]}" in notes
    assert f"--resolve {gateway[1]}:" in notes
