"""What the router's caller gets: a worker's failure given up on (`for_caller`), and a routing
refusal (`rejection`). Kept apart from `retry`'s pure decision, which the simulator imports
without grpc."""

from __future__ import annotations

import grpc

from services.common.errors import NotFound, Overloaded, Unavailable, UpstreamError
from services.router.routing import Reject, RejectReason


def for_caller(failure: UpstreamError) -> Exception:
    """A worker's failure as the caller gets it. A worker's NOT_FOUND for a version this
    router's snapshot says it serves (unloaded there since) is no permanent answer: the version
    was served, so UNAVAILABLE (as when no worker serves a version served before). Not marked
    not started: a gateway would resend it to routers whose snapshots are as stale, each
    trying the same workers again (review finding)."""
    if failure.code != grpc.StatusCode.NOT_FOUND:
        return failure
    return Unavailable(
        f"{failure} on the worker routed to (unloaded there); no other worker serves it now"
    )


def rejection(decision: Reject, *, retried: bool) -> Exception:
    """What the caller gets when routing found no worker to try (`retried`: after a failure)."""
    if decision.reason is RejectReason.DEADLINE:
        return Overloaded(decision.message, retry_after_s=decision.retry_after_s)
    if decision.reason is RejectReason.UNKNOWN_MODEL and not retried:
        return NotFound(decision.message)
    # Without a registry snapshot this router ran nothing: the gateway resends elsewhere.
    is_not_started = decision.reason is RejectReason.NO_REGISTRY and not retried
    return Unavailable(decision.message, is_not_started=is_not_started)
