"""The slim client's retry budget (inference_fabric_client.retry), with a fake clock."""

from __future__ import annotations

import pytest
from inference_fabric_client.retry import RetryBudget, RetryPolicy

from tests.support.clock import FakeClock

pytestmark = pytest.mark.unit


def test_a_budget_emptied_by_a_flood_earns_retries_back_while_the_client_is_quiet() -> None:
    clock = FakeClock(0.0)
    budget = RetryBudget(RetryPolicy(min_tokens=3, ratio=0.1, refill_per_s=1.0), clock=clock)
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]
    clock.now_s = 1.0  # no calls since: a second of quiet earns one retry back
    assert [budget.try_spend() for _ in range(2)] == [True, False]
    clock.now_s = 100.0  # never more than the cap
    assert sum(budget.try_spend() for _ in range(10)) == 3


def test_without_refill_only_calls_earn_retries() -> None:
    clock = FakeClock(0.0)
    budget = RetryBudget(RetryPolicy(min_tokens=1, ratio=0.5, refill_per_s=0.0), clock=clock)
    assert budget.try_spend()
    clock.now_s = 100.0
    assert not budget.try_spend()
    budget.on_call()
    budget.on_call()
    assert budget.try_spend()


@pytest.mark.parametrize("min_tokens", [0.0, 0.5])
def test_a_budget_that_could_never_hold_a_retry_is_refused(min_tokens: float) -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        RetryPolicy(min_tokens=min_tokens)
    RetryPolicy(min_tokens=min_tokens, max_retries=0)  # retries off: fine


@pytest.mark.parametrize("setting", ["ratio", "refill_per_s", "min_tokens", "dropped_retry_s"])
def test_a_retry_policy_setting_that_is_no_number_is_refused(setting: str) -> None:
    """min() skips NaN: a NaN ratio or refill was taken, and pinned the budget full."""
    with pytest.raises(ValueError, match="finite"):
        RetryPolicy(**{setting: float("nan")})


@pytest.mark.parametrize("max_retries", [2.0, True])
def test_a_max_retries_that_is_no_int_is_refused(max_retries: object) -> None:
    """2.0 passed every check, then every call raised TypeError in range() (review)."""
    with pytest.raises(ValueError, match="max_retries must be an int"):
        RetryPolicy(max_retries=max_retries)  # type: ignore[arg-type]
