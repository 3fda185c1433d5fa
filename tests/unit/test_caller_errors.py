"""How the router's refusals and a worker's failures read to its caller (caller_errors)."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import ServingError, Unavailable, UpstreamError
from services.router.caller_errors import for_caller, rejection
from services.router.routing import Reject, RejectReason

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("reason", "retried", "code", "is_not_started"),
    [
        (RejectReason.DEADLINE, False, grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        (RejectReason.UNKNOWN_MODEL, False, grpc.StatusCode.NOT_FOUND, False),
        # After a worker's failure the version was served: not NOT_FOUND.
        (RejectReason.UNKNOWN_MODEL, True, grpc.StatusCode.UNAVAILABLE, False),
        (RejectReason.NO_REGISTRY, False, grpc.StatusCode.UNAVAILABLE, True),
        (RejectReason.NO_REGISTRY, True, grpc.StatusCode.UNAVAILABLE, False),
        (RejectReason.NO_WORKER, False, grpc.StatusCode.UNAVAILABLE, False),
    ],
)
def test_a_rejection_reads_to_the_caller_as_its_reason_says(
    reason: RejectReason, retried: bool, code: grpc.StatusCode, is_not_started: bool
) -> None:
    error = rejection(Reject(reason, retry_after_s=0.25, message="no route"), retried=retried)
    assert isinstance(error, ServingError)
    assert (error.code, getattr(error, "is_not_started", False)) == (code, is_not_started)
    if reason is RejectReason.DEADLINE:
        assert error.retry_after_s == 0.25


def test_a_workers_not_found_reads_unavailable_other_failures_as_they_are() -> None:
    gone = for_caller(UpstreamError(grpc.StatusCode.NOT_FOUND, "m/1 unloaded"))
    assert isinstance(gone, Unavailable) and "m/1 unloaded" in str(gone)
    assert not gone.is_not_started  # stale snapshots elsewhere would try the same workers
    refused = UpstreamError(grpc.StatusCode.INVALID_ARGUMENT, "bad rows")
    assert for_caller(refused) is refused
