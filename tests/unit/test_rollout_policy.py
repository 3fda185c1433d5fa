"""The canary rollout's verdicts (pure), and the histogram and counter arithmetic they use."""

from __future__ import annotations

import math

import pytest

from services.rollout.health import health_between, parse_snapshot
from services.rollout.policy import (
    Decision,
    Health,
    Plan,
    baseline,
    difference,
    judge,
    p99_from_buckets,
)

pytestmark = pytest.mark.unit

PLAN = Plan(steps=(5.0, 50.0, 100.0), min_requests=100, max_holds=2)
STABLE = Health(requests=1000, errors=2, p99_s=0.050)


def test_a_healthy_canary_advances_then_is_promoted() -> None:
    canary = Health(requests=200, errors=0, p99_s=0.052)
    assert judge(PLAN, 0, 0, canary, STABLE, final=True).decision is Decision.ADVANCE
    assert judge(PLAN, 2, 0, canary, STABLE, final=True).decision is Decision.PROMOTE


def test_no_advance_before_the_hold_is_over() -> None:
    canary = Health(requests=200, errors=0, p99_s=0.05)
    assert judge(PLAN, 0, 0, canary, STABLE, final=False).decision is Decision.HOLD


@pytest.mark.parametrize(
    ("canary", "reason"),
    [
        (Health(requests=200, errors=10, p99_s=0.05), "error rate"),
        (Health(requests=400, errors=0, p99_s=0.090), "p99"),
        # Refusals mid-step from 4x min_requests calls answered (load moves them too).
        (Health(requests=0, errors=0, p99_s=None, refused=400), "refusal rate"),
        (Health(requests=300, errors=0, p99_s=0.05, refused=100), "refusal rate"),
    ],
)
def test_a_worse_canary_is_rolled_back_even_mid_step(canary: Health, reason: str) -> None:
    verdict = judge(PLAN, 1, 0, canary, STABLE, final=False)
    assert verdict.decision is Decision.ROLLBACK
    assert reason in verdict.reason


def test_a_canary_that_refuses_what_it_is_sent_is_rolled_back_not_promoted() -> None:
    """A canary too slow for any caller's deadline refuses every row (RESOURCE_EXHAUSTED), and
    one whose inputs changed refuses most of them (INVALID_ARGUMENT): counted as requests
    with no error and no p99, it advanced every step and was promoted (review finding). Its
    refusals are compared with stable's now, and only calls it served count toward
    `min_requests`."""
    shedding = Health(requests=0, errors=0, p99_s=None, refused=500)
    verdict = judge(PLAN, 2, 0, shedding, STABLE, final=True)
    assert verdict.decision is Decision.ROLLBACK and "refusal rate 100.00%" in verdict.reason
    # Stable refusing as much (the same overload): not the version's fault, and what it
    # served is judged as usual.
    loaded_stable = Health(requests=1000, errors=0, p99_s=0.05, refused=500)
    alike = Health(requests=200, errors=0, p99_s=0.05, refused=100)
    assert judge(PLAN, 0, 0, alike, loaded_stable, final=True).decision is Decision.ADVANCE


def test_a_few_failures_or_an_early_slow_row_are_not_a_worse_canary() -> None:
    """One transient failure among a step's first 100 calls is 1%, a p99 of 100 rows their
    slowest: neither rolls a canary back on its own (review finding). Past MIN_COUNTED errors,
    and at the step's end for latency, they do."""
    two_errors = Health(requests=100, errors=2, p99_s=0.05)
    assert judge(PLAN, 0, 0, two_errors, STABLE, final=False).decision is Decision.HOLD
    # Over the bound by too few to roll back on, and too many to advance on (1 failed of 1
    # served was promoted: review finding): more calls decide, up to max_holds.
    verdict = judge(PLAN, 0, 0, two_errors, STABLE, final=True)
    assert verdict.decision is Decision.HOLD and "2 errors" in verdict.reason
    assert judge(PLAN, 0, 2, two_errors, STABLE, final=True).decision is Decision.ROLLBACK
    diluted = Health(requests=1000, errors=2, p99_s=0.05)
    assert judge(PLAN, 0, 1, diluted, STABLE, final=True).decision is Decision.ADVANCE
    early_refusals = Health(requests=100, errors=0, p99_s=0.05, refused=20)
    assert judge(PLAN, 0, 0, early_refusals, STABLE, final=False).decision is Decision.HOLD
    three_errors = Health(requests=100, errors=3, p99_s=0.05)
    assert judge(PLAN, 0, 0, three_errors, STABLE, final=False).decision is Decision.ROLLBACK
    early_slow = Health(requests=100, errors=0, p99_s=0.090)
    assert judge(PLAN, 0, 0, early_slow, STABLE, final=False).decision is Decision.HOLD
    assert judge(PLAN, 0, 0, early_slow, STABLE, final=True).decision is Decision.ROLLBACK


