"""After a worker call fails: try another worker, or give the failure to the caller.

Pure: the forwarder passes what happened and the time (`now_s`, monotonic); the decision is a
type. Only a worker that was unavailable (gone, draining, not ready), or no longer serves the
version (NOT_FOUND: unloaded since the router's snapshot, which still lists it), is worth
leaving: the request produced no result there and inference has no side effects, so another
worker may run it. Any other failure is the request's own answer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.router.routing import RetryBudget


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
    keep: float = 0.0,
) -> RetryDecision:
    """What to do after attempt number `attempt` (0 for the first) failed.

    `deadline_s` is absolute on the same clock as `now_s` (math.inf for none). The budget is
    asked last, and only asked: the caller spends the token once the retry is routed, so that
    a token is spent only on a retry that happens; `keep`: tokens it must leave (a batch
    call's, RetryBudget.batch_keep).
    """
    if not is_worker_unavailable:
        return GiveUp(GiveUpReason.ANSWERED)
    if attempt >= max_retries:
        return GiveUp(GiveUpReason.NO_ATTEMPTS_LEFT)
    if deadline_s <= now_s:
        return GiveUp(GiveUpReason.DEADLINE_PASSED)
    if not budget.has_token(now_s, keep=keep):
        return GiveUp(GiveUpReason.BUDGET_SPENT)
    return RetryElsewhere()
