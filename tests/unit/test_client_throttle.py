"""The slim client's adaptive throttling (inference_fabric_client.throttle): time and chance
given as arguments, against a made-up gateway that takes a fixed number of calls a second."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest
from inference_fabric_client.throttle import (
    AdaptiveThrottle,
    ModelThrottles,
    ThrottleCounts,
    ThrottlePolicy,
    is_accepted,
)

pytestmark = pytest.mark.unit


@dataclass
class Second:
    """What happened in one second of a `flood`."""

    num_asked: int = 0
    num_sent: int = 0
    num_taken: int = 0

    @property
    def refused_here_share(self) -> float:
        return 1 - self.num_sent / self.num_asked if self.num_asked else 0.0


@dataclass
class Gateway:
    """Takes `capacity_per_s` calls a second (a bucket a twentieth of a second deep, full at
    first) and refuses the rest; a call taken is answered `taken_after_s` later, a refusal
    `refused_after_s` later."""

    capacity_per_s: float
    taken_after_s: float = 0.0
    refused_after_s: float = 0.0
    _tokens: float | None = None
    _last_s: float = 0.0
    #: (answered at, taken, asked at)
    answers: list[tuple[float, bool, float]] = field(default_factory=list)

    def send(self, now_s: float) -> bool:
        depth = self.capacity_per_s / 20
        tokens = depth if self._tokens is None else self._tokens
        self._tokens = min(depth, tokens + (now_s - self._last_s) * self.capacity_per_s)
        self._last_s = now_s
        is_taken = self._tokens >= 1
        self._tokens -= is_taken
        after_s = self.taken_after_s if is_taken else self.refused_after_s
        heapq.heappush(self.answers, (now_s + after_s, is_taken, now_s))
        return is_taken

    def answer_until(self, now_s: float, throttle: AdaptiveThrottle) -> None:
        while self.answers and self.answers[0][0] <= now_s:
            answered_s, is_taken, _ = heapq.heappop(self.answers)
            throttle.record(answered_s, accepted=is_taken)


def flood(
    throttle: AdaptiveThrottle,
    gateway: Gateway,
    phases: list[tuple[float, float]],
    seed: int = 0,
) -> list[Second]:
    """Poisson calls at each phase's rate for its seconds ((seconds, calls/s) in turn), each
    sent if the throttle admits it; what happened, second by second."""
    draws = random.Random(seed)
    seconds: list[Second] = []
    now_s = end_s = 0.0
    for duration_s, rate_per_s in phases:
        end_s += duration_s
        while (now_s := now_s + draws.expovariate(rate_per_s)) < end_s:
            gateway.answer_until(now_s, throttle)
            while len(seconds) <= int(now_s):
                seconds.append(Second())
            second = seconds[int(now_s)]
            second.num_asked += 1
            if throttle.admits(now_s, draws.random()):
                second.num_sent += 1
                second.num_taken += gateway.send(now_s)
        now_s = end_s
    return seconds


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("factor", [2, 10])
def test_a_flooding_client_sends_about_accept_ratio_times_what_the_gateway_takes(
    seed: int, factor: int
) -> None:
    """At twice and ten times what the gateway takes, the client sends it at most 1.25 times what
    it takes (unthrottled, 2 and 10 times; at the SRE book's K of 2, 2 times), and the gateway
    takes what it can."""
    gateway = Gateway(capacity_per_s=1000, taken_after_s=0.02)
    seconds = flood(AdaptiveThrottle(), gateway, [(8, 1000 * factor)], seed)
    assert len(seconds) == 8
    for second in seconds[3:]:
        assert 950 <= second.num_taken <= 1050
        assert second.num_sent / second.num_taken <= 1.25


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calls_are_sent_whole_again_once_the_gateway_has_refused_none_for_quiet_s(
    seed: int,
) -> None:
    """After a 10x flood, at half what the gateway takes: the client goes on refusing most
    calls (what it sends grows only by a tenth a window while the gateway refuses none of it),
    until the gateway has refused none for `quiet_s` (5 s); then none. With the book's counting
    throughout, most for tens of seconds."""
    gateway = Gateway(capacity_per_s=1000, taken_after_s=0.02)
    seconds = flood(AdaptiveThrottle(), gateway, [(6, 10_000), (10, 500)], seed)
    assert seconds[5].refused_here_share > 0.8
    assert seconds[9].refused_here_share > 0.5
    assert all(second.refused_here_share == 0 for second in seconds[12:])
    assert all(second.num_taken == second.num_sent for second in seconds[7:])


def test_calls_in_flight_count_in_nothing_so_a_burst_is_not_throttled_in_flight() -> None:
    """A call sent counts once answered: a burst to a healthy gateway is sent whole, and one to
    a gateway refusing as a flooded one does is refused at the window's chance, which does not
    grow while the burst is in flight."""
    healthy = AdaptiveThrottle(ThrottlePolicy())
    for _ in range(30):
        assert healthy.admits(0.0, draw=0.0)
        healthy.record(0.0, accepted=True)
    assert all(healthy.admits(0.1, draw=0.0) for _ in range(64))
    assert healthy.counts(0.1) == ThrottleCounts(num_requests=30, num_accepts=30,
                                                 is_refusing=False)  # fmt: skip

    refusing = AdaptiveThrottle(ThrottlePolicy())
    for index in range(30):  # one in three refused, every call sent (draws of 0.999)
        assert refusing.admits(0.0, draw=0.999)
        refusing.record(0.0, accepted=index % 3 != 0)
    assert refusing.refusal_probability(0.0) == pytest.approx((30 - 1.1 * 20) / 31)
    assert all(refusing.admits(0.1, draw=0.3) for _ in range(64))  # 0.3 > 8 / 31
    assert refusing.refusal_probability(0.1) == pytest.approx(8 / 31)


def test_nothing_is_refused_while_the_gateway_accepts_at_least_one_in_accept_ratio() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(accept_ratio=2.0, min_requests=0))
    for index in range(100):  # every other call refused by the gateway: half accepted
        assert throttle.admits(0.0, draw=0.0)
        throttle.record(0.0, accepted=index % 2 == 0)
    assert throttle.refusal_probability(0.0) == 0.0
    assert throttle.counts(0.0).num_accepts == 50


def test_the_chance_follows_the_formula_while_the_gateway_refuses_more() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(accept_ratio=1.1, min_requests=0))
    for index in range(100):  # 60 accepted, then 40 refused, every call sent (draws of 0.999)
        assert throttle.admits(0.0, draw=0.999)
        throttle.record(0.0, accepted=index < 60)
    # (requests - K * accepts) / (requests + 1) = (100 - 66) / 101
    assert throttle.refusal_probability(0.0) == pytest.approx(34 / 101)
    assert throttle.admits(0.0, draw=0.34) and not throttle.admits(0.0, draw=0.33)
    # The call in flight counts in nothing, the one refused here as a request.
    assert throttle.refusal_probability(0.0) == pytest.approx((101 - 66) / 102)


def test_the_gateway_counts_as_refusing_until_it_refused_none_for_quiet_s() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(min_requests=0, window_s=10.0))
    for index in range(20):  # one in four accepted, at 0.0
        assert throttle.admits(0.0, draw=0.999)
        throttle.record(0.0, accepted=index % 4 == 0)
    assert throttle.counts(4.9) == ThrottleCounts(num_requests=20, num_accepts=5,
                                                  is_refusing=True)  # fmt: skip
    assert throttle.refusal_probability(4.9) == pytest.approx((20 - 1.1 * 5) / 21)
    assert throttle.refusal_probability(5.0) == 0.0  # none refused for 5 s
    assert throttle.counts(5.0).is_refusing is False
    assert throttle.admits(5.0, draw=0.0)
    throttle.record(5.1, accepted=False)  # refusing again: the window's counts apply
    assert throttle.refusal_probability(5.1) == pytest.approx((21 - 1.1 * 5) / 22)


def test_no_call_is_refused_below_min_requests_in_the_window() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(min_requests=20))
    for _ in range(20):  # 0..19 asked before each: none refused, whatever the draw
        assert throttle.admits(0.0, draw=0.0)
        throttle.record(0.0, accepted=False)
    assert not throttle.admits(0.0, draw=0.0)  # 20: (20 - 0) / 21


def test_calls_older_than_the_window_are_forgotten_slice_by_slice() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(window_s=1.0, min_requests=0))
    for index in range(10):  # each in a slice of its own: 0.11 s apart, slices 0.1 s long
        assert throttle.admits(index * 0.11, draw=0.5)
        throttle.record(index * 0.11, accepted=True)
    # At 1.05 the first slice (from 0.0) is a window old, the second (from 0.11) is not.
    assert throttle.counts(1.05).num_requests == 9
    assert throttle.counts(1.95).num_requests == 1  # only the last (from 0.99) is left
    assert throttle.retry_after_s == pytest.approx(0.1)


def test_only_refusals_and_drops_count_as_not_accepted() -> None:
    for code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE", "DEADLINE_EXCEEDED"):
        assert is_accepted(code)
    for code in ("RESOURCE_EXHAUSTED", "CANCELLED"):
        assert not is_accepted(code)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"accept_ratio": 1.0}, "accept_ratio"),
        ({"window_s": 0.0}, "window_s"),
        ({"min_requests": -1}, "min_requests"),
        ({"quiet_s": 0.0}, "quiet_s"),
        # Infinite, no count leaves the window (or the quiet never comes): refused for good.
        ({"window_s": float("inf")}, "window_s"),
        ({"quiet_s": float("inf")}, "quiet_s"),
    ],
)
def test_a_bad_policy_is_refused(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThrottlePolicy(**settings)  # type: ignore[arg-type]


def test_one_throttle_a_model_and_idle_ones_dropped_past_max_kept() -> None:
    throttles = ModelThrottles(ThrottlePolicy())
    first = throttles.of("a", now_s=0.0)
    assert throttles.of("a", now_s=0.0) is first
    refused = throttles.of("refused", now_s=0.0)
    assert refused.admits(0.0, draw=0.5)
    refused.record(0.0, accepted=False)
    in_flight = throttles.of("in flight", now_s=0.0)
    assert in_flight.admits(0.0, draw=0.5)  # sent, its answer not yet recorded
    for index in range(ModelThrottles.MAX_KEPT - 3):
        throttles.of(f"m{index}", now_s=0.0)
    assert len(throttles) == ModelThrottles.MAX_KEPT
    # 3 s on, every window is empty; "refused" is still in its quiet period and is kept, and
    # "in flight" has a call out, whose end it must count.
    throttles.of("new", now_s=3.0)
    assert len(throttles) == 3
    assert throttles.of("refused", now_s=3.0) is refused
    assert throttles.of("in flight", now_s=3.0) is in_flight
    assert throttles.of("a", now_s=3.0) is not first
    in_flight.record(3.0, accepted=True)
    assert not in_flight.is_idle(3.0)  # its answer is in the window
    assert in_flight.is_idle(6.5)


def test_a_throttle_taken_for_a_call_is_not_dropped_before_the_call_counts() -> None:
    """Thread A takes model m's throttle (`of`); before A asks `admits`, thread B's `of` for
    a new model, past MAX_KEPT, found m's idle and dropped it: A's call, a refusal too, then
    counted in a throttle no one used, and m's next calls started from nothing (review
    finding). A throttle taken is kept for its window."""
    throttles = ModelThrottles(ThrottlePolicy())
    for index in range(ModelThrottles.MAX_KEPT - 1):
        throttles.of(f"m{index}", now_s=0.0)
    taken = throttles.of("m", now_s=10.0)  # thread A, between `of` and `admits`
    throttles.of("new", now_s=10.0)  # thread B
    assert throttles.of("m", now_s=10.0) is taken
    assert len(throttles) == 2  # the others, idle since 0, were dropped