def test_a_canary_none_of_whose_rows_ran_is_not_promoted() -> None:
    no_latency = Health(requests=200, errors=0, p99_s=None)
    verdict = judge(PLAN, 2, 2, no_latency, STABLE, final=True)
    assert verdict.decision is Decision.ROLLBACK and "no canary latency" in verdict.reason


def test_a_few_milliseconds_past_a_millisecond_p99_is_not_a_regression() -> None:
    # 4.3 ms against 2.5 ms is 1.7x, but within the 10 ms slack: a bucket's width at that
    # scale, not a slower canary. 15 ms past it is both over the ratio and the slack.
    fast_stable = Health(requests=1000, errors=0, p99_s=0.0025)
    near = Health(requests=200, errors=0, p99_s=0.0043)
    assert judge(PLAN, 0, 0, near, fast_stable, final=True).decision is Decision.ADVANCE
    slow = Health(requests=200, errors=0, p99_s=0.0175)
    verdict = judge(PLAN, 0, 0, slow, fast_stable, final=True)
    assert verdict.decision is Decision.ROLLBACK and "+10 ms" in verdict.reason


def test_too_little_canary_traffic_holds_then_rolls_back() -> None:
    canary = Health(requests=10, errors=5, p99_s=1.0)  # too few to judge, even this bad
    assert judge(PLAN, 0, 0, canary, STABLE, final=False).decision is Decision.HOLD
    assert judge(PLAN, 0, 1, canary, STABLE, final=True).decision is Decision.HOLD
    verdict = judge(PLAN, 0, 2, canary, STABLE, final=True)
    assert verdict.decision is Decision.ROLLBACK and "only 10 canary requests" in verdict.reason


def test_too_little_stable_traffic_to_judge_against_holds_then_rolls_back() -> None:
    """Stable's health counting too few calls (its workers not scraped: every window empty,
    no earlier step's either) judges nothing: the canary's latency was never compared and it
    was promoted (a review finding). It holds as for too little canary traffic, then rolls
    back; an early rollback for the canary's own errors still comes."""
    canary = Health(requests=200, errors=0, p99_s=0.500)
    unscraped = Health(requests=0, errors=0, p99_s=None)
    assert judge(PLAN, 0, 0, canary, unscraped, final=True).decision is Decision.HOLD
    verdict = judge(PLAN, 2, 2, canary, unscraped, final=True)
    assert (
        verdict.decision is Decision.ROLLBACK
        and "only 0 stable requests after 3 holds" in verdict.reason
    )
    failing = Health(requests=200, errors=50, p99_s=0.05)
    assert judge(PLAN, 0, 0, failing, unscraped, final=False).decision is Decision.ROLLBACK


@pytest.mark.parametrize(
    "kwargs",
    [{"steps": (5.0, 50.0)}, {"steps": (50.0, 5.0, 100.0)}, {"steps": (0.0, 100.0)},
     {"max_p99_ratio": 0.9}, {"min_requests": 0}, {"p99_slack_s": -0.001},
     {"max_error_rate_increase": math.nan}, {"max_p99_ratio": math.nan}, {"hold_s": math.inf},
     {"steps": (math.nan, 100.0)}, {"steps": (100.0,)}, {"max_error_rate_increase": 1.0},
     {"max_refusal_rate_increase": -0.1}, {"max_refusal_rate_increase": 2.0}],
)  # fmt: skip
def test_an_inconsistent_plan_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Plan(**kwargs)  # type: ignore[arg-type]


def test_p99_interpolates_within_its_bucket_like_promql() -> None:
    buckets = [(0.01, 50.0), (0.1, 90.0), (1.0, 100.0), (math.inf, 100.0)]
    # rank 99 lies in (0.1, 1.0], 9 of its 10 counts in: 0.1 + 0.9 * 0.9.
    assert p99_from_buckets(buckets) == pytest.approx(0.91)
    assert p99_from_buckets([(0.1, 0.0), (math.inf, 0.0)]) is None


def test_counters_of_a_worker_that_restarted_count_from_zero_whole() -> None:
    """One counter gone back (or gone) shows the worker restarted: every counter of it counts
    from 0, those that came back past their old value too. Differenced key by key, a
    canary that crashed undercounted its errors: 40 INTERNAL before, 45 after the restart
    read as 5 (review finding)."""
    assert difference({"a": 5.0, "b": 2.0}, {"a": 3.0, "b": 1.0}) == {"a": 2.0, "b": 1.0}
    before = {"code:OK": 20000.0, "code:INTERNAL": 40.0}
    assert difference({"code:OK": 3000.0, "code:INTERNAL": 45.0}, before) == {
        "code:OK": 3000.0,
        "code:INTERNAL": 45.0,
    }
    assert difference({"code:INTERNAL": 41.0}, before) == {"code:INTERNAL": 41.0}


