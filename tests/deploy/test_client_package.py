"""The slim client as a package (clients/python): its runtime bounds admit only the grpcio and
protobuf its generated code runs on, and a wheel builds from its source distribution away from
the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from inference_fabric_client._pb.inference.v1 import inference_pb2, inference_pb2_grpc
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.integration

CLIENT = REPO_ROOT / "clients" / "python"


def lower_bound(requirement: Requirement) -> Version:
    (bound,) = [s.version for s in requirement.specifier if s.operator in (">=", "==")]
    return Version(bound)


def test_the_runtime_bounds_admit_only_what_the_generated_code_runs_on() -> None:
    # Before, grpcio>=1.66 and protobuf>=5.27: an environment holding either older than the
    # generated code needs kept it, and `import inference_fabric_client` failed.
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())
    requirements = {r.name: r for r in map(Requirement, project["project"]["dependencies"])}
    generated = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),",
        Path(inference_pb2.__file__).read_text(),
    )
    assert generated is not None
    gencode = Version(".".join(generated.groups()))
    assert lower_bound(requirements["protobuf"]) >= gencode
    assert Version(f"{gencode.major + 1}") not in requirements["protobuf"].specifier
    assert lower_bound(requirements["grpcio"]) >= Version(inference_pb2_grpc.GRPC_GENERATED_VERSION)
    build = [Requirement(r) for r in project["build-system"]["requires"]]
    (tools,) = [r for r in build if r.name == "grpcio-tools"]
    assert lower_bound(tools) == lower_bound(requirements["grpcio"]), "tools pinned as required"


def test_a_wheel_builds_from_the_source_distribution_alone(tmp_path: Path) -> None:
    # Before, the source distribution carried no protos: its wheel's build raised
    # "proto/ not found next to setup.py nor at the repository root".
    checkout = tmp_path / "checkout"
    shutil.copytree(CLIENT, checkout / "clients" / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "dist"))  # fmt: skip
    shutil.copytree(REPO_ROOT / "proto", checkout / "proto")
    subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
        cwd=checkout / "clients" / "python", check=True, capture_output=True,
    )  # fmt: skip
    (archive,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(archive) as opened:
        opened.extractall(tmp_path / "unpacked", filter="data")
    (source,) = (tmp_path / "unpacked").iterdir()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheels"), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "inference_fabric_client/_pb/inference/v1/inference_pb2.py" in names
    assert not any("worker" in name for name in names), "the internal API stays out"
