"""How long the device itself was busy with a batch or a step: the worker's duty cycle.

The executor's compute time (inference_worker_compute_seconds) is what a row waits for: the
Python that builds the batch's tensors, the launches, the device's work and the copy back.
Beside it, each call's device time answers which tier is the bottleneck (seed 004): a duty
cycle near 1 means the device is, and more GPU workers help; a low one while requests queue
means the CPU is (the worker's own per-row path, or the tiers in front of it).

- On a GPU: CUDA events recorded on the current stream around the call's device section
  (`device_section()`, which a backend puts around its forward: from inputs on the device to
  outputs still on it), or around the whole call for a backend that marks none. The events
  span the section's first kernel to its last, launch gaps included: a forward bound by its
  launches reads busier than its kernels are. The host's work before the section (padding,
  building inputs) and after it (the copy back, splitting rows) is left out.
- On a CPU: the call's wall time on the executor thread (the cores are the device).

Exported as the counter inference_worker_device_busy_seconds_total per model version, fixed-
cost batches and generation steps alike: its rate, summed over a pod's models, is the pod's
duty cycle."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")

#: The DeviceBusy whose call runs on this thread, if any (`device_section` reports to it).
_timing = threading.local()


def current_stream() -> torch.cuda.Stream:
    """The current device's current CUDA stream, asked for by the device's index. Asked for
    without one (`torch.cuda.current_stream()`, an event's `record()` without a stream),
    torch finds the device type through `torch.cuda.is_available()` at every call, which
    calls `torch._C._cuda_getDeviceCount`. cProfile of bench.generation on an H200 host gave
    that call 2,227 times in 352 steps, 83 us each: whether its own time or a wait for the
    GIL behind the event loop's thread, not known (the count itself is cached in C++).
    Asked for by index, none of it happens."""
    return torch.cuda.current_stream(torch.cuda.current_device())


@contextlib.contextmanager
def device_section() -> Iterator[None]:
    """Marks the device's part of a model call (inputs on the device to outputs still on it):
    on a GPU, the call's device time spans this section, not the host's work around it.
    Nothing outside a DeviceBusy call, or on a CPU."""
    busy: DeviceBusy[..., object] | None = getattr(_timing, "busy", None)
    if busy is None or not busy.on_cuda:
        yield
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(current_stream())
    try:
        yield
    finally:
        end.record(current_stream())
        busy.sections.append((start, end))


class DeviceBusy(Generic[P, R]):
    """A model call that keeps count of the device time it used: call it as the call it wraps
    (several times when a failing batch is bisected), then read `seconds`. On the executor
    thread, one per batch or step."""

    __slots__ = (
        "_clock", "_run", "ended_s", "last_end_s", "num_calls", "on_cuda", "ran_s", "seconds",
        "sections", "started_s",
    )  # fmt: skip

    def __init__(
        self,
        run: Callable[P, R],
        device: torch.device,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run = run
        self._clock = clock
        self.on_cuda = device.type == "cuda"
        self.seconds = 0.0
        #: The calls' wall time on the executor thread, read on `clock` (the caller's: a
        #: batching driver's): the host's work and the device's, not the wait for the caller's
        #: event loop to see the call end. What a batch's shape costs: a loop busy with other
        #: work (refusing a flood) delays its reading of a batch's end, not the next batch.
        self.ran_s = 0.0
        #: When the first call began and the last one ended, on `clock` (None: not called):
        #: the executor's idle time between batches is read from these (batch_gap.BatchGap).
        self.started_s: float | None = None
        self.ended_s: float | None = None
        #: Calls that have ended, and when the last one did (time.monotonic): the watchdog's
        #: sign of progress (batching.watchdog).
        self.num_calls = 0
        self.last_end_s = 0.0
        #: The device sections of the call running now: (start, end) events.
        self.sections: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        called_s = self._clock()
        if self.started_s is None:
            self.started_s = called_s
        try:
            return self._timed(*args, **kwargs)
        finally:
            self.ended_s = self._clock()
            self.ran_s += self.ended_s - called_s

    def _timed(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if not self.on_cuda:
            start_s = time.perf_counter()
            try:
                return self._run(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start_s
                self._ended()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.sections.clear()
        _timing.busy = self
        start.record(current_stream())
        try:
            return self._run(*args, **kwargs)
        finally:
            end.record(current_stream())
            _timing.busy = None
            end.synchronize()  # reached once the outputs were copied back: no wait
            spans = self.sections or [(start, end)]
            self.seconds += sum(first.elapsed_time(last) for first, last in spans) / 1000.0
            self.sections.clear()
            self._ended()

    def _ended(self) -> None:
        self.last_end_s = time.monotonic()  # before the count: a reader that sees the count
        self.num_calls += 1  # sees this call's end too
