"""A process's concurrency limit, adapted from the queue delay in front of it (pure).

Why a limit, and why this signal (measured on 2 cores with the GPU-speed stand-in, issue 33):
a grpc.aio server picks up one call at a time, a few event-loop turns per call, so
the more calls a process has in flight, the longer each turn and the slower it picks up the
next. Past capacity the calls waiting to be picked up (inside grpc's C core, before any Python
sees them) form a standing queue: every caller's patience becomes waiting time and every answer
is late. Neither the event loop's lag (a few ms while calls waited 300 ms) nor a call's time
inside the process (20-50 ms) shows that queue, so the door measures it directly with a probe
call through the same queue (services.common.door), and bounds calls in flight: with 32 in
flight a flood at twice capacity is picked up as fast as it arrives; with 96, or none, nothing
is answered within the SLO.

The rule is AIMD on the probe's delay, with CoDel's distinction between a good queue and a bad
one (Nichols and Jacobson): from rest, a delay above `target_s` backs the limit off only once
it has stayed above for `interval_s`, so a burst that drains within the interval is absorbed
whole; once limited, a fifth of the interval above the target backs off again (as CoDel,
having dropped recently, drops again sooner), from the calls actually in flight (as TCP
backs off from the data in flight, not from a window it never filled): a queue that grows
with 50 calls in flight is not cured by a limit of 128 times anything. Below the target the
limit grows while calls use it, and returns to `initial` while they do not (up from a
back-off, down from growth past it), so a cold burst after a flood finds room again and one
after a busy spell meets the limit at rest.

A limit on calls in flight bounds the queue only while the process holds many: one that picks
calls up slower than they come (grpc.aio asks for the next call only once its loop has taken
the last, a few loop turns each; measured with the identity model's flood, 0-2 calls in flight
under a limit of 8 while the probe waited 0.57 s) admits every call it picks up, each late. So
while the queue stands (above the target for the interval, or a fifth of it once limited), its
delay is past `shed_factor` targets and calls in flight stay short of the limit, the limit also
sheds (`is_shedding`): the door refuses every call over its caller's share as it leaves the
queue, whatever is in flight, until a measurement finds otherwise (`update`). Refused calls
cost about one echo call where served ones cost three to four, so the queue drains. Where calls
in flight reach the limit (a model whose calls wait for batches, as the stand-in's), the limit
alone acts: it is what holds calls back there. Measured on this machine's floods, shedding
showed no effect on goodput inside their noise (docs/benchmarks.md item 6).

Time comes in as `now_s`; nothing here reads a clock.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from services.common.standing_queue import StandingQueue

#: A refusal's retry hint is at most this many of the limit's intervals (`retry_after_s`).
MAX_HINT_INTERVALS = 10.0


@dataclass(frozen=True)
class LimitConfig:
    """Settings of a `QueueDelayLimit`."""

    #: The limit at rest: at start, and where it returns once unused. As high as the maximum
    #: by default, so that only a queue that stood ever limits calls: a burst, however large,
    #: is admitted whole (issue 33: a cold burst of 64 is served whole; the e2e sends 200).
    initial: int = 4096
    #: The limit never backs off below this.
    minimum: int = 8
    #: Nor grows above this.
    maximum: int = 4096
    #: Queue delay a good queue stays under, seconds.
    target_s: float = 0.025
    #: How long the delay must stay above `target_s` before the queue counts as standing (from
    #: rest). Long enough for several probes, and for a large burst to be picked up, so that a
    #: burst or a process briefly short of CPU (a neighbour's burst, a pod at its CPU quota)
    #: is not taken for a standing queue.
    interval_s: float = 0.5
    #: Factor the limit is multiplied by at each probe while the queue stands.
    backoff: float = 0.75
    #: Share of the limit added at each probe below the target (at least one call).
    growth: float = 0.1
    #: Factor the limit moves by at each probe below the target while unused, back to `initial`
    #: (up from a back-off, down from growth past it).
    recovery: float = 1.5
    #: A delay counts against the limit only while the process was busy at least this share of
    #: one core. A process starved of CPU by its neighbours (or at its pod's CPU quota) waits
    #: however few calls it holds, and refusing would not help it: measured, a gateway beside
    #: the parallel test suite, with about 8 calls in flight, backed off and refused calls its
    #: neighbours had delayed. Past what it can pick up, a gateway runs near a whole core.
    min_busy_share: float = 0.5
    #: While the queue stands, the door sheds (refuses every call over its caller's share,
    #: whatever is in flight) once its delay is past this multiple of `target_s` (half the
    #: SLO, for the target derived as a quarter of it): a call that waited that long before
    #: any work is likely late however it is served. 0: never sheds.
    shed_factor: float = 2.0
    #: A limit counts as used when calls in flight reached this share of it since the last
    #: probe; only a used limit grows past `initial`.
    used_share: float = 0.9

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.initial <= self.maximum:
            raise ValueError("limits must satisfy 1 <= minimum <= initial <= maximum")
        if not (0 < self.target_s < math.inf and 0 < self.interval_s < math.inf):
            # An infinite interval made every refusal's retry hint infinite (an internal error
            # where RESOURCE_EXHAUSTED was meant).
            raise ValueError("target_s and interval_s must be finite and > 0")
        if not (0 < self.backoff < 1 and self.growth > 0 and self.recovery > 1):
            raise ValueError("backoff must be in (0, 1), growth > 0 and recovery > 1")
        if not (0 < self.used_share <= 1 and self.min_busy_share >= 0):
            raise ValueError("used_share must be in (0, 1] and min_busy_share >= 0")
        if not (self.shed_factor == 0 or 1 <= self.shed_factor < float("inf")):
            raise ValueError("shed_factor must be 0 (never shed) or in [1, inf)")


class QueueDelayLimit:
    """How many calls a process takes in flight at once, from the measured queue delay."""

    def __init__(self, config: LimitConfig) -> None:
        self.config = config
        self._limit = float(config.initial)
        self._queue = StandingQueue(config.target_s, config.interval_s)
        #: The last delay measured, seconds: how long the queue took to drain recently.
        self.last_delay_s = 0.0
        self._last_backoff_s: float | None = None
        #: When the last measurement found the process starved of CPU (-inf: never).
        self._starved_s = -math.inf
        #: Whether every call over its caller's share is refused now, whatever is in flight
        #: (as of the last update): see `update`.
        self.is_shedding = False

    @property
    def limit(self) -> int:
        return int(self._limit)

    def retarget(self, target_s: float) -> None:
        """A new queue-delay target (the SLO it derives from changed); the limit and the
        queue's history stay."""
        self.config = dataclasses.replace(self.config, target_s=target_s)
        self._queue.target_s = target_s

    @property
    def is_standing(self) -> bool:
        """Whether the queue has stayed above its target for at least the interval (as of the
        last update)."""
        return self._queue.is_standing

    def update(
        self, now_s: float, delay_s: float, peak_in_flight: int, busy_share: float = 1.0
    ) -> None:
        """One measurement: the queue's delay now, the most calls in flight since the last
        update, and the share of one core the process used since then."""
        config = self.config
        self.last_delay_s = delay_s
        self._queue.observe(now_s, delay_s)
        was_shedding, self.is_shedding = self.is_shedding, False
        if delay_s > config.target_s and busy_share < config.min_busy_share:
            self._starved_s = now_s
            # Not this process's queue: it waits for CPU, not for its own calls. A limit moved
            # before (backed off by a flood here, or grown) protects nothing now: unused, it
            # returns to `initial` as below the target, or neighbours draining their backlog
            # would hold it down.
            if peak_in_flight < config.used_share * self._limit:
                self._return_to_initial()
            return
        if delay_s > config.target_s:
            # At rest, only a queue that stood for the interval is backed off from: a burst is
            # absorbed. Once limited (a flood began and has not ended), a fifth of it will do:
            # the flood is still there, and waiting a whole interval lets it queue again.
            # Either way, time above counts from the last back-off, not only from when the
            # delay rose: one back-off per stretch, whatever the rate of measurements.
            is_limited = self._limit < config.initial
            # A starved stretch is not this process's queue standing: counted from after it.
            stood_s = min(self._queue.above_for_s(now_s), now_s - self._starved_s)
            needed_s = config.interval_s / 5 if is_limited else config.interval_s
            above_s = stood_s
            if self._last_backoff_s is not None:
                above_s = min(above_s, now_s - self._last_backoff_s)
            # While shedding, and at the measurement that ends it, what is in flight is what
            # shedding left, not what the process can hold: no back-off from it.
            if above_s >= needed_s and not was_shedding:
                in_use = min(self._limit, float(peak_in_flight))
                self._limit = max(float(config.minimum), in_use * config.backoff)
                self._last_backoff_s = now_s
            # While it stands with calls waiting past `shed_delay_s` and the limit (as it is
            # now, backed off or not) is not what holds calls back, the queue sheds: a limit
            # on calls in flight cannot drain a queue that stands before them (a process that
            # picks calls up slower than they come holds few in flight, under any limit), so
            # calls are refused as they leave it until a measurement finds it shorter (as
            # CoDel drops while its queue stands). Where calls in flight reach the limit, the
            # limit acts alone.
            is_late = config.shed_factor > 0 and delay_s > self.shed_delay_s
            is_binding = peak_in_flight >= config.used_share * self._limit
            self.is_shedding = is_late and stood_s >= needed_s and not is_binding
            return
        if peak_in_flight >= config.used_share * self._limit:
            step = max(1.0, self._limit * config.growth)
            self._limit = min(float(config.maximum), self._limit + step)
        else:
            # Demand is below the limit and the queue is short: nothing to protect, so the
            # limit returns to `initial` quickly, ready for the next burst.
            self._return_to_initial()

    def _return_to_initial(self) -> None:
        """One step back to `initial`, by `recovery`: up from a back-off, or down from growth
        past it (a cold burst after a busy spell meets the limit at rest, not the spell's)."""
        initial, recovery = float(self.config.initial), self.config.recovery
        if self._limit < initial:
            self._limit = min(initial, self._limit * recovery)
        elif self._limit > initial:
            self._limit = max(initial, self._limit / recovery)

    @property
    def shed_delay_s(self) -> float:
        """The delay past which a standing queue sheds, seconds (`shed_factor` targets)."""
        return self.config.shed_factor * self.config.target_s

    def stop_shedding(self) -> None:
        """Ends shedding until the next measurement says otherwise (measurements stopped: the
        door stops, or its server does)."""
        self.is_shedding = False

    def dropped_probe_delay_s(self, waited_s: float) -> float:
        """The delay a probe that grpc dropped unseen counts as (it found the calls of its
        method waiting to be picked up past the process's bound, a queue over the target
        however soon the drop came): the longest of its wait, the last delay and twice the
        target."""
        return max(waited_s, self.last_delay_s, 2 * self.config.target_s)

    def retry_after_s(self) -> float:
        """How long a refused caller should wait: the time the queue recently took to drain,
        at least the interval over which it is judged and at most MAX_HINT_INTERVALS of it (a
        delay measured across one long stall, a paused process's, would send callers away
        for as long after the queue drained)."""
        interval_s = self.config.interval_s
        return min(max(self.last_delay_s, interval_s), MAX_HINT_INTERVALS * interval_s)
