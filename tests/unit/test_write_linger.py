"""When a stream's writer holds a message back: only while calls come often and many are in
flight."""

from __future__ import annotations

import pytest

from services.common.write_linger import LingerConfig, WriteLinger

pytestmark = pytest.mark.unit

BUSY = 32  # calls in flight


def arrivals(linger: WriteLinger, gap_s: float, count: int, start_s: float = 0.0) -> float:
    now_s = start_s
    for _ in range(count):
        linger.arrived(now_s)
        now_s += gap_s
    return now_s


def test_light_load_sends_at_once() -> None:
    linger = WriteLinger(LingerConfig(linger_s=0.001))
    assert linger.delay_s(1, BUSY) == 0.0  # no call seen yet: no rate
    arrivals(linger, gap_s=0.005, count=50)  # 200 calls/s: 0.2 expected within 1 ms
    assert linger.delay_s(1, BUSY) == 0.0


def test_heavy_load_holds_a_short_message_and_sends_a_full_one() -> None:
    linger = WriteLinger(LingerConfig(linger_s=0.001, fill=8))
    arrivals(linger, gap_s=0.0002, count=50)  # 5,000 calls/s: about 5 join in 1 ms
    assert linger.delay_s(1, BUSY) == 0.001
    assert linger.delay_s(7, BUSY) == 0.001
    assert linger.delay_s(8, BUSY) == 0.0


def test_half_a_call_expected_within_the_linger_is_enough() -> None:
    linger = WriteLinger(LingerConfig(linger_s=0.001, min_expected_calls=0.5))
    arrivals(linger, gap_s=0.0018, count=50)  # about 550 calls/s
    assert linger.delay_s(1, BUSY) == 0.001
    arrivals(linger, gap_s=0.0025, count=200, start_s=1.0)  # 400 calls/s
    assert linger.delay_s(1, BUSY) == 0.0


def test_few_calls_in_flight_are_never_held() -> None:
    # Four callers, each waiting for its answer: holding one call delays the others' next.
    linger = WriteLinger(LingerConfig(linger_s=0.001, min_in_flight=8))
    arrivals(linger, gap_s=0.0001, count=50)
    assert linger.delay_s(1, 4) == 0.0
    assert linger.delay_s(1, 8) == 0.001


def test_calls_expected_within_a_window_follow_the_rate() -> None:
    linger = WriteLinger(LingerConfig(smoothing=1.0))
    assert linger.expected_calls(0.01) == 0.0  # no gap seen yet: no rate
    arrivals(linger, gap_s=0.002, count=3)  # 500 calls/s
    assert linger.expected_calls(0.01) == pytest.approx(5.0)
    assert linger.expected_calls(0.0) == 0.0
    linger.arrived(0.004)  # a gap of 0: as many as you like, but none within no time
    assert linger.expected_calls(0.001) == float("inf")
    assert linger.expected_calls(0.0) == 0.0


def test_a_silence_stops_the_lingering_at_once() -> None:
    linger = WriteLinger(LingerConfig(linger_s=0.001, smoothing=0.1))
    now_s = arrivals(linger, gap_s=0.0001, count=100)
    assert linger.delay_s(1, BUSY) > 0
    linger.arrived(now_s + 1.0)  # one second of nothing, then a call
    assert linger.delay_s(1, BUSY) == 0.0


def test_lingering_resumes_as_the_rate_builds_up_again() -> None:
    linger = WriteLinger(LingerConfig(linger_s=0.001, smoothing=0.2))
    now_s = arrivals(linger, gap_s=0.010, count=20)
    assert linger.delay_s(1, BUSY) == 0.0
    arrivals(linger, gap_s=0.0001, count=40, start_s=now_s)
    assert linger.delay_s(1, BUSY) == 0.001


def test_zero_linger_never_holds() -> None:
    linger = WriteLinger(LingerConfig(linger_s=0.0))
    arrivals(linger, gap_s=0.0, count=10)
    assert linger.delay_s(1, BUSY) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [{"linger_s": -0.001}, {"fill": 0}, {"smoothing": 0.0}, {"smoothing": 1.5},
     {"min_expected_calls": 0.0}, {"min_in_flight": -1}],
)  # fmt: skip
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LingerConfig(**kwargs)
