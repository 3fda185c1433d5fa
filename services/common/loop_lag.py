"""Event-loop lag: how late a tier's event loop runs a callback that was due.

Every tier is one asyncio loop per process. When the loop saturates (per-call Python work
outgrows the process's core) every call waits for it, whatever the model does: on a GPU box
this, not the device, is what fills first (the data-path issue). A timer asks to be woken every
`interval_s`; how late it wakes is the lag, read on `time.monotonic()` (uvloop's own clock
counts whole milliseconds, and a scrape reads it from another thread). It is a timer
callback, not a task, so it never outlives its loop and costs one callback per interval.

Exported per tier (its own registry): `inference_event_loop_lag_seconds` (histogram of every
sample) and `inference_event_loop_lag_recent_seconds` (the largest sample of the last
`window_s`, what an admission rule or a dashboard reads now).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.telemetry import MetricFactory

#: Lag buckets, seconds: a healthy loop is well under a millisecond; a saturated one is late by
#: tens to hundreds.
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class RecentMax:
    """The largest value observed in the last `window_s` (pure; time is given)."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        #: (time, value), values decreasing from the left: a monotonic deque.
        self._samples: deque[tuple[float, float]] = deque()

    def observe(self, now_s: float, value: float) -> None:
        while self._samples and self._samples[-1][1] <= value:
            self._samples.pop()
        self._samples.append((now_s, value))

    def value(self, now_s: float) -> float:
        while self._samples and self._samples[0][0] <= now_s - self._window_s:
            self._samples.popleft()
        return self._samples[0][1] if self._samples else 0.0


class LoopLag:
    """Samples the running loop's lag every `interval_s` into `registry`'s lag metrics."""

    def __init__(
        self, registry: CollectorRegistry, *, interval_s: float = 0.05, window_s: float = 5.0
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        factory = MetricFactory(registry)
        self._histogram = factory.histogram(
            names.EVENT_LOOP_LAG_SECONDS,
            "How late this process's event loop ran a timer that was due.",
            buckets=LAG_BUCKETS,
        )
        self._recent = RecentMax(window_s)
        self._recent_s = 0.0
        factory.gauge(
            names.EVENT_LOOP_LAG_RECENT_SECONDS,
            f"The largest event-loop lag of the last {window_s:g} s.",
            (),
        ).set_function(self.recent_s)
        self._interval_s = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due_s = 0.0

    def start(self) -> None:
        """Starts sampling on the running loop. The first timer's due time is set before the
        loop: a scrape in between read a started sampler with the due time of none (0, or a
        stopped one's), a lag of the host's uptime (review finding)."""
        loop = asyncio.get_running_loop()
        self._due_s = time.monotonic() + self._interval_s
        self._loop = loop
        self._schedule()

    def stop(self) -> None:
        """Stops sampling; the recent lag stays the last window's (its last timer's due time
        stays too, and a stopped sampler's lag grew with every second since: review
        finding)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._loop = None

    def recent_s(self) -> float:
        """The largest lag of the last window, seconds (0 before the first sample), and a
        stall in progress: a loop blocked now is as late as its overdue timer. Read from any
        thread (the metrics server's): the window itself is only touched on the loop's."""
        if self._loop is None:  # not started, or stopped: no timer is due
            return self._recent_s
        return max(self._recent_s, time.monotonic() - self._due_s)

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due_s = time.monotonic() + self._interval_s
        self._handle = self._loop.call_later(self._interval_s, self._tick)

    def _tick(self) -> None:
        now_s = time.monotonic()
        lag_s = max(0.0, now_s - self._due_s)
        self._histogram.observe(lag_s)
        self._recent.observe(now_s, lag_s)
        self._recent_s = self._recent.value(now_s)
        self._schedule()
