"""The canary rollout's decisions: advance, hold, or roll back. Pure: no clock, no I/O.

At each step the canary gets a share of the model's traffic (`Plan.steps`, percent). After
the step's hold, its health over the step is compared with stable's over the same window:
- roll back as soon as the canary's error rate (server failures among the calls it served)
  exceeds stable's by more than `max_error_rate_increase` (a fraction: 0.01 is 1 point), with
  at least `MIN_COUNTED` errors (fewer, over the bound, hold the step for more calls); or its
  refusal rate (calls it answered without serving: out of room, inputs it refuses) exceeds
  stable's by more than `max_refusal_rate_increase`, with at least `MIN_COUNTED` refusals, and
  before the step's hold is over from `EARLY_P99_FACTOR` times `min_requests` answered (a
  canary that refuses every call served none, and was promoted: review finding); or its p99
  exceeds stable's by more than `max_p99_ratio` and by more than `p99_slack_s` too (a p99 of a
  few milliseconds read from histogram buckets moves by a bucket's width: 2.5 ms against 4 ms
  is noise, not a 1.6x regression), judged once the canary has served `min_requests` in the
  step, and before the step's hold is over only from `EARLY_P99_FACTOR` times as many (a p99
  of 50 rows is their slowest one);
- hold (wait longer) while the canary has served fewer requests than that; after `max_holds`
  extra holds without enough traffic, roll back (a canary nobody can judge is not promoted);
  the same while stable's health (`baseline`) counts fewer: judged against no calls, the
  canary's latency was never compared and it was promoted (stable's workers not scraped:
  a review finding);
- otherwise advance; after the last step, promote (the `stable` label moves to the canary).

Stable's health is its own over the step, except where it served fewer than `min_requests`
(the last step, at 100%, sends it nothing): there, its health over the last step that had
enough (`baseline`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Errors (or refusals) a rate must count before it rolls a canary back: one transient failure
#: among a step's first 50 calls is 2%, over a 1-point bound, and says nothing of the version.
MIN_COUNTED = 3
#: Before a step's hold is over, a p99 rolls a canary back only from this many times
#: `min_requests` served calls.
EARLY_P99_FACTOR = 4


class Decision(enum.Enum):
    """Values are the metric label and the log word."""

    HOLD = "hold"
    ADVANCE = "advance"
    ROLLBACK = "rollback"
    PROMOTE = "promote"


@dataclass(frozen=True)
class Health:
    """One version's traffic over a window: calls served (answered, or failed by the server),
    of them failed, p99 latency (seconds; None without rows run), and calls refused unserved
    (out of room, inputs refused: neither served nor failed)."""

    requests: int
    errors: int
    p99_s: float | None
    refused: int = 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def answered(self) -> int:
        """Calls served or refused."""
        return self.requests + self.refused

    @property
    def refusal_rate(self) -> float:
        """Refused calls among the calls served or refused."""
        return self.refused / self.answered if self.answered else 0.0


@dataclass(frozen=True)
class Plan:
    #: Canary traffic percent at each step, ascending, ending at 100.
    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 50.0, 100.0)
    #: How long each step runs before it is judged, seconds.
    hold_s: float = 60.0
    #: How far the canary's error rate may exceed stable's, a fraction (0.01: 1 point).
    max_error_rate_increase: float = 0.01
    #: How far the canary's refusal rate may exceed stable's, a fraction (0.05: 5 points):
    #: looser, as the canary's share of a pool of its own may be near the pool's capacity.
    max_refusal_rate_increase: float = 0.05
    max_p99_ratio: float = 1.2
    #: How far past stable's the canary's p99 must also be, seconds, to count as slower.
    p99_slack_s: float = 0.01
    min_requests: int = 50
    #: Extra holds a step may take for lack of canary traffic before the rollout gives up.
    max_holds: int = 3

    def __post_init__(self) -> None:
        numbers = (*self.steps, self.hold_s, self.max_error_rate_increase, self.max_p99_ratio,
                   self.p99_slack_s, self.max_refusal_rate_increase)  # fmt: skip
        if not all(math.isfinite(number) for number in numbers):
            # A NaN bound never fires (every comparison with it is false); an infinite hold
            # never ends its step.
            raise ValueError("steps, hold, error-rate bound, p99 ratio and slack must be finite")
        if not self.steps or list(self.steps) != sorted(self.steps) or self.steps[-1] != 100:
            raise ValueError("steps must ascend and end at 100 (percent)")
        if self.steps[0] <= 0:
            raise ValueError("steps must be > 0 percent")
        if len(self.steps) < 2:
            # At 100% stable serves nothing: a lone step would judge the canary against no
            # calls at all (its latency never compared) and promote it.
            raise ValueError("steps need one below 100 (percent), to judge the canary against")
        if min(self.hold_s, self.p99_slack_s) < 0:
            raise ValueError("hold and p99 slack must be >= 0")
        for bound in (self.max_error_rate_increase, self.max_refusal_rate_increase):
            if not 0 <= bound < 1:
                # A fraction: 1 (meant as 1 point) is a bound no rate exceeds, and a canary
                # failing every call was promoted (review finding).
                raise ValueError("error- and refusal-rate bounds are fractions in [0, 1)")
        if self.max_p99_ratio < 1:
            raise ValueError("the p99 ratio must be >= 1")
        if self.min_requests < 1 or self.max_holds < 0:
            raise ValueError("min_requests must be >= 1 and max_holds >= 0")


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str


def judge(
    plan: Plan, step: int, holds: int, canary: Health, stable: Health, *, final: bool
) -> Verdict:
    """The verdict on step `step` (index into plan.steps) after `holds` extra holds, from the
    versions' health over the step so far. `final`: the step's hold is over (otherwise only a
    rollback is decided early, never an advance)."""
    # Before the hold is over a p99, and refusals (which follow load as much as the version:
    # a freshly started canary pod's first ones), are judged only from this many calls.
    needed = plan.min_requests * (1 if final else EARLY_P99_FACTOR)
    refusals_judged = canary.answered >= needed
    refused_more = canary.refusal_rate - stable.refusal_rate > plan.max_refusal_rate_increase
    failed_more = canary.error_rate - stable.error_rate > plan.max_error_rate_increase
    if refusals_judged and refused_more and canary.refused >= MIN_COUNTED:
        return Verdict(
            Decision.ROLLBACK,
            f"canary refusal rate {canary.refusal_rate:.2%} vs stable"
            f" {stable.refusal_rate:.2%} (bound +{plan.max_refusal_rate_increase:.2%})",
        )
    if canary.requests >= plan.min_requests:
        if failed_more and canary.errors >= MIN_COUNTED:
            return Verdict(
                Decision.ROLLBACK,
                f"canary error rate {canary.error_rate:.2%} vs stable {stable.error_rate:.2%}"
                f" (bound +{plan.max_error_rate_increase:.2%})",
            )
        ratio = _p99_ratio(canary, stable)
        p99_judged = canary.requests >= needed
        if (
            p99_judged
            and ratio > plan.max_p99_ratio
            and _p99_excess_s(canary, stable) > plan.p99_slack_s
        ):
            return Verdict(
                Decision.ROLLBACK,
                f"canary p99 {ratio:.2f}x stable's (bound {plan.max_p99_ratio:.2f}x and"
                f" +{plan.p99_slack_s * 1000:g} ms)",
            )
    if not final:
        return Verdict(Decision.HOLD, "step in progress")
    if canary.requests < plan.min_requests:
        return _too_few(plan, holds, f"{canary.requests} canary requests served")
    if stable.requests < plan.min_requests:  # nothing to judge its latency against
        return _too_few(
            plan, holds, f"{stable.requests} stable requests", " (are stable's workers scraped?)"
        )
    if canary.p99_s is None and stable.p99_s is not None:  # no row of its calls ran
        return _too_few(plan, holds, "no canary latency")
    if (failed_more and canary.errors) or (refused_more and canary.refused):
        # Over a bound by fewer than MIN_COUNTED: not enough to roll back on, too much to
        # advance on (1 failed of 1 served was promoted): more calls decide, up to max_holds.
        return _too_few(plan, holds, f"{canary.errors} errors, {canary.refused} refusals")
    if step == len(plan.steps) - 1:
        return Verdict(Decision.PROMOTE, "every step healthy")
    return Verdict(Decision.ADVANCE, f"healthy at {plan.steps[step]:g}%")


def _too_few(plan: Plan, holds: int, counted: str, hint: str = "") -> Verdict:
    """Hold for more calls, or roll back once `max_holds` extra holds did not bring them."""
    if holds >= plan.max_holds:
        return Verdict(
            Decision.ROLLBACK,
            f"only {counted} after {holds + 1} holds (need {plan.min_requests}){hint}",
        )
    return Verdict(Decision.HOLD, f"{counted} so far")


def baseline(plan: Plan, window: Health, earlier: Health | None) -> Health:
    """What the canary is judged against: stable's health over the step's window, or, when
    stable served fewer than `min_requests` in it (the last step sends it none), its health
    over the last step that had enough (`earlier`; the window's when there is none). A
    stable with no calls has no errors and no p99, so judged against it a canary's errors
    count against zero and its latency is never compared."""
    if window.requests >= plan.min_requests or earlier is None:
        return window
    return earlier


def _p99_ratio(canary: Health, stable: Health) -> float:
    """canary p99 / stable p99; 1 when either is unknown (nothing to compare)."""
    if canary.p99_s is None or not stable.p99_s:
        return 1.0
    return canary.p99_s / stable.p99_s


def _p99_excess_s(canary: Health, stable: Health) -> float:
    """How much later the canary's p99 is than stable's, seconds; 0 when either is unknown."""
    if canary.p99_s is None or stable.p99_s is None:
        return 0.0
    return canary.p99_s - stable.p99_s


def p99_from_buckets(buckets: Sequence[tuple[float, float]]) -> float | None:
    """The 0.99 quantile of a Prometheus histogram's (upper bound, cumulative count) buckets,
    interpolated linearly within the bucket (as PromQL's histogram_quantile); None if empty."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = 0.99 * ordered[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in ordered:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            width = cumulative - below
            return lower + (upper - lower) * ((rank - below) / width if width else 1.0)
        lower, below = upper, cumulative
    return lower


#: The key of a worker process's start time among its counters (`process_start_time_seconds`),
#: which tells a restart where no counter went back.
STARTED = "started"


def difference(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """Counter deltas between two scrapes of one worker's counters. Where the process's start
    time (STARTED) changed, or any counter went back or is gone, the worker restarted between
    them, and `after` counts from 0 whole: a counter that happens to have come back past its
    old value is all new too (its difference undercounted a crashing canary's errors), and so
    are all of them where every counter did (review findings)."""
    if after.get(STARTED) != before.get(STARTED) or any(
        after.get(key, 0.0) < value for key, value in before.items()
    ):
        return dict(after)
    return {key: value - before.get(key, 0.0) for key, value in after.items()}
