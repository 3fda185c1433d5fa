"""Whether a new model version fits beside the ones a worker already serves.

A hot load reads weights while the old versions keep serving, so loading one that does not
fit would take the whole worker down (an out-of-memory kill, or CUDA OOM mid-batch) instead of
failing the one load. The estimate is deliberately simple: the version's weight files, times a
factor for what loading and warm-up add beside them (a second copy while tensors move to the
device, activations), plus a generation model's KV cache, whose size its settings fix. Too
small a factor risks the worker; too large refuses loads that fit. Free memory is the GPU's, or
on a CPU the machine's within the container's memory limit (cgroup v2); a GPU load must fit
the machine's too, where the loaders build the model and read its checkpoint first.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from services.common.model_repository import ModelKind, ModelVersion
from services.common.procfs import available_memory_bytes
from services.gpu_worker.generation.backend import serving_dtype
from services.gpu_worker.generation.llama import LlamaConfig

#: Memory a load needs per byte of weight files (see the module's doc).
LOAD_MEMORY_FACTOR = 2.0
_MIB = 1024 * 1024


class InsufficientMemory(Exception):
    """The version's estimated footprint exceeds the device's free memory: not loaded."""


def weights_bytes(weights_dir: Path) -> int:
    """Apparent size of every file under `weights_dir` (what loading reads)."""
    total = 0
    for root, _, files in os.walk(weights_dir):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_size
    return total


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the version will live: the GPU's, else the machine's. On a GPU, the
    driver's free memory and what PyTorch's caching allocator holds unused (reserved, not
    allocated: the new version's tensors take it, and the allocator empties its cache before
    it fails an allocation); the driver counts that as used, so a worker that had served big
    batches refused loads that fit (review finding)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(0, int(cached))
    return available_memory_bytes()


def kv_cache_bytes(version: ModelVersion, device: torch.device) -> int:
    """What a generation version's paged KV cache takes on `device` (its engine allocates it
    whole when it loads): K and V of every layer, for its blocks and the one padding block; 0
    for any other model."""
    settings = version.config.generation
    if version.config.kind is not ModelKind.GENERATION or settings is None:
        return 0
    llama = LlamaConfig.from_json(version.weights_dir / "config.json")
    per_token = llama.num_key_value_heads * llama.head_dim * serving_dtype(device).itemsize
    num_tokens = (settings.num_kv_blocks + 1) * settings.block_size
    return 2 * llama.num_hidden_layers * num_tokens * per_token


def check_fits(
    *,
    weights: int,
    free: int,
    device: torch.device,
    kv_cache: int = 0,
    host_free: int | None = None,
    where: str = "",
) -> None:
    """Raises InsufficientMemory, with the figures, when `weights` bytes of weight files
    (LOAD_MEMORY_FACTOR) and a KV cache of `kv_cache` bytes need more than `free`, or, on a
    GPU, when the weights need more than `host_free` of the machine's: the loaders build the
    model on the host and read its checkpoint beside it before moving it to the device, so a
    load that fits the GPU could still have the whole worker killed for its host memory
    (`where`: what the refusal names, the device by default); pure."""
    if device.type != "cpu" and host_free is not None:
        check_fits(weights=weights, free=host_free, device=torch.device("cpu"), where="host")
    needed = round(weights * LOAD_MEMORY_FACTOR) + kv_cache
    if needed > free:
        cache = f" + {kv_cache // _MIB} MiB of KV cache" if kv_cache else ""
        raise InsufficientMemory(
            f"not enough memory on {where or device}: the load needs about {needed // _MIB} MiB "
            f"({weights // _MIB} MiB of weights x {LOAD_MEMORY_FACTOR:g}{cache}), "
            f"{free // _MIB} MiB free; unload a version or add memory"
        )
