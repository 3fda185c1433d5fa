"""The hot-load memory check: a version loads only if its weights, times the load factor, and a
generation version's KV cache fit in the free memory, within the container's limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.model_repository import load_repository
from services.common.procfs import available_memory_bytes
from services.gpu_worker.generation.backend import serving_dtype
from services.gpu_worker.generation.model_runner import ModelRunner
from services.gpu_worker.memory_budget import (
    LOAD_MEMORY_FACTOR,
    InsufficientMemory,
    check_fits,
    free_memory_bytes,
    kv_cache_bytes,
    weights_bytes,
)
from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
MIB = 1024 * 1024


def test_a_version_that_fits_with_its_load_factor_passes() -> None:
    check_fits(weights=100 * MIB, free=round(100 * MIB * LOAD_MEMORY_FACTOR), device=CPU)


def test_a_version_past_free_memory_is_refused_with_its_figures() -> None:
    with pytest.raises(InsufficientMemory) as refused:
        check_fits(weights=100 * MIB, free=150 * MIB, device=CPU)
    message = str(refused.value)
    assert "not enough memory on cpu" in message
    assert "100 MiB of weights" in message and "150 MiB free" in message


def test_a_gpu_load_must_fit_the_hosts_memory_too() -> None:
    """The loaders build a model on the host, its checkpoint read beside it, before moving it
    to the GPU: a load the GPU had room for, checked against the GPU alone, could have the
    whole worker killed for host memory (its pod's limit). Pure: no GPU is needed to check."""
    gpu = torch.device("cuda", 0)
    with pytest.raises(InsufficientMemory, match="not enough memory on host"):
        check_fits(weights=100 * MIB, free=1000 * MIB, device=gpu, host_free=150 * MIB)
    check_fits(weights=100 * MIB, free=1000 * MIB, device=gpu, host_free=250 * MIB)
    with pytest.raises(InsufficientMemory, match="not enough memory on cuda:0"):
        check_fits(weights=100 * MIB, free=150 * MIB, device=gpu, host_free=1000 * MIB)


def test_weights_bytes_adds_every_file_under_the_directory(tmp_path: Path) -> None:
    (tmp_path / "nested").mkdir()
    (tmp_path / "model.pt").write_bytes(b"x" * 1000)
    (tmp_path / "nested" / "tokenizer.json").write_bytes(b"y" * 24)
    assert weights_bytes(tmp_path) == 1024


def test_a_generation_versions_kv_cache_counts_beside_its_weights() -> None:
    with pytest.raises(InsufficientMemory, match="50 MiB of KV cache"):
        check_fits(weights=100 * MIB, free=220 * MIB, device=CPU, kv_cache=50 * MIB)
    check_fits(weights=100 * MIB, free=250 * MIB, device=CPU, kv_cache=50 * MIB)


def test_the_kv_cache_estimate_is_what_the_engine_allocates() -> None:
    """tiny-llama's cache, estimated from its config.json and [generation] settings, against
    the one its runner allocates on this CPU (before, generation loads counted no cache)."""
    (version,) = [v for v in load_repository(REPO_ROOT / "models") if v.config.name == "tiny-llama"]
    settings = version.config.generation
    assert settings is not None
    runner = ModelRunner(
        version.weights_dir,
        device=CPU,
        dtype=serving_dtype(CPU),
        num_blocks=settings.num_kv_blocks,
        block_size=settings.block_size,
    )
    cache = runner.kv_cache
    allocated = sum(t.numel() * t.element_size() for t in [*cache.keys, *cache.values])
    assert kv_cache_bytes(version, CPU) == allocated > 0


def test_a_containers_memory_limit_bounds_what_a_load_may_take(tmp_path: Path) -> None:
    assert available_memory_bytes(tmp_path) > 0  # no cgroup files here: the machine's
    (tmp_path / "memory.max").write_text("1073741824\n")  # 1 GiB
    (tmp_path / "memory.current").write_text(str(900 * MIB))
    (tmp_path / "memory.stat").write_text(f"anon {700 * MIB}\ninactive_file {200 * MIB}\n")
    # The working set is 700 MiB (the inactive page cache can be dropped): 324 MiB of room.
    assert available_memory_bytes(tmp_path) == 324 * MIB
    (tmp_path / "memory.max").write_text("max\n")
    assert available_memory_bytes(tmp_path) > 324 * MIB


def test_a_gpus_free_memory_counts_what_pytorchs_cache_holds_unused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver counts the caching allocator's reserved, unallocated blocks as used: a
    worker that had served big batches holding GiBs there refused loads that fit (review
    finding). Free is the driver's free plus that cache (torch.cuda's readings stood in for:
    no GPU here)."""
    gib = 1024 * MIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 26 * gib)
    free = free_memory_bytes(torch.device("cuda", 0))
    assert free == 10 * gib
    check_fits(weights=4 * gib, free=free, device=torch.device("cuda", 0))  # 8 GiB needed
