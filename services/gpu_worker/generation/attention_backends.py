"""Which SDPA kernels the generation engine's attention may use, chosen on purpose.

torch picks a kernel for each `scaled_dot_product_attention` call among those enabled. On a GPU
its default set includes cuDNN attention, which builds an execution plan for every new shape:
about 8.5 ms a call on an H100 (`../shared/gpu/h100_generation_profile.log`), and a decode
step's context width changes every step, so every step planned again. The engine therefore
never enables cuDNN attention. Among the rest (flash, memory-efficient, math), a GPU worker
times the sets below on representative steps at warm-up and keeps the fastest: which wins
depends on the device, the head size and the dtype. Flash attention takes no explicit mask, so
torch falls through to the next enabled kernel for the masked calls (decode and later prefill
chunks); a set therefore lists kernels in torch's priority order, and "math" is in every one
as the kernel of last resort for shapes the fused ones refuse.

The choice is process-global state in torch (flags, not a thread-local): the engine enables
its set around each step only, so another model's forward on another thread may see the
engine's set for that long. Steps of several generation models on their own threads overlap:
the flags follow the set of the step that entered last among those running, and go back to
what they were once none runs (a step wedged for good keeps its set enabled). Every set
differs from torch's default only by leaving kernels out, so any forward still runs, at worst
on another kernel.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

_NAMES = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.MATH: "math",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
}


@dataclass(frozen=True)
class AttentionBackends:
    """A set of SDPA kernels, in torch's priority order."""

    backends: tuple[SDPBackend, ...]

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """The flags' names of these kernels (built once, not at every step)."""
        return frozenset(_NAMES[b] for b in self.backends)

    @property
    def name(self) -> str:
        """For logs and the metric's label: "flash+efficient+math"."""
        return "+".join(_NAMES[b] for b in self.backends)

    @contextlib.contextmanager
    def enabled(self) -> Iterator[None]:
        """Only these kernels while the block runs (see the module's doc for overlapping
        blocks on several threads; the flags are as before once none runs)."""
        global _before
        with _lock:
            if not _running:
                _before = enabled_now()
            _running.append(self)
            _set_flags(self.names)
        try:
            yield
        finally:
            with _lock:
                _running.remove(self)
                if _running:
                    _set_flags(_running[-1].names)
                else:
                    _set_flags(_before)


#: The sets of the steps running now, in the order they entered, and the flags before the
#: first of them (`AttentionBackends.enabled`).
_lock = threading.Lock()
_running: list[AttentionBackends] = []
_before: frozenset[str] = frozenset()


def _set_flags(names: Set[str]) -> None:
    torch.backends.cuda.enable_flash_sdp("flash" in names)
    torch.backends.cuda.enable_mem_efficient_sdp("efficient" in names)
    torch.backends.cuda.enable_math_sdp("math" in names)
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in names)


#: The sets a GPU worker times at warm-up, the first also a CPU's (whose SDPA has no cuDNN
#: kernel to leave out, and whose choice is not measured).
CANDIDATES = (
    AttentionBackends(
        (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    ),
    AttentionBackends((SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)),
    AttentionBackends((SDPBackend.MATH,)),
)


#: torch's own set (cuDNN attention included): only for benchmarks' before-and-after runs.
TORCH_DEFAULT = AttentionBackends(
    (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
        SDPBackend.CUDNN_ATTENTION,
    )
)


def enabled_now() -> frozenset[str]:
    """The kernels torch's flags enable at this moment (what a call made now may use)."""
    flags = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
    }
    return frozenset(name for name, on in flags.items() if on)


#: How much faster (a share of its time) a later candidate must be to replace an earlier one:
#: sets that time alike are a coin toss between runs (the ~100M model chose math in one
#: H200 run and flash+efficient+math in the next, their times within noise), and the
#: earlier sets leave torch more kernels to pick from for shapes the warm-up did not time.
MARGIN = 0.05


def fastest(
    candidates: tuple[AttentionBackends, ...], time_step: Callable[[], float]
) -> tuple[AttentionBackends, dict[str, float]]:
    """The candidate under which `time_step()` (seconds, the caller's representative steps)
    is shortest by more than `MARGIN` (else the earlier), and every candidate's time (a
    candidate whose kernels refuse the shapes, torch's "No available kernel" RuntimeError
    inside `time_step`, is left out). RuntimeError if none ran."""
    times: dict[str, float] = {}
    best: AttentionBackends | None = None
    for candidate in candidates:
        try:
            with candidate.enabled():
                seconds = time_step()
        except RuntimeError as error:
            # A set whose kernels all refuse some shape; anything else (out of memory, a
            # device fault) is no reason to pick another set.
            if "No available kernel" not in str(error):
                raise
            continue
        times[candidate.name] = seconds
        if best is None or seconds < (1.0 - MARGIN) * times[best.name]:
            best = candidate
    if best is None:
        raise RuntimeError("no attention kernel set could run the warm-up steps")
    return best, times
