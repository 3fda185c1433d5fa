"""status_of: the one mapping from an error to the status a call is answered with."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from inference_fabric_client.throttle import is_accepted

from services.common.errors import (
    DeadlineExceeded,
    ExecutionFailed,
    FingerprintMismatch,
    InvalidInput,
    MessageTooLarge,
    NotFound,
    Overloaded,
    PermissionDenied,
    ServingError,
    Unauthenticated,
    Unavailable,
    UpstreamError,
)
from services.common.grpc_errors import (
    MAX_STATUS_MESSAGE_BYTES,
    Status,
    bounded_message,
    code_of,
    is_bug,
    status_of,
    without_addresses,
)
from services.gateway.http.errors import http_error

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidInput("refused"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound("refused"), grpc.StatusCode.NOT_FOUND),
        (FingerprintMismatch("refused"), grpc.StatusCode.FAILED_PRECONDITION),
        (Overloaded("refused"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DeadlineExceeded("refused"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (Unavailable("refused"), grpc.StatusCode.UNAVAILABLE),
        (ExecutionFailed("refused"), grpc.StatusCode.INTERNAL),
        (Unauthenticated("refused"), grpc.StatusCode.UNAUTHENTICATED),
        (PermissionDenied("refused"), grpc.StatusCode.PERMISSION_DENIED),
        (UpstreamError(grpc.StatusCode.ABORTED, "refused"), grpc.StatusCode.ABORTED),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, ServingError) else None,
)
def test_each_domain_error_keeps_its_code_and_its_words(
    error: ServingError, code: grpc.StatusCode
) -> None:
    assert status_of(error) == Status(code, "refused")
    assert not is_bug(error)


def test_an_overload_carries_its_retry_hint_in_milliseconds() -> None:
    status = status_of(Overloaded("queue is long", retry_after_s=0.25))

    assert (status.code, status.message) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is long")
    ((key, value),) = status.trailers
    # 250 ms, jittered by RETRY_JITTER (25%) either way so refused callers spread out.
    assert key == "retry-after-ms" and 187 <= int(value) <= 313
    # Without a hint, no trailer: the caller picks its own backoff.
    assert status_of(Overloaded("queue is long")).trailers == ()


def test_a_downstream_status_passes_through_with_only_its_retry_hint() -> None:
    trailers = (("retry-after-ms", "40"), ("x-internal-host", "worker-3"))
    error = UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", trailers)

    assert status_of(error) == Status(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after-ms", "40"),)
    )


@pytest.mark.parametrize("value", ["soon", "-40", "4e3", "\uff14\uff10", "1" * 10, ""], ids=repr)
def test_a_downstream_retry_hint_that_is_no_number_of_milliseconds_is_dropped(value: str) -> None:
    """Passed on, it failed the HTTP answer built from it (a bare 500 in place of the 429), and
    misled clients' backoff ("\uff14\uff10", full-width digits, passed isdigit())."""
    error = UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after-ms", value),))

    assert status_of(error).trailers == ()
    assert error.retry_after_s is None
    answer = http_error(error)
    assert (answer.status, answer.message) == (429, "busy")
    assert "Retry-After" not in answer.headers


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "10.0.3.4:7001: stream failed: UNAVAILABLE failed to connect to all addresses; last "
            "error: UNKNOWN: ipv4:10.0.3.4:7001: Failed to connect to remote host: Connection "
            "refused",
            "<address>: stream failed: UNAVAILABLE failed to connect to all addresses; last "
            "error: UNKNOWN: <address>: Failed to connect to remote host: Connection refused",
        ),
        ("ipv6:%5Bfd00::1%5D:7001: Socket closed", "<address>: Socket closed"),
        ("peer [fd00::1]:7001 went away", "peer <address> went away"),
        ("unix:/run/fabric/w.sock: No such file", "<address>: No such file"),
        (
            "DNS resolution failed for worker-0.workers.svc:7001: C-ares status is not ARES",
            "DNS resolution failed for <address>: C-ares status is not ARES",
        ),
        ("last seen at 10.0.3.4.", "last seen at <address>."),
        ("peer [::1]:7001 went away", "peer <address> went away"),
        # A version's dotted number, a shape, a range and a predicted time are no addresses.
        ("no ready worker for m@1.2.3.4", "no ready worker for m@1.2.3.4"),
        ("expected shape [4], got [2] and [fade]", "expected shape [4], got [2] and [fade]"),
        ("rows [0:4] of 2", "rows [0:4] of 2"),
        # Nor are a slice, a stepped range or a time in brackets (a model's own error line).
        ("x[::2] failed", "x[::2] failed"),
        ("slice [0:10:2] and at [12:30:45]", "slice [0:10:2] and at [12:30:45]"),
        ("m@1: predicted 0.120s on w-1", "m@1: predicted 0.120s on w-1"),
    ],
)
def test_a_status_names_no_network_address(message: str, expected: str) -> None:
    assert without_addresses(message) == expected
    assert status_of(Unavailable(message)).message == expected
    assert status_of(UpstreamError(grpc.StatusCode.UNAVAILABLE, message)).message == expected


