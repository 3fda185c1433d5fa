"""The slim client's adaptive throttling (inference_fabric_client.throttle): time and chance
given as arguments."""

from __future__ import annotations

import random

import pytest
from inference_fabric_client.throttle import (
    AdaptiveThrottle,
    ThrottlePolicy,
    is_accepted,
)

pytestmark = pytest.mark.unit


def _calls(throttle: AdaptiveThrottle, count: int, *, accepted: bool, now_s: float = 0.0) -> int:
    """`count` calls at `now_s`, each drawing 0.5 and, if sent, ending `accepted` or not;
    returns how many were sent."""
    num_sent = 0
    for _ in range(count):
        if throttle.admits(now_s, draw=0.5):
            num_sent += 1
            throttle.record(now_s, accepted=accepted)
    return num_sent


def test_nothing_is_refused_while_the_gateway_accepts_at_least_one_in_accept_ratio() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(accept_ratio=2.0, min_requests=0))
    for index in range(100):  # every other call refused by the gateway: half accepted
        assert throttle.admits(0.0, draw=0.0)
        throttle.record(0.0, accepted=index % 2 == 0)
    assert throttle.refusal_probability(0.0) == 0.0
    assert throttle.counts(0.0) == (100, 50)


def test_the_chance_follows_the_formula_once_the_gateway_refuses_more() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(accept_ratio=1.1, min_requests=0))
    for index in range(100):  # 60 accepted, then 40 refused, every call sent (draws of 1.0)
        assert throttle.admits(0.0, draw=0.999)
        throttle.record(0.0, accepted=index < 60)
    # (requests - K * accepts) / (requests + 1) = (100 - 66) / 101
    assert throttle.refusal_probability(0.0) == pytest.approx(34 / 101)
    assert throttle.admits(0.0, draw=0.34) and not throttle.admits(0.0, draw=0.33)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_a_flooding_client_sends_about_accept_ratio_times_what_the_gateway_takes(
    seed: int,
) -> None:
    """The gateway takes 100 calls a second of the 1,000 a second the client is asked to make,
    and refuses the rest: the client sends it about 1.1 times what it takes (it would send 10
    times as much unthrottled, twice as much at the SRE book's K of 2)."""
    draws = random.Random(seed)
    throttle = AdaptiveThrottle(ThrottlePolicy())
    num_taken_total = num_sent = num_taken = 0  # sent and taken in the last 3 s
    for step in range(5000):  # 5 s, a call each ms
        now_s = step / 1000
        if throttle.admits(now_s, draws.random()):
            is_taken = num_taken_total < 100 * now_s  # the gateway's 100/s
            num_taken_total += is_taken
            throttle.record(now_s, accepted=is_taken)
            if now_s >= 2.0:
                num_sent, num_taken = num_sent + 1, num_taken + is_taken
    assert 280 <= num_taken <= 320  # the gateway takes what it can: about 100/s
    assert 1.0 <= num_sent / num_taken <= 1.25


def test_calls_in_flight_do_not_count_so_a_burst_to_a_healthy_gateway_is_sent_whole() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(min_requests=0))
    assert all(throttle.admits(0.0, draw=0.0) for _ in range(64))  # none answered yet
    for _ in range(64):
        throttle.record(0.1, accepted=True)
    assert throttle.counts(0.1) == (64, 64)


def test_no_call_is_refused_below_min_requests_in_the_window() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(min_requests=20))
    for _ in range(20):  # 0..19 counted before each: none refused, whatever the draw
        assert throttle.admits(0.0, draw=0.0)
        throttle.record(0.0, accepted=False)
    assert throttle.refusal_probability(0.0) == pytest.approx(20 / 21)
    assert not throttle.admits(0.0, draw=0.0)


def test_a_call_refused_here_counts_as_a_request_and_never_as_an_accept() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(min_requests=0))
    assert throttle.admits(0.0, draw=0.0)  # nothing counted yet: chance 0
    throttle.record(0.0, accepted=False)
    assert not throttle.admits(0.0, draw=0.0)  # chance (1 - 0) / 2, above the draw
    assert throttle.counts(0.0) == (2, 0)
    assert throttle.refusal_probability(0.0) == pytest.approx(2 / 3)


def test_calls_older_than_the_window_are_forgotten() -> None:
    """A flood's refusals stop counting within `window_s` of its end: the client sends every
    call again."""
    throttle = AdaptiveThrottle(ThrottlePolicy(window_s=2.0, min_requests=5))
    _calls(throttle, 50, accepted=False)
    assert throttle.refusal_probability(0.0) > 0.5
    # Half the window later the flood still counts.
    assert throttle.counts(1.0)[1] == 0 and throttle.refusal_probability(1.0) > 0.5
    assert throttle.counts(2.0) == (0, 0)  # its slice is a window old: forgotten
    assert _calls(throttle, 30, accepted=True, now_s=2.0) == 30


def test_the_window_slides_slice_by_slice() -> None:
    throttle = AdaptiveThrottle(ThrottlePolicy(window_s=1.0, min_requests=0))
    for index in range(10):  # each in a slice of its own: 0.11 s apart, slices 0.1 s long
        _calls(throttle, 1, accepted=True, now_s=index * 0.11)
    # At 1.05 the first slice (from 0.0) is a window old, the second (from 0.11) is not.
    assert throttle.counts(1.05) == (9, 9)
    assert throttle.counts(1.95) == (1, 1)  # only the last (from 0.99) is left


def test_outcomes_that_count_as_accepted() -> None:
    for code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE"):
        assert is_accepted(code)
    for code in ("RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED"):
        assert not is_accepted(code)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"accept_ratio": 0.9}, "accept_ratio"),
        ({"window_s": 0.0}, "window_s"),
        ({"min_requests": -1}, "min_requests"),
    ],
)
def test_a_bad_policy_is_refused(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThrottlePolicy(**settings)  # type: ignore[arg-type]
