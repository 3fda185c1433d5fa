"""Whether a new model version fits beside the ones a worker already serves.

A hot load reads weights while the old versions keep serving, so loading one that does not
fit would take the whole worker down (an out-of-memory kill, or CUDA OOM mid-batch) instead of
failing the one load. The estimate is deliberately simple: the version's weight files, times a
factor for what loading and warm-up add beside them (a second copy while tensors move to the
device, activations, a generation model's KV cache is configured separately and checked when
its engine allocates it). Too small a factor risks the worker; too large refuses loads that fit.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from services.common.procfs import available_memory_bytes

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
    """Free memory where the version will live: the GPU's, else the machine's."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return available_memory_bytes()


def check_fits(*, weights: int, free: int, device: torch.device) -> None:
    """Raises InsufficientMemory, with the figures, when `weights` bytes of weight files need
    more than `free` bytes (LOAD_MEMORY_FACTOR); pure."""
    needed = round(weights * LOAD_MEMORY_FACTOR)
    if needed > free:
        raise InsufficientMemory(
            f"not enough memory on {device}: the load needs about {needed // _MIB} MiB "
            f"({weights // _MIB} MiB of weights x {LOAD_MEMORY_FACTOR:g}), {free // _MIB} MiB "
            "free; unload a version or add memory"
        )
