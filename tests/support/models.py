"""Small real models written into temporary model repositories."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

# The affine test model is the benchmarks' model of known cost (bench/models.py); re-exported.
from bench.models import POISON as POISON
from bench.models import affine_reference as affine_reference
from bench.models import write_affine_model as write_affine_model
from services.common.model_repository import ModelVersion, load_repository
from services.pb.inference.v1 import worker_pb2 as pb


def write_minilm_repository(repository: Path, *, slo_p99_ms: int) -> Path:
    """A copy of the default repository's minilm config with another SLO (weights shared)."""
    source = Path(__file__).resolve().parents[2] / "models" / "minilm"
    model_dir = repository / "minilm"
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    config = (source / "config.toml").read_text()
    (model_dir / "config.toml").write_text(
        "\n".join(
            f"slo_p99_ms = {slo_p99_ms}" if line.startswith("slo_p99_ms") else line
            for line in config.splitlines()
        )
    )
    (model_dir / "1" / "version.toml").write_text((source / "1" / "version.toml").read_text())
    return repository


def write_small_minilm_repository(repository: Path) -> Path:
    """minilm with an SLO of 30 s, batches of at most 8 and two length buckets, for e2e tests
    whose texts are short and whose subject is faults or counts, not latency (two shared cores
    cannot serve steady load within the default 250 ms). A worker warms up every shape of its
    config: the default one takes about a minute on two busy cores, this one seconds."""
    write_minilm_repository(repository, slo_p99_ms=30_000)
    replaced = {
        "max_batch_size": "max_batch_size = 8",
        "length_buckets": "length_buckets = [16, 32]",
    }
    replace_config_lines(repository / "minilm" / "config.toml", replaced)
    return repository


def replace_config_lines(config: Path, replaced: Mapping[str, str]) -> None:
    """Rewrites the lines of `config` that start with a key of `replaced` as its value."""
    config.write_text(
        "\n".join(
            next((v for k, v in replaced.items() if line.startswith(k)), line)
            for line in config.read_text().splitlines()
        )
    )


#: A row whose first value is this makes the stalling test model block (see `_Stall`).
STALL = 77.0


def row(*values: float) -> np.ndarray:
    """One FP32 input row of the affine-shaped test models (FP32 [4] -> FP32 [2])."""
    return np.array(values, dtype=np.float32)


def infer_request(model: str, *rows: np.ndarray, **fields: str) -> pb.InferRequest:
    """A worker InferRequest of `rows` (FP32 [4] each), one input a row."""
    inputs = [
        pb.ModelInput(tensor=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=r.tobytes()))
        for r in rows
    ]
    return pb.InferRequest(model_name=model, inputs=inputs, **fields)


def outputs(response: pb.InferResponse) -> np.ndarray:
    """A worker answer's FP32 outputs, a row each."""
    return np.stack([np.frombuffer(t.raw_data, dtype="<f4") for t in response.outputs])


class _Stall(torch.nn.Module):
    """y = x @ W + b, like bench/models.py's affine model; but a call with a row starting with
    `STALL` blocks until the first byte of the gate file `gate_path` is non-zero: a model call
    that really holds the executor thread, for as long as the test wants (`release_stall` ends
    it). TorchScript has no sleep, so it polls the file (about one core while blocked). With
    `stall_every_call`, every call blocks, warm-up's included: loading lasts until the gate
    opens."""

    def __init__(self, gate_path: str, stall_every_call: bool = False) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 2, generator=generator))
        self.bias = torch.nn.Parameter(torch.randn(2, generator=generator))
        self.gate_path = gate_path
        self.stall_every_call = stall_every_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_polls = 0
        if self.stall_every_call or bool((x[:, 0] == 77.0).any()):
            is_open = False
            while not is_open:
                # The size depends on the loop counter so that TorchScript cannot hoist the read.
                gate = torch.from_file(
                    self.gate_path, shared=False, size=1 + 0 * num_polls, dtype=torch.uint8
                )
                is_open = int(gate[0]) != 0
                num_polls += 1
        return x @ self.weight + self.bias + 0.0 * num_polls


def write_stalling_model(
    repository: Path, gate: Path, name: str = "stall", *, stall_every_call: bool = False
) -> Path:
    """Writes `<repository>/<name>/1/` with the `_Stall` TorchScript model (FP32 [4] -> FP32
    [2], batches of one row) and a closed gate file at `gate`."""
    gate.write_bytes(b"\x00")
    model_dir = repository / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.toml").write_text(
        """
kind = "torchscript"
slo_p99_ms = 30000
max_batch_size = 1
max_queue_size = 64

[inputs.x]
dtype = "FP32"
dims = [4]

[outputs.y]
dtype = "FP32"
dims = [2]
"""
    )
    torch.jit.script(_Stall(str(gate), stall_every_call)).save(str(model_dir / "1" / "model.pt"))
    return model_dir


def release_stall(gate: Path) -> None:
    """Opens the gate: a stalled call of the `_Stall` model returns. Written in place: the
    model must never see the file empty."""
    with gate.open("r+b") as file:
        file.write(b"\x01")


class _SeededAffine(torch.nn.Module):
    """y = x @ W + b with weights drawn from `seed`: versions written with different seeds
    compute different answers, so a row run by another version's batch shows in its output."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(4, 2, generator=generator))
        self.bias = torch.nn.Parameter(torch.randn(2, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def versioned_affine_reference(x: torch.Tensor, version: int) -> torch.Tensor:
    """What version `version` of `write_versioned_affine_model` computes."""
    model = _SeededAffine(version)
    with torch.no_grad():
        return x @ model.weight + model.bias


def write_versioned_affine_model(
    repository: Path, name: str = "affine", *, versions: tuple[int, ...] = (1, 2), **config: int
) -> Path:
    """Like `write_affine_model` (same config keywords), but each version has its own weights
    (seeded with the version number), hence its own fingerprint and answers."""
    model_dir = write_affine_model(repository, name, versions=versions, **config)
    for version in versions:
        scripted = torch.jit.script(_SeededAffine(version))
        scripted.save(str(model_dir / str(version) / "model.pt"))
    return model_dir


class _BrokenRelease(torch.nn.Module):
    """A release that loads and warms up (on zeros) but fails every real row: first value > 0."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] > 0).any()):
            raise RuntimeError("broken release")
        return x @ self.weight


def break_version(model_dir: Path, version: int) -> None:
    """Replaces a TorchScript version with `_BrokenRelease` (a bad canary)."""
    torch.jit.script(_BrokenRelease()).save(str(model_dir / str(version) / "model.pt"))


def tiny_llama_version(repository: Path, version: str) -> ModelVersion:
    """The default repository's tiny-llama copied into `repository` as `version` alone (a
    version to hot-load beside the served one), read back."""
    model_dir = repository / "tiny-llama"
    shutil.copytree(Path(__file__).resolve().parents[2] / "models" / "tiny-llama", model_dir)
    (model_dir / "1").rename(model_dir / version)
    (read,) = load_repository(repository)
    return read
