"""The simulator's clock: a heap of (time, seq, action, argument) events.

`seq` breaks ties in scheduling order, so two events at one instant run first-scheduled first
and a run is reproducible. Actions take the event's time and its argument.

Events that are scheduled in time order anyway (arrivals, each scheduled by the one before it;
a fixed hop delay after each routing) may go into a `Line` instead: a FIFO merged with the heap
in the same (time, seq) order, so they run exactly when heap events would, without a heap push
and pop each (the heap's cost grows with the events pending, and a line's does not).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

Action = Callable[[float, Any], None]
_Event = tuple[float, int, Action, Any]


class Line:
    """Events put in time order (each no earlier than the one put before it); see EventLoop."""

    __slots__ = ("_events", "_loop")

    def __init__(self, loop: EventLoop) -> None:
        self._loop = loop
        self._events: deque[_Event] = deque()

    def at(self, time_s: float, action: Action, argument: Any = None) -> None:
        """Runs `action(time_s, argument)` at `time_s` (a time in the past runs at `now_s`),
        as `EventLoop.at` does. Raises ValueError before the time of the last event put."""
        loop = self._loop
        if time_s < loop.now_s:
            time_s = loop.now_s
        events = self._events
        if events and time_s < events[-1][0]:
            raise ValueError(f"line event at {time_s}s after one at {events[-1][0]}s")
        events.append((time_s, next(loop._seq), action, argument))

    def __len__(self) -> int:
        return len(self._events)


class EventLoop:
    """Runs scheduled actions in time order; `now_s` is the time of the event running."""

    def __init__(self) -> None:
        self._heap: list[_Event] = []
        self._seq = itertools.count()
        self._lines: list[Line] = []
        # The lines' queues, for `run` (kept current as lines are added).
        self._line_events: list[deque[_Event]] = []
        self.now_s = 0.0
        #: Events run so far (a measure of the simulation's work).
        self.num_events = 0

    def at(self, time_s: float, action: Action, argument: Any = None) -> None:
        """Runs `action(time_s, argument)` at `time_s`; a time in the past runs at `now_s`."""
        heapq.heappush(self._heap, (max(time_s, self.now_s), next(self._seq), action, argument))

    def after(self, delay_s: float, action: Action, argument: Any = None) -> None:
        self.at(self.now_s + delay_s, action, argument)

    def line(self) -> Line:
        """A new line of events (see the module's docstring)."""
        line = Line(self)
        self._lines.append(line)
        self._line_events.append(line._events)
        return line

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
        queues = self._line_events
        while True:
            # The earliest of the heap's top and the lines' heads; seqs are unique, so the
            # tuples never compare past them.
            event = heap[0] if heap else None
            source = None
            for events in queues:
                if events and (event is None or events[0] < event):
                    event, source = events[0], events
            if event is None or event[0] > until_s:
                break
            if source is None:
                pop(heap)
            else:
                source.popleft()
            time_s, _, action, argument = event
            self.now_s = time_s
            self.num_events += 1
            action(time_s, argument)
        self.now_s = max(self.now_s, until_s)

    @property
    def num_pending(self) -> int:
        return len(self._heap) + sum(len(line) for line in self._lines)
