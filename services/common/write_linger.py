"""When a multiplexed stream's writer holds a message back to gather more calls (pure).

A stream message costs both ends a fixed slice of CPU (grpc's framing, a read, a parse)
however many calls it carries. But calls reach a gateway or a router one per turn of its event
loop (each is an RPC or a result of its own), so a writer that sends whatever is ready sends
one call per message even under heavy load: with 32 callers of the identity model through the
tiers (2 cores), 1.01 calls per message. Holding the message for `linger_s` gathers the calls
that arrive meanwhile. That pays under load: while calls come often enough that some are
expected within `linger_s` (a moving average of the gap between them) and many are in flight.
At light load, or with few callers (each waits for its answer before the next call), holding
a call only adds latency, so it leaves at once; so does a message already `fill` calls long.

Timers have millisecond resolution, hence 1 ms: asyncio's selector rounds a wait up to epoll's
millisecond; uvloop's clock counts whole milliseconds, so there a 1 ms hold lasts 0-1 ms
(services.common.event_loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.moving_average import MovingAverage


@dataclass(frozen=True)
class LingerConfig:
    #: How long a message may be held back, seconds (0: never).
    linger_s: float = 0.001
    #: A message with this many calls ready goes at once.
    fill: int = 16
    #: Hold only while at least this many calls are expected within `linger_s` (a moving
    #: average gap of at most linger_s / min_expected_calls) ...
    min_expected_calls: float = 0.5
    #: ... and at least this many are in flight: with few callers, holding one call back
    #: mostly delays the next ones (each waits for an answer), and gathers nothing.
    min_in_flight: int = 8
    #: Weight of the newest gap in the moving average of the gap between calls.
    smoothing: float = 0.1

    def __post_init__(self) -> None:
        if self.linger_s < 0 or self.fill < 1 or not 0 < self.smoothing <= 1:
            raise ValueError("linger_s >= 0, fill >= 1 and 0 < smoothing <= 1")
        if self.min_expected_calls <= 0 or self.min_in_flight < 0:
            raise ValueError("min_expected_calls must be > 0 and min_in_flight >= 0")


#: The tiers' streams: 1 ms, at once past 16 calls.
DEFAULT_LINGER = LingerConfig()


class WriteLinger:
    """Follows the rate of calls on one client; says how long to hold the next message."""

    def __init__(self, config: LingerConfig = DEFAULT_LINGER) -> None:
        self.config = config
        self._last_s: float | None = None
        self._gap = MovingAverage(config.smoothing)

    @property
    def mean_gap_s(self) -> float:
        """Moving average of the gap between consecutive calls, seconds (inf before two)."""
        return math.inf if self._gap.mean is None else self._gap.mean

    def arrived(self, now_s: float) -> None:
        """A call was queued at `now_s`."""
        if self._last_s is not None:
            self._gap.observe(max(0.0, now_s - self._last_s))
        self._last_s = now_s

    def expected_calls(self, within_s: float) -> float:
        """Calls expected to arrive within `within_s` at the moving average's rate."""
        if not within_s > 0:  # NaN too
            return 0.0
        return within_s / self.mean_gap_s if self.mean_gap_s > 0 else math.inf

    def delay_s(self, num_ready: int, num_in_flight: float) -> float:
        """How long to hold a message of `num_ready` calls, with `num_in_flight` calls on the
        stream not answered yet (these included), before sending it (0: now)."""
        config = self.config
        if (
            num_ready >= config.fill
            or num_in_flight < config.min_in_flight
            or self.expected_calls(config.linger_s) < config.min_expected_calls
        ):
            return 0.0
        return config.linger_s
