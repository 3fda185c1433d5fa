"""The simulator's event loop: time order, ties in scheduling order, periodic events."""

from __future__ import annotations

from typing import Any

import pytest

from services.sim.events import EventLoop

pytestmark = pytest.mark.unit


def test_events_run_in_time_order_whatever_the_scheduling_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, Any]] = []
    for time_s in (3.0, 1.0, 2.0):
        loop.at(time_s, lambda now_s, arg: seen.append((now_s, arg)), f"at {time_s}")
    loop.run(10.0)
    assert seen == [(1.0, "at 1.0"), (2.0, "at 2.0"), (3.0, "at 3.0")]
    assert loop.num_events == 3


def test_simultaneous_events_run_first_scheduled_first() -> None:
    loop = EventLoop()
    seen: list[str] = []
    for name in ("a", "b", "c"):
        loop.at(1.0, lambda _now, arg: seen.append(arg), name)
    loop.run(1.0)
    assert seen == ["a", "b", "c"]


def test_an_event_scheduled_in_the_past_runs_now_not_earlier() -> None:
    loop = EventLoop()
    seen: list[float] = []

    def schedule_in_past(now_s: float, _: Any) -> None:
        loop.at(now_s - 5.0, lambda later_s, _arg: seen.append(later_s))

    loop.at(2.0, schedule_in_past)
    loop.run(10.0)
    assert seen == [2.0]


def test_run_stops_at_until_and_a_later_run_continues() -> None:
    loop = EventLoop()
    seen: list[float] = []
    for time_s in (1.0, 5.0):
        loop.at(time_s, lambda now_s, _: seen.append(now_s))
    loop.run(3.0)
    assert seen == [1.0]
    assert loop.now_s == 3.0
    assert loop.num_pending == 1
    loop.run(6.0)
    assert seen == [1.0, 5.0]


def test_after_is_relative_to_the_running_event() -> None:
    loop = EventLoop()
    seen: list[float] = []
    loop.at(2.0, lambda _now, _: loop.after(0.5, lambda now_s, _a: seen.append(now_s)))
    loop.run(10.0)
    assert seen == [2.5]


def test_every_repeats_at_its_period_until_the_run_ends() -> None:
    loop = EventLoop()
    seen: list[float] = []
    loop.every(0.25, lambda now_s, _: seen.append(now_s), start_s=0.5)
    loop.run(1.5)
    assert seen == [0.5, 0.75, 1.0, 1.25, 1.5]


def test_every_refuses_a_period_that_would_never_advance() -> None:
    with pytest.raises(ValueError, match="period_s"):
        EventLoop().every(0.0, lambda _now, _: None)


def test_line_events_merge_with_heap_events_in_time_then_scheduling_order() -> None:
    loop = EventLoop()
    line = loop.line()
    seen: list[str] = []
    record = lambda _now, name: seen.append(name)  # noqa: E731
    line.at(1.0, record, "line 1.0")
    loop.at(1.0, record, "heap 1.0")  # same time, scheduled later: runs after
    loop.at(0.5, record, "heap 0.5")
    line.at(2.0, record, "line 2.0")
    loop.at(1.5, record, "heap 1.5")
    loop.run(10.0)
    assert seen == ["heap 0.5", "line 1.0", "heap 1.0", "heap 1.5", "line 2.0"]


def test_a_line_refuses_an_event_earlier_than_the_last_it_holds() -> None:
    loop = EventLoop()
    line = loop.line()
    line.at(2.0, lambda _now, _arg: None)
    with pytest.raises(ValueError, match="line event"):
        line.at(1.0, lambda _now, _arg: None)
