"""CoDel's test of a queue (Nichols and Jacobson, "Controlling Queue Delay"): a good queue
absorbs a burst and drains; a bad one stands. A queue is standing once the delay of everything
leaving it has stayed above `target_s` for at least `interval_s`; one departure at or below
the target shows it drained, and the interval starts again. With a hold (`hold_s`), a queue
that stood is drained only once no delay above the target, and nothing turned away from one
(`hold`), has been seen for that long.

Pure: time comes in as `now_s`.
"""

from __future__ import annotations


class StandingQueue:
    """Whether a queue stands, from the delays observed as things leave it. With `hold_s`, a
    queue that stood keeps standing until no delay above the target has been seen for that
    long, nor anything turned away from one (`hold`): one that empties at every departure (a
    batcher whose batch takes every row queued), or that is kept short by refusing, shows a
    drained queue between refills, which under a flood is not a drained queue."""

    def __init__(self, target_s: float, interval_s: float, *, hold_s: float = 0.0) -> None:
        if not (target_s > 0 and interval_s > 0 and hold_s >= 0):
            raise ValueError("target_s and interval_s must be > 0, and hold_s >= 0")
        self.target_s = target_s
        self.interval_s = interval_s
        self.hold_s = hold_s
        self._above_since_s: float | None = None
        #: When a delay above the target was last seen, or held for (`hold`), while it stood.
        self._last_above_s = 0.0
        self.is_standing = False

    def observe(self, now_s: float, delay_s: float) -> bool:
        """One delay seen at `now_s`; returns whether the queue stands now."""
        if delay_s <= self.target_s:
            self._above_since_s = None
        elif self._above_since_s is None:
            self._above_since_s = now_s
        if self.above_for_s(now_s) >= self.interval_s:
            self.is_standing = True
            self._last_above_s = now_s
        else:
            self.is_standing = self._is_held(now_s)
            if self.is_standing and delay_s > self.target_s:
                self._last_above_s = now_s
        return self.is_standing

    @property
    def last_above_s(self) -> float:
        """When the queue, standing, last saw a delay above the target or held for one."""
        return self._last_above_s

    def stands_at(self, now_s: float) -> bool:
        """Whether the queue stands at `now_s`, nothing having left it since the last delay
        observed: it stood, and that delay was above the target (what it left behind still
        waits) or its hold has not run out. A queue whose last departure left it drained
        stands no longer once its hold runs out, though nothing leaves to say so (a lane left
        with only rows it keeps back on purpose)."""
        return self.is_standing and (self._above_since_s is not None or self._is_held(now_s))

    def _is_held(self, now_s: float) -> bool:
        """Whether a queue that stood is still within its hold at `now_s` (never without one)."""
        return self.is_standing and now_s - self._last_above_s < self.hold_s

    def hold(self, now_s: float) -> None:
        """Something that would have waited above the target was turned away at `now_s`: a
        queue standing keeps standing (its hold starts again), as if it had left with that
        delay, since the queue is short only because it is turned away."""
        if self._is_held(now_s):
            self._last_above_s = now_s

    def above_for_s(self, now_s: float) -> float:
        """How long the delay has stayed above the target (0 when it is not above)."""
        return 0.0 if self._above_since_s is None else now_s - self._above_since_s
