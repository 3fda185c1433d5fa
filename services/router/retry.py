"""After a worker call fails: try another worker, or give the failure to the caller.

Pure: the forwarder passes what happened and the time (`now_s`, monotonic); the decision is a
type. Only a worker that was unavailable (gone, draining, not ready), or no longer serves the
version (NOT_FOUND: unloaded since the router's snapshot, which still lists it), is worth
leaving: the request produced no result there and inference has no side effects, so another
worker may run it. Any other failure is the request's own answer. How a failure given up on
reads to the caller (`for_caller`), and a routing refusal (`rejection`), are here too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from services.common.errors import NotFound, Overloaded, Unavailable, UpstreamError
from services.router.routing import Reject, RejectReason, RetryBudget


class GiveUpReason(enum.Enum):
    #: The worker answered (an error of the request's own, e.g. INVALID_ARGUMENT): final.
    ANSWERED = "answered"
    #: The request already had its first attempt and every retry allowed.
    NO_ATTEMPTS_LEFT = "no_attempts_left"
    #: The caller's deadline has passed: a retry could not answer in time.
    DEADLINE_PASSED = "deadline_passed"
    #: The router-wide retry budget is spent (no retry storms when many workers fail at once).
    BUDGET_SPENT = "budget_spent"


@dataclass(frozen=True)
class RetryElsewhere:
    """Route the request again, to a worker not yet tried, spending a budget token
    (RetryBudget.try_spend) once it is routed: a retry no other worker can take spends none."""


@dataclass(frozen=True)
class GiveUp:
    """Raise the failure to the caller."""

    reason: GiveUpReason


RetryDecision = RetryElsewhere | GiveUp


def decide_retry(
    *,
    is_worker_unavailable: bool,
    attempt: int,
    max_retries: int,
    deadline_s: float,
    now_s: float,
    budget: RetryBudget,
) -> RetryDecision:
    """What to do after attempt number `attempt` (0 for the first) failed.

    `deadline_s` is absolute on the same clock as `now_s` (math.inf for none). The budget is
    asked last, and only asked: the caller spends the token once the retry is routed, so that
    a token is spent only on a retry that happens.
    """
    if not is_worker_unavailable:
        return GiveUp(GiveUpReason.ANSWERED)
    if attempt >= max_retries:
        return GiveUp(GiveUpReason.NO_ATTEMPTS_LEFT)
    if deadline_s <= now_s:
        return GiveUp(GiveUpReason.DEADLINE_PASSED)
    if not budget.has_token(now_s):
        return GiveUp(GiveUpReason.BUDGET_SPENT)
    return RetryElsewhere()


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
