"""How a gateway reaches its routers: one channel over all of them, and resends.

A call is resent to another router only if it provably never ran, and within its deadline. A
router that drains (or a stream it closes) refuses new calls UNAVAILABLE marked not started,
and a call that found no connection to any router was never sent; either may go to another
router without running twice. Any other failure, including an UNAVAILABLE that may have come
after the router forwarded the call, is the caller's answer. Pure: the predictor passes what
happened, the time left and a random number; the decision is a type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.backoff import doubled_s
from services.common.channel_options import CHANNEL_OPTIONS

#: Spread streams and calls over every router of `router_address` (a list of addresses, or
#: every address a DNS name resolves to) rather than pinning the first one.
ROUTER_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
ROUTER_CHANNEL_OPTIONS = (
    *CHANNEL_OPTIONS,
    ("grpc.service_config", ROUTER_SERVICE_CONFIG),
)


#: Streams a gateway process keeps to the routers, taking its calls in turn: each opens on
#: the next router of the channel's round robin, so a process spreads its calls over up to
#: this many routers (beyond that, a fleet's gateway processes spread over the rest).
ROUTER_STREAMS = 4


def router_target(router_address: str) -> str:
    """The gRPC target for `router_address`: one "host:port" (a DNS name balances over all its
    addresses), or comma-separated IPv4 "ip:port" entries, one per router."""
    addresses = [a.strip() for a in router_address.split(",") if a.strip()]
    if len(addresses) <= 1:
        return router_address.strip()
    return "ipv4:" + ",".join(addresses)


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
    delay_s = random_value * doubled_s(config.base_backoff_s, attempt, config.max_backoff_s)
    if time_left_s is not None and delay_s >= time_left_s:
        return GiveUp("deadline")
    return Resend(delay_s)
