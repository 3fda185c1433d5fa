"""CoDel's test of a queue (Nichols and Jacobson, "Controlling Queue Delay"): a good queue
absorbs a burst and drains; a bad one stands. A queue is standing once the delay of everything
leaving it has stayed above `target_s` for at least `interval_s`; one departure at or below
the target shows it drained, and the interval starts again.

Pure: time comes in as `now_s`.
"""

from __future__ import annotations


class StandingQueue:
    """Whether a queue stands, from the delays observed as things leave it."""

    def __init__(self, target_s: float, interval_s: float) -> None:
        if not (target_s > 0 and interval_s > 0):
            raise ValueError("target_s and interval_s must be > 0")
        self.target_s = target_s
        self.interval_s = interval_s
        self._above_since_s: float | None = None
        self.is_standing = False

    def observe(self, now_s: float, delay_s: float) -> bool:
        """One delay seen at `now_s`; returns whether the queue stands now."""
        if delay_s <= self.target_s:
            self._above_since_s = None
        elif self._above_since_s is None:
            self._above_since_s = now_s
        self.is_standing = self.above_for_s(now_s) >= self.interval_s
        return self.is_standing

    def above_for_s(self, now_s: float) -> float:
        """How long the delay has stayed above the target (0 when it is not above)."""
        return 0.0 if self._above_since_s is None else now_s - self._above_since_s
