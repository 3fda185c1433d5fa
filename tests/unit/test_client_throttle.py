"""The slim client's adaptive throttling (inference_fabric_client.throttle), with a fake clock
and fake chance."""

from __future__ import annotations

import pytest
from inference_fabric_client.throttle import (
    AdaptiveThrottle,
    ThrottlePolicy,
    is_accepted,
)

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _throttle(policy: ThrottlePolicy, draw: float = 0.5) -> tuple[AdaptiveThrottle, FakeClock]:
    """A throttle whose every draw is `draw` (a call is refused when its chance is above it)."""
    clock = FakeClock()
    return AdaptiveThrottle(policy, clock=clock, random=lambda: draw), clock


def _calls(throttle: AdaptiveThrottle, count: int, *, accepted: bool) -> int:
    """`count` calls, each sent one ending `accepted` or not; returns how many were sent."""
    sent = 0
    for _ in range(count):
        if throttle.admits():
            sent += 1
            throttle.record(accepted)
    return sent


def test_nothing_is_refused_while_the_gateway_accepts_at_least_one_in_accept_ratio() -> None:
    throttle, _ = _throttle(ThrottlePolicy(accept_ratio=2.0, min_requests=0), draw=0.0)
    for index in range(100):  # every other call refused by the gateway: half accepted
        assert throttle.admits()
        throttle.record(accepted=index % 2 == 0)
    assert throttle.refusal_probability() == 0.0
    assert throttle.counts() == (100, 50)


def test_the_chance_follows_the_formula_once_the_gateway_refuses_more() -> None:
    policy = ThrottlePolicy(accept_ratio=1.1, min_requests=0)
    throttle, _ = _throttle(policy, draw=1.0)  # a draw of 1.0 is never below a chance: all sent
    _calls(throttle, 60, accepted=True)
    _calls(throttle, 40, accepted=False)
    # (requests - K * accepts) / (requests + 1) = (100 - 66) / 101
    assert throttle.refusal_probability() == pytest.approx(34 / 101)


def test_a_client_flooding_a_refusing_gateway_sends_about_accept_ratio_times_what_it_accepts() -> (
    None
):  # noqa: E501
    """The gateway takes 100 calls a second of the 1,000 a second the client is asked to make,
    and refuses the rest; with real chance, the client sends it about 1.1 times what it takes
    (it would send 10 times as much unthrottled, twice as much at the SRE book's K of 2)."""
    import random

    clock = FakeClock()
    throttle = AdaptiveThrottle(ThrottlePolicy(), clock=clock, random=random.Random(7).random)
    taken_total = 0
    sent = taken = 0  # in the last 3 s
    for step in range(5000):  # 5 s, a call each ms
        clock.now_s = step / 1000
        if throttle.admits():
            is_taken = taken_total < 100 * clock.now_s  # the gateway's 100/s
            taken_total += is_taken
            throttle.record(is_taken)
            if clock.now_s >= 2.0:
                sent, taken = sent + 1, taken + is_taken
    assert 280 <= taken <= 320  # the gateway takes what it can: about 100/s
    assert 1.0 <= sent / taken <= 1.25


def test_no_call_is_refused_below_min_requests_in_the_window() -> None:
    throttle, _ = _throttle(ThrottlePolicy(min_requests=20), draw=0.0)
    assert _calls(throttle, 20, accepted=False) == 20  # 0..19 calls before each: none refused
    assert throttle.refusal_probability() == pytest.approx(20 / 21)
    assert not throttle.admits()


def test_a_refused_call_counts_as_a_request_and_only_sent_calls_as_accepts() -> None:
    throttle, _ = _throttle(ThrottlePolicy(min_requests=0), draw=0.0)
    assert throttle.admits()  # nothing counted yet: chance 0
    throttle.record(accepted=False)
    assert not throttle.admits()  # chance (1 - 0) / 2, above the draw: refused, unsent
    assert throttle.counts() == (2, 0)


def test_calls_older_than_the_window_are_forgotten() -> None:
    """A flood's refusals stop counting within `window_s` of its end: the client sends every
    call again."""
    throttle, clock = _throttle(ThrottlePolicy(window_s=2.0, min_requests=5), draw=0.5)
    _calls(throttle, 50, accepted=False)
    assert throttle.refusal_probability() > 0.9
    clock.now_s = 1.0  # half the window later the flood still counts
    assert throttle.counts() == (50, 0) and throttle.refusal_probability() > 0.9
    clock.now_s = 2.0  # the flood's slice is a window old: forgotten
    assert throttle.counts() == (0, 0)
    assert _calls(throttle, 30, accepted=True) == 30


def test_the_window_slides_slice_by_slice() -> None:
    throttle, clock = _throttle(ThrottlePolicy(window_s=1.0, min_requests=0))
    for tenth in range(10):
        clock.now_s = tenth / 10
        _calls(throttle, 1, accepted=True)
    clock.now_s = 1.05  # the first slice (started at 0.0) is a window old, the second is not
    assert throttle.counts() == (9, 9)
    clock.now_s = 1.85
    assert throttle.counts() == (1, 1)


def test_outcomes_that_count_as_accepted() -> None:
    assert is_accepted("OK") and is_accepted("INVALID_ARGUMENT") and is_accepted("NOT_FOUND")
    for code in ("RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE"):
        assert not is_accepted(code)


@pytest.mark.parametrize(
    "settings",
    [{"accept_ratio": 0.9}, {"window_s": 0.0}, {"min_requests": -1}],
)
def test_a_bad_policy_is_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ThrottlePolicy(**settings)  # type: ignore[arg-type]