@pytest.mark.parametrize("error", [RuntimeError("db password is hunter2"), KeyError("secret")])
def test_an_unknown_error_is_internal_and_leaks_nothing(error: Exception) -> None:
    status = status_of(error)

    assert status == Status(grpc.StatusCode.INTERNAL, "internal error")
    assert is_bug(error)


@pytest.mark.parametrize("error", [asyncio.CancelledError(), GeneratorExit()])
def test_a_caller_going_away_is_cancelled(error: BaseException) -> None:
    assert status_of(error).code is grpc.StatusCode.CANCELLED
    assert status_of(error).trailers == ()
    assert not is_bug(error)


def test_a_timeout_that_is_no_domain_error_is_a_bug_not_a_deadline() -> None:
    # Only the code that owns a deadline knows a timeout was the caller's: it raises
    # DeadlineExceeded. A bare TimeoutError (a redis call, a lock) is ours.
    assert status_of(TimeoutError()).code is grpc.StatusCode.INTERNAL


def test_a_long_message_echoing_a_lone_surrogate_is_cut_not_raised() -> None:
    """JSON may escape a lone surrogate into a caller's text, which a message echoes; past
    the bound, cutting it encoded it to UTF-8 and raised, so the error's own answer failed
    (an HTTP 500 in place of the 400)."""
    message = bounded_message("bad key " + "\ud800" * 600)
    assert message.endswith("bytes cut)")
    assert len(message.encode()) <= MAX_STATUS_MESSAGE_BYTES + 30


def test_a_message_past_a_size_limit_is_no_refusal_for_load() -> None:
    """An answer too large for its stream (the model ran) is RESOURCE_EXHAUSTED, as grpc
    answers a message past its limit, and in grpc's words: the gateway's throttle and the
    tenant's rows do not take it for a refusal for load, nor does the slim client (a review
    finding: it throttled the caller and gave its rows back). A refusal for load still is."""
    answer = MessageTooLarge("an answer of 70000000 bytes is past the message limit")
    status = status_of(answer)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    passed_on = UpstreamError.from_status(status.code.value[0], status.message, {})
    assert not passed_on.is_overload
    assert is_accepted(status.code.name, status.message)
    received = "Received message larger than max (70000000 vs. 67108864)"  # grpc's own
    assert not UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, received).is_overload
    busy = status_of(Overloaded("predicted to finish past its SLO", retry_after_s=0.1))
    assert UpstreamError.from_status(busy.code.value[0], busy.message, {}).is_overload
    assert not is_accepted(busy.code.name, busy.message)


@pytest.mark.parametrize(
    "error",
    [
        Overloaded("busy", retry_after_s=0.1),
        UpstreamError(grpc.StatusCode.UNAVAILABLE, "ipv4:10.0.0.1:1: gone"),
        RuntimeError("a bug"),
        asyncio.CancelledError(),
    ],
    ids=lambda error: type(error).__name__,
)
def test_code_of_is_the_code_status_of_answers_with(error: BaseException) -> None:
    """Counting an outcome reads only the code: no message built, no address scrubbed."""
    assert code_of(error) == status_of(error).code
