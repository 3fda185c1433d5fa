"""decide_resend: after a router call failed, resend it to another router or give up; and the
gateway's router target for one address or a list."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import NOT_STARTED_TRAILER, UpstreamError
from services.gateway.router_retry import (
    GiveUp,
    Resend,
    RouterRetryConfig,
    decide_resend,
    router_target,
)

pytestmark = pytest.mark.unit

CONFIG = RouterRetryConfig(max_attempts=3, base_backoff_s=0.02, max_backoff_s=0.05)


def decide(
    *,
    is_not_started: bool = True,
    attempt: int = 0,
    time_left_s: float | None = 5.0,
    random_value: float = 0.5,
) -> Resend | GiveUp:
    return decide_resend(
        is_not_started=is_not_started,
        attempt=attempt,
        time_left_s=time_left_s,
        random_value=random_value,
        config=CONFIG,
    )


def test_a_call_refused_unstarted_is_resent_after_a_jittered_backoff() -> None:
    assert decide(attempt=0, random_value=0.5) == Resend(0.01)
    assert decide(attempt=1, random_value=0.5) == Resend(0.02)


def test_backoff_is_capped() -> None:
    assert decide(attempt=1, random_value=0.999_999) == Resend(pytest.approx(0.04, rel=1e-3))
    config = RouterRetryConfig(max_attempts=10, base_backoff_s=0.02, max_backoff_s=0.05)
    decision = decide_resend(
        is_not_started=True, attempt=6, time_left_s=None, random_value=1.0, config=config
    )
    assert decision == Resend(0.05)


def test_a_call_that_may_have_run_is_never_resent() -> None:
    assert isinstance(decide(is_not_started=False), GiveUp)


def test_attempts_are_bounded() -> None:
    assert isinstance(decide(attempt=1), Resend)
    assert decide(attempt=2) == GiveUp("no attempts left")


def test_no_resend_that_cannot_finish_within_the_deadline() -> None:
    assert decide(time_left_s=0.005, random_value=0.9) == GiveUp("deadline")
    assert isinstance(decide(time_left_s=None), Resend)


def test_only_unavailable_with_the_mark_counts_as_not_started() -> None:
    marked = UpstreamError(grpc.StatusCode.UNAVAILABLE, "draining", (NOT_STARTED_TRAILER,))
    assert marked.is_not_started
    assert marked.trailers() == ()  # one hop only: never passed on to our own caller
    assert not UpstreamError(grpc.StatusCode.UNAVAILABLE, "worker died").is_not_started
    wrong_code = UpstreamError(grpc.StatusCode.INTERNAL, "x", (NOT_STARTED_TRAILER,))
    assert not wrong_code.is_not_started


def test_router_target_balances_over_a_list() -> None:
    assert router_target("10.0.0.1:8101") == "10.0.0.1:8101"
    assert router_target("dns:///router:8101") == "dns:///router:8101"
    assert router_target("10.0.0.1:8101, 10.0.0.2:8101") == "ipv4:10.0.0.1:8101,10.0.0.2:8101"
