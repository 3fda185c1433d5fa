"""The simulator's clock: a heap of (time, seq, action, argument) events.

`seq` breaks ties in scheduling order, so two events at one instant run first-scheduled first
and a run is reproducible. Actions take the event's time and its argument.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

Action = Callable[[float, Any], None]


class EventLoop:
    """Runs scheduled actions in time order; `now_s` is the time of the event running."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Action, Any]] = []
        self._seq = itertools.count()
        self.now_s = 0.0
        #: Events run so far (a measure of the simulation's work).
        self.num_events = 0

    def at(self, time_s: float, action: Action, argument: Any = None) -> None:
        """Runs `action(time_s, argument)` at `time_s`; a time in the past runs at `now_s`."""
        heapq.heappush(self._heap, (max(time_s, self.now_s), next(self._seq), action, argument))

    def after(self, delay_s: float, action: Action, argument: Any = None) -> None:
        self.at(self.now_s + delay_s, action, argument)

    def every(self, period_s: float, action: Action, *, start_s: float = 0.0) -> None:
        """Runs `action(time, None)` at start_s, start_s + period_s, ... until the run ends."""
        if period_s <= 0:
            raise ValueError("period_s must be > 0")

        def tick(now_s: float, _: Any) -> None:
            action(now_s, None)
            self.at(now_s + period_s, tick)

        self.at(start_s, tick)

    def run(self, until_s: float) -> None:
        """Runs every event due at or before `until_s`, in (time, seq) order; `now_s` ends at
        `until_s`. Events scheduled later stay queued (a later `run` continues them)."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until_s:
            time_s, _, action, argument = pop(heap)
            self.now_s = time_s
            self.num_events += 1
            action(time_s, argument)
        self.now_s = max(self.now_s, until_s)

    @property
    def num_pending(self) -> int:
        return len(self._heap)
