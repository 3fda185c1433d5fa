"""Small TorchScript models of known cost, for the benchmarks and the tests that share their
scenarios: y = x @ W + b (FP32 [4] -> FP32 [2]) after `work_iters` matmuls that only burn time."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

#: A row whose first value is this makes the test model raise (a "poisoned" input).
POISON = 13.0


class _Affine(torch.nn.Module):
    """y = x @ W + b, after `work_iters` matmuls that only burn time (a slow model)."""

    def __init__(self, work_iters: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 2, generator=generator))
        self.bias = torch.nn.Parameter(torch.randn(2, generator=generator))
        self.work = torch.nn.Parameter(torch.randn(192, 192, generator=generator) / 16)
        self.work_iters = work_iters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] == 13.0).any()):
            raise RuntimeError("poisoned row")
        burn = self.work
        for _ in range(self.work_iters):
            burn = torch.tanh(burn @ self.work)
        return x @ self.weight + self.bias + 0.0 * burn.sum()


def affine_reference(x: torch.Tensor) -> torch.Tensor:
    """What the test model computes, for checking answers."""
    model = _Affine(0)
    with torch.no_grad():
        return x @ model.weight + model.bias


def write_affine_model(
    repository: Path,
    name: str = "affine",
    *,
    work_iters: int = 0,
    max_batch_size: int = 8,
    slo_p99_ms: int = 1000,
    max_queue_size: int = 64,
    versions: tuple[int, ...] = (1,),
) -> Path:
    """Writes `<repository>/<name>/` with a TorchScript affine model: FP32 [4] -> FP32 [2]."""
    model_dir = repository / name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.toml").write_text(
        f"""
kind = "torchscript"
slo_p99_ms = {slo_p99_ms}
max_batch_size = {max_batch_size}
max_queue_size = {max_queue_size}

[inputs.x]
dtype = "FP32"
dims = [4]

[outputs.y]
dtype = "FP32"
dims = [2]
"""
    )
    with warnings.catch_warnings():
        # torch 2.13 marks TorchScript deprecated; it is what the torchscript backend loads.
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(_Affine(work_iters))
    for version in versions:
        (model_dir / str(version)).mkdir(exist_ok=True)
        scripted.save(str(model_dir / str(version) / "model.pt"))
    return model_dir
