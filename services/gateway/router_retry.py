"""Resending a call to another router: only a call that provably never ran, within its deadline.

A router that drains (or a stream it closes) refuses new calls UNAVAILABLE marked not started,
and a call that found no connection to any router was never sent; either may go to another
router without running twice. Any other failure, including an UNAVAILABLE that may have come
after the router forwarded the call, is the caller's answer. Pure: the predictor passes what
happened, the time left and a random number; the decision is a type.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterRetryConfig:
    #: Most attempts of one call, the first included: enough that a call whose resends meet
    #: a draining router again, before its GOAWAY reached this gateway, still finds another.
    max_attempts: int = 6
    #: Backoff before the first resend, seconds; doubles per resend up to `max_backoff_s`,
    #: with full jitter (so that the gateways resending a drained router's calls spread out).
    base_backoff_s: float = 0.02
    max_backoff_s: float = 0.2


@dataclass(frozen=True)
class Resend:
    """Send the call again (a new stream: another router) after `delay_s` seconds."""

    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    """Answer the caller with the failure."""

    reason: str


RetryDecision = Resend | GiveUp


def decide_resend(
    *,
    is_not_started: bool,
    attempt: int,
    time_left_s: float | None,
    random_value: float,
    config: RouterRetryConfig,
) -> RetryDecision:
    """What to do after attempt number `attempt` (0 for the first) failed. `time_left_s` is
    the call's remaining deadline (None: no deadline); `random_value` is in [0, 1)."""
    if not is_not_started:
        return GiveUp("may have run")
    if attempt + 1 >= config.max_attempts:
        return GiveUp("no attempts left")
    delay_s = random_value * min(config.max_backoff_s, config.base_backoff_s * 2**attempt)
    if time_left_s is not None and delay_s >= time_left_s:
        return GiveUp("deadline")
    return Resend(delay_s)
