"""decide_retry: after a failed worker call, retry elsewhere or give up; hand-built inputs."""

from __future__ import annotations

import math

import pytest

from services.router.retry import GiveUp, GiveUpReason, RetryElsewhere, decide_retry
from services.router.routing import RetryBudget

pytestmark = pytest.mark.unit

NOW_S = 100.0


def decide(
    *,
    is_worker_unavailable: bool = True,
    attempt: int = 0,
    max_retries: int = 2,
    deadline_s: float = NOW_S + 1.0,
    budget: RetryBudget | None = None,
) -> RetryElsewhere | GiveUp:
    return decide_retry(
        is_worker_unavailable=is_worker_unavailable,
        attempt=attempt,
        max_retries=max_retries,
        deadline_s=deadline_s,
        now_s=NOW_S,
        budget=budget or RetryBudget(ratio=0.0, min_per_s=1.0, window_s=10.0),
    )


def test_unavailable_worker_with_attempts_time_and_budget_left_is_retried_elsewhere() -> None:
    assert decide() == RetryElsewhere()


def test_no_deadline_still_retries() -> None:
    assert decide(deadline_s=math.inf) == RetryElsewhere()


def test_any_other_failure_is_the_requests_own_answer() -> None:
    assert decide(is_worker_unavailable=False) == GiveUp(GiveUpReason.ANSWERED)


@pytest.mark.parametrize(("attempt", "max_retries"), [(0, 0), (2, 2), (3, 2)])
def test_gives_up_once_every_retry_is_used(attempt: int, max_retries: int) -> None:
    decision = decide(attempt=attempt, max_retries=max_retries)
    assert decision == GiveUp(GiveUpReason.NO_ATTEMPTS_LEFT)


def test_last_allowed_retry_is_taken() -> None:
    assert decide(attempt=1, max_retries=2) == RetryElsewhere()


@pytest.mark.parametrize("deadline_s", [NOW_S, NOW_S - 0.001])
def test_gives_up_at_or_past_the_deadline(deadline_s: float) -> None:
    assert decide(deadline_s=deadline_s) == GiveUp(GiveUpReason.DEADLINE_PASSED)


def test_s05_gives_up_when_the_budget_is_spent() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=0.1, window_s=10.0)  # one token in reserve
    assert decide(budget=budget) == RetryElsewhere()
    assert budget.try_spend(NOW_S)  # the retry was routed: its caller spends the token
    assert decide(budget=budget) == GiveUp(GiveUpReason.BUDGET_SPENT)


def test_deciding_to_retry_spends_no_token_until_the_retry_is_routed() -> None:
    """A retry that no other worker can take then spends none (before, deciding spent it,
    and calls to a model's only failing worker emptied the router-wide budget)."""
    budget = RetryBudget(ratio=0.0, min_per_s=1.0, window_s=10.0)
    before = budget.balance(NOW_S)
    assert decide(budget=budget) == RetryElsewhere()
    assert budget.balance(NOW_S) == before


@pytest.mark.parametrize(
    "refused",
    [
        {"is_worker_unavailable": False},
        {"attempt": 2, "max_retries": 2},
        {"deadline_s": NOW_S},
    ],
)
def test_giving_up_for_another_reason_spends_no_token(refused: dict) -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=1.0, window_s=10.0)
    before = budget.balance(NOW_S)
    assert isinstance(decide(budget=budget, **refused), GiveUp)
    assert budget.balance(NOW_S) == before


def test_a_batch_calls_retry_is_given_up_while_the_other_classes_may_still_retry() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=0.4, window_s=10.0)  # 4 tokens, 2 kept
    assert budget.batch_keep == 2.0
    assert budget.try_spend(NOW_S, keep=budget.batch_keep)
    assert budget.try_spend(NOW_S, keep=budget.batch_keep)
    assert not budget.try_spend(NOW_S, keep=budget.batch_keep)
    refused = decide_retry(is_worker_unavailable=True, attempt=0, max_retries=2,
                           deadline_s=math.inf, now_s=NOW_S, budget=budget, keep=2.0)  # fmt: skip
    assert refused == GiveUp(GiveUpReason.BUDGET_SPENT)
    assert decide(budget=budget) == RetryElsewhere()