WORKER_METRICS = """# TYPE inference_worker_requests_total counter
inference_worker_requests_total{{model="m",version="1",code="OK"}} {ok}
inference_worker_requests_total{{model="m",version="1",code="INTERNAL"}} {failed}
inference_worker_requests_total{{model="m",version="1",code="INVALID_ARGUMENT"}} 7
inference_worker_requests_total{{model="other",version="1",code="INTERNAL"}} 99
# TYPE inference_worker_row_latency_seconds histogram
inference_worker_row_latency_seconds_bucket{{model="m",version="1",le="0.1"}} {ok}
inference_worker_row_latency_seconds_bucket{{model="m",version="1",le="+Inf"}} {ok}
inference_worker_row_latency_seconds_count{{model="m",version="1"}} {ok}
inference_worker_row_latency_seconds_sum{{model="m",version="1"}} 1
"""


def test_a_worker_restarted_with_every_counter_past_its_old_value_counts_from_zero() -> None:
    """No counter went back: only its process's start time tells the restart. Differenced,
    the crashed canary's 2 errors before the crash went uncounted (review finding)."""
    started = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n"
    before = parse_snapshot([WORKER_METRICS.format(ok=60, failed=2) + started.format(100)], "m")
    after = parse_snapshot([WORKER_METRICS.format(ok=300, failed=5) + started.format(200)], "m")

    health = health_between(before, after, "1")
    assert (health.requests, health.errors, health.refused) == (305, 5, 7)
    # The same process all along: differenced.
    same = parse_snapshot([WORKER_METRICS.format(ok=300, failed=5) + started.format(100)], "m")
    health = health_between(before, same, "1")
    assert (health.requests, health.errors, health.refused) == (243, 3, 0)


def test_a_worker_front_restarted_is_no_restart_of_the_worker() -> None:
    """A worker with fronts serves each front's start time (labelled worker_front) after its
    engine's; the last one read stood for the worker's, so a front restarted, or missing from
    a scrape, took every count since the engine started as the step's (review finding)."""
    engine = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 100\n"
    front = 'process_start_time_seconds{{worker_front="{}"}} {}\n'.format
    before = WORKER_METRICS.format(ok=60, failed=2) + engine + front(0, 200) + front(1, 300)
    restarted = engine + front(0, 200) + front(1, 400)
    missing = engine + front(0, 200)  # front 1 not ready at this scrape
    for fronts in (restarted, missing):
        after = WORKER_METRICS.format(ok=70, failed=2) + fronts
        health = health_between(parse_snapshot([before], "m"), parse_snapshot([after], "m"), "1")
        assert (health.requests, health.errors, health.refused) == (10, 0, 0), fronts


def test_health_between_two_scrapes_of_two_workers() -> None:
    before = parse_snapshot([WORKER_METRICS.format(ok=10, failed=1)] * 2, "m")
    after = parse_snapshot([WORKER_METRICS.format(ok=60, failed=3)] * 2, "m")

    health = health_between(before, after, "1")
    # Per worker: 50 OK and 2 INTERNAL more (the caller's INVALID_ARGUMENT is not an error,
    # nor a call served: a refusal, none in the window).
    assert (health.requests, health.errors, health.refused) == (104, 4, 0)
    assert health.p99_s is not None and 0 < health.p99_s <= 0.1


def test_a_worker_restarting_counts_from_zero_alone() -> None:
    # Worker b restarted within the window: its 5 calls since count, not its 60 before, and
    # worker a's 50 more are not lost in a fleet-wide sum that went down (110 -> 55). Its 7
    # INVALID_ARGUMENT since the restart count too.
    before = parse_snapshot([WORKER_METRICS.format(ok=50, failed=0)] * 2, "m")
    after = parse_snapshot(
        [WORKER_METRICS.format(ok=100, failed=0), WORKER_METRICS.format(ok=5, failed=0)], "m"
    )

    health = health_between(before, after, "1")
    assert (health.requests, health.errors, health.refused) == (55, 0, 7)


def test_the_baseline_is_an_earlier_steps_stable_when_this_one_served_too_few() -> None:
    plan = Plan(min_requests=100)
    earlier = Health(requests=1000, errors=20, p99_s=0.05)
    idle = Health(requests=3, errors=0, p99_s=0.01)
    assert baseline(plan, idle, earlier) is earlier
    assert baseline(plan, STABLE, earlier) is STABLE
    assert baseline(plan, idle, None) is idle
