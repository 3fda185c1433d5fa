"""How long the device itself was busy with a batch: the worker's duty cycle.

The executor's compute time (inference_worker_compute_seconds) is what a row waits for: the
Python that builds the batch's tensors, the launches, the device's work and the copy back.
Beside it, each batch's device time answers which tier is the bottleneck (seed 004): a duty
cycle near 1 means the device is, and more GPU workers help; a low one while requests queue
means the CPU is (the worker's own per-row path, or the tiers in front of it).

- On a GPU: CUDA events recorded on the current stream around each model call. Their elapsed
  time spans the batch's first kernel to its last, gaps between launches included, and
  leaves out the host's work before the first launch and after the last copy.
- On a CPU: the model call's wall time on the executor thread (the cores are the device).

Exported as the counter inference_worker_device_busy_seconds_total per model version: its
rate, summed over a pod's models, is the pod's duty cycle."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from services.gpu_worker.backends.base import PreparedRow

Run = Callable[[Sequence[PreparedRow]], list[np.ndarray]]


class DeviceBusy:
    """A model call that keeps count of the device time it used: call it as the call it wraps
    (several times when a failing batch is bisected), then read `seconds`. Used on the
    executor thread, one per batch."""

    __slots__ = ("_on_cuda", "_run", "seconds")

    def __init__(self, run: Run, device: torch.device) -> None:
        self._run = run
        self._on_cuda = device.type == "cuda"
        self.seconds = 0.0

    def __call__(self, rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        if not self._on_cuda:
            start_s = time.perf_counter()
            try:
                return self._run(rows)
            finally:
                self.seconds += time.perf_counter() - start_s
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return self._run(rows)
        finally:
            end.record()
            end.synchronize()  # already reached when the outputs were copied back: no wait
            self.seconds += start.elapsed_time(end) / 1000.0
