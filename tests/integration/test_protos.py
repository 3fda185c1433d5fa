"""Other teams compile proto/ with plain `protoc -I proto`: no path mapping, no Makefile; buf
users build it with `buf build`. Both run the compilers as processes, hence integration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tools import venv_tool

pytestmark = pytest.mark.integration

PROTO = Path(__file__).resolve().parents[2] / "proto"


def test_proto_compiles_with_plain_protoc_and_the_result_imports(tmp_path: Path) -> None:
    files = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    assert "inference/v1/inference.proto" in files and "inference/grpc_service.proto" in files
    compiled = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(PROTO), "--python_out", str(tmp_path),
         "--grpc_python_out", str(tmp_path), *files],
        capture_output=True, text=True, check=False, cwd=PROTO,
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr
    # Imported as generated, with only the output directory on the path (not our package).
    probe = (
        "from inference.v1 import inference_pb2, inference_pb2_grpc\n"
        "from inference import grpc_service_pb2_grpc\n"
        "print(inference_pb2.PredictRequest(priority=3).priority,"
        " sorted(grpc_service_pb2_grpc.GRPCInferenceServiceServicer.__dict__)[0],"
        " *(d.name for d in inference_pb2.DESCRIPTOR.dependencies))\n"
    )
    imported = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True, text=True, check=False, cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    # The public API depends on the shared types only, never on the workers' internal API.
    assert imported.stdout.split() == ["3", "CudaSharedMemoryRegister", "inference/v1/types.proto"]


def test_buf_builds_the_module() -> None:
    """`buf build` with the repository's buf.yaml (module root proto/), as buf users run it."""
    built = subprocess.run(
        [venv_tool("buf"), "build", "--error-format", "text"],
        capture_output=True, text=True, check=False, cwd=PROTO.parent,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
