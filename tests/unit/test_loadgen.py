"""Load generator and sweep statistics: Poisson schedule, late-send accounting, windows,
percentiles and the goodput search, on made-up numbers (no servers, no sleeps)."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

import grpc
import numpy as np
import pytest
from inference_fabric_client.throttle import AdaptiveThrottle, ThrottleCounts, ThrottlePolicy

from bench.fabric.loadgen import (
    CLIENT_TIMEOUT,
    LATE_THRESHOLD_S,
    OK,
    THROTTLED,
    Outcome,
    Send,
    arrival_schedule,
    retry_after_of,
    run_closed_loop,
    split_windows,
    status_of,
    throttled,
)
from bench.fabric.sweep import GoodputSearch, percentile, summarize_rate, window_stats

pytestmark = pytest.mark.unit

SLO_S = 0.25


def outcome(
    at_s: float = 0.0, latency_s: float = 0.01, status: str = OK, late_s: float = 0.0
) -> Outcome:
    return Outcome(scheduled_s=at_s, lateness_s=late_s, latency_s=latency_s, status=status)


# -- schedule -------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [5.0, 200.0, 3000.0])
def test_schedule_has_the_requested_mean_rate(rate: float) -> None:
    duration = 20_000 / rate  # ~20k arrivals: the mean is within ~0.7% at 1 sigma
    times = arrival_schedule(rate, duration, seed=1)
    assert len(times) / duration == pytest.approx(rate, rel=0.03)
    assert times == sorted(times) and times[0] > 0 and times[-1] < duration


def test_schedule_gaps_are_exponential() -> None:
    times = arrival_schedule(100.0, 200.0, seed=2)
    gaps = np.diff([0.0, *times])
    # Exponential: standard deviation equals the mean (coefficient of variation 1), and the
    # share of gaps shorter than the mean is 1 - 1/e.
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)
    assert np.mean(gaps < 0.01) == pytest.approx(1 - math.exp(-1), abs=0.02)


@pytest.mark.parametrize("burstiness", [0.1, 0.5, 4.0])
def test_bursty_schedule_keeps_the_mean_rate_with_gamma_gaps(burstiness: float) -> None:
    rate, duration = 500.0, 80.0  # ~40k arrivals
    times = arrival_schedule(rate, duration, seed=3, burstiness=burstiness)
    assert len(times) / duration == pytest.approx(rate, rel=0.05)
    assert times == sorted(times) and times[0] > 0 and times[-1] < duration
    gaps = np.diff([0.0, *times])
    # Gamma gaps of shape k: coefficient of variation 1 / sqrt(k) (3.16 at 0.1, 0.5 at 4).
    cv = statistics.stdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_bursty_arrivals_clump_where_poisson_ones_spread() -> None:
    # The same mean rate; counted in 10 ms bins, bursty arrivals leave most bins empty and pack
    # the rest (the counts' variance about 10x their mean at burstiness 0.1, 1x for Poisson).
    def bins(burstiness: float) -> np.ndarray:
        times = arrival_schedule(1000.0, 60.0, seed=4, burstiness=burstiness)
        return np.bincount((np.asarray(times) / 0.01).astype(int), minlength=6000)

    poisson, bursty = bins(1.0), bins(0.1)
    assert poisson.var() / poisson.mean() == pytest.approx(1.0, abs=0.1)
    assert bursty.var() / bursty.mean() > 5
    assert np.mean(bursty == 0) > 10 * np.mean(poisson == 0)


def test_a_burstiness_of_one_draws_the_poisson_schedule() -> None:
    """The draws of the Poisson process from before gamma gaps existed: seeded runs of earlier
    commits and this one still offer the same arrivals."""
    rng, expected = random.Random(5), []
    at_s = rng.expovariate(80.0)
    while at_s < 30.0:
        expected.append(at_s)
        at_s += rng.expovariate(80.0)
    assert arrival_schedule(80.0, 30.0, seed=5) == expected
    assert arrival_schedule(80.0, 30.0, seed=5, burstiness=1.0) == expected
    assert arrival_schedule(80.0, 30.0, seed=5, burstiness=0.9) != expected


def test_schedule_is_deterministic_for_a_seed() -> None:
    assert arrival_schedule(50.0, 10.0, seed=7) == arrival_schedule(50.0, 10.0, seed=7)
    assert arrival_schedule(50.0, 10.0, seed=7) != arrival_schedule(50.0, 10.0, seed=8)


def test_schedule_is_bounded_by_count_and_time() -> None:
    assert len(arrival_schedule(1000.0, 10.0, seed=0, max_count=25)) == 25
    assert all(t < 0.5 for t in arrival_schedule(1000.0, 0.5, seed=0))
    with pytest.raises(ValueError):
        arrival_schedule(0.0, 1.0, seed=0)
    for burstiness in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="burstiness"):
            arrival_schedule(10.0, 1.0, seed=0, burstiness=burstiness)


# -- outcomes, windows, late sends ----------------------------------------------------------


def test_a_send_is_late_past_the_threshold() -> None:
    assert not outcome(late_s=LATE_THRESHOLD_S).late
    assert outcome(late_s=LATE_THRESHOLD_S + 1e-4).late


def test_window_with_more_than_one_percent_late_sends_is_invalid() -> None:
    on_time = [outcome(i * 0.01) for i in range(198)]
    two_late = [*on_time, outcome(late_s=0.02), outcome(late_s=0.02)]
    three_late = [*two_late[:-3], outcome(late_s=0.02), outcome(late_s=0.02), outcome(late_s=0.1)]
    assert window_stats(two_late, SLO_S, 2.0).late == 2
    assert window_stats(two_late, SLO_S, 2.0).is_valid  # exactly 1%
    assert window_stats(three_late, SLO_S, 2.0).late_fraction == pytest.approx(0.015)
    assert not window_stats(three_late, SLO_S, 2.0).is_valid
    assert not window_stats([], SLO_S, 2.0).is_valid


def test_a_late_send_counts_its_wait_in_its_latency() -> None:
    """A call the generator sent 0.5 s late waited 0.5 s more, as its caller would have: it
    counted as good, and in the p99, from when it left (coordinated omission, bench review)."""
    stats = window_stats([outcome(late_s=0.5, latency_s=0.01)], SLO_S, 1.0)
    assert (stats.ok, stats.good) == (1, 0)
    assert stats.p99_s == pytest.approx(0.51)
    on_time = window_stats([outcome(late_s=-0.001, latency_s=0.01)], SLO_S, 1.0)
    assert on_time.good == 1 and on_time.p99_s == pytest.approx(0.01)  # early: not less


def test_window_counts_good_ok_and_statuses() -> None:
    window = [
        *(outcome(latency_s=0.1) for _ in range(6)),
        outcome(latency_s=0.3),  # OK but over the SLO: accepted, not good
        outcome(latency_s=0.001, status="RESOURCE_EXHAUSTED"),
        outcome(latency_s=0.25, status="DEADLINE_EXCEEDED"),
        outcome(latency_s=1.0, status=CLIENT_TIMEOUT),
    ]
    stats = window_stats(window, SLO_S, 1.0)
    assert (stats.sent, stats.ok, stats.good) == (10, 7, 6)
    assert stats.statuses == {
        OK: 7,
        "RESOURCE_EXHAUSTED": 1,
        "DEADLINE_EXCEEDED": 1,
        CLIENT_TIMEOUT: 1,
    }
    assert stats.goodput_per_s == 6.0
    assert stats.p50_s == pytest.approx(0.1)  # percentiles of accepted requests only


def test_split_windows_drops_warm_up_and_tail() -> None:
    outcomes = [outcome(at_s=t) for t in (0.1, 0.9, 1.0, 1.5, 2.2, 3.9, 4.0, 4.5)]
    windows = split_windows(outcomes, warmup_s=1.0, window_s=1.0, num_windows=3)
    assert [[o.scheduled_s for o in w] for w in windows] == [[1.0, 1.5], [2.2], [3.9]]


def test_a_rate_with_more_than_one_percent_of_its_sends_late_is_void() -> None:
    """Late sends and good answers are pooled over every window: a run whose one window fell
    behind (5% late, half good) passed on the other two, that window left out (bench review)."""
    good = [outcome() for _ in range(300)]
    behind = [*(outcome(late_s=0.05, latency_s=0.5) for _ in range(15)),
              *(outcome(latency_s=0.5) for _ in range(135)), *good[:150]]  # fmt: skip
    void = summarize_rate(100.0, [good, good, behind], SLO_S, 3.0)
    assert not void.is_valid and not void.passed
    assert void.good_fraction == pytest.approx(750 / 900)
    few_late = [*(outcome(late_s=0.05) for _ in range(6)), *good[:294]]  # 2% late, all good
    assert summarize_rate(100.0, [good, good, few_late], SLO_S, 3.0).passed  # 0.67% pooled


def test_rate_passes_on_pooled_windows() -> None:
    good = [outcome() for _ in range(300)]
    one_bad = [*good[:-1], outcome(status="UNAVAILABLE")]
    late = [outcome(late_s=0.05) for _ in range(300)]
    assert summarize_rate(100.0, [good, one_bad, good], SLO_S, 3.0).passed
    # 2% failures in one window, none elsewhere: pooled 0.67% -> still served.
    two_percent = [*good[:-6], *(outcome(status="UNAVAILABLE") for _ in range(6))]
    assert summarize_rate(100.0, [good, two_percent, good], SLO_S, 3.0).passed
    failing = [*good[:-12], *(outcome(latency_s=0.5) for _ in range(12))]
    assert not summarize_rate(100.0, [failing, failing, good], SLO_S, 3.0).passed
    # Most windows late: the generator set the pace; the rate is neither served nor failed.
    invalid = summarize_rate(100.0, [late, late, good], SLO_S, 3.0)
    assert not invalid.is_valid and not invalid.passed
    figure = summarize_rate(100.0, [good, one_bad, good], SLO_S, 3.0).figure("goodput_per_s")
    assert figure == {"median": 100.0, "min": 299 / 3, "max": 100.0}


def test_status_of_records_grpc_codes_timeouts_and_peer_errors() -> None:
    rpc_error = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata()
    )
    assert status_of(rpc_error) == "RESOURCE_EXHAUSTED"
    assert status_of(TimeoutError()) == CLIENT_TIMEOUT

    class PeerError(Exception):
        def code(self) -> object:
            return type("Code", (), {"name": "HTTP_503"})()

    assert status_of(PeerError()) == "HTTP_503"
    assert status_of(ConnectionResetError()) == "ConnectionResetError"


# -- percentile -------------------------------------------------------------------------------


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = random.Random(3)
    for size in (1, 2, 7, 100, 1001):
        values = [rng.expovariate(10.0) for _ in range(size)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert percentile([], 99) is None
    assert percentile([3.0], 50) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted input
    with pytest.raises(ValueError):
        percentile([1.0], 101)


# -- goodput search ---------------------------------------------------------------------------


def fake_server(capacity: float, base_s: float = 0.02):
    """Latencies of an M/M/1-like server: they grow as 1 / (1 - load) and explode past
    capacity. Returns measure(rate) -> passed, built from synthetic windows, so the search
    is driven through the same statistics the benchmark uses."""

    def measure(rate: float) -> bool:
        load = rate / capacity
        latency = base_s / (1 - load) if load < 1 else 10.0
        # One request in 200 takes 3x the typical latency (a p99.5 tail).
        window = [outcome(latency_s=latency * (3 if i % 200 == 0 else 1)) for i in range(400)]
        return summarize_rate(rate, [window] * 3, SLO_S, 4.0).passed

    return measure


def run_search(search: GoodputSearch, measure) -> GoodputSearch:
    while (rate := search.next_rate()) is not None:
        search.record(rate, measure(rate))
    return search


@pytest.mark.parametrize("start", [20.0, 250.0, 280.0, 2000.0])
def test_search_finds_goodput_from_below_and_above(start: float) -> None:
    # Good while 0.02 / (1 - r/300) <= 0.25 s, i.e. r <= 276.
    true_goodput = 300 * (1 - 0.02 / SLO_S)
    search = run_search(GoodputSearch(start, max_probes=30), fake_server(300.0))
    assert search.best is not None
    assert search.best <= true_goodput  # never reports a rate that fails
    assert search.best >= true_goodput / 1.05  # within the tolerance
    assert search.lowest_failure is not None and search.lowest_failure > true_goodput


def test_search_is_bounded_by_probes_and_min_rate() -> None:
    search = run_search(GoodputSearch(100.0, max_probes=3), fake_server(1000.0))
    assert len(search.probes) == 3 and search.best == pytest.approx(100 * 1.25**2)
    nothing = run_search(GoodputSearch(10.0, min_rate=1.0, max_probes=30), lambda rate: False)
    assert nothing.best is None and nothing.probes[-1][0] == 1.0


def test_search_ignores_a_noisy_pass_above_a_failure() -> None:
    search = GoodputSearch(100.0)
    for rate, passed in ((100.0, True), (125.0, False), (140.0, True)):
        search.record(rate, passed)
    assert search.best == 100.0
    assert search.next_rate() == pytest.approx(math.sqrt(100.0 * 125.0))


def refusal(retry_after_ms: str | None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if retry_after_ms is not None:
        trailing.add("retry-after-ms", retry_after_ms)
    return grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), trailing, "busy"
    )


def test_retry_after_hint_is_read_from_trailing_metadata() -> None:
    assert retry_after_of(refusal("250")) == pytest.approx(0.25)
    assert retry_after_of(refusal(None)) is None
    assert retry_after_of(refusal("soon")) is None
    assert retry_after_of(ValueError("not grpc")) is None


def test_closed_loop_callers_wait_as_long_as_the_server_asks() -> None:
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise refusal("400")

    result = asyncio.run(run_closed_loop(refused, concurrency=2, duration_s=0.3))

    # Each caller sends, is told to come back in 0.4 s, and the run is over by then: a caller
    # pausing only the default 20 ms would have sent about 15 times.
    assert calls == 2
    assert result.statuses == {"RESOURCE_EXHAUSTED": 2}
    assert result.ok == 0


def test_a_throttled_sender_refuses_unsent_and_tells_its_throttle_what_the_server_did() -> None:
    """loadgen.throttled: a call its throttle refuses is never sent (THROTTLED); each call sent
    is recorded refused or not by its status, one cut short here by its timeout as not
    refused."""
    num_sent = 0

    def sender(failures: list[BaseException | None], delay_s: float = 0.0) -> Send:
        async def send() -> None:
            nonlocal num_sent
            num_sent += 1
            await asyncio.sleep(delay_s)
            if (failure := failures.pop(0)) is not None:
                raise failure

        return send

    async def statuses_of(send: Send, count: int, timeout_s: float = 10.0) -> list[str]:
        statuses = []
        for _ in range(count):  # one after another: each answer is in before the next call
            try:
                async with asyncio.timeout(timeout_s):
                    await send()
                statuses.append(OK)
            except Exception as error:
                statuses.append(status_of(error))
        return statuses

    def refused_throughout(throttle: AdaptiveThrottle, seed: int) -> list[str]:
        send = throttled(sender([refusal("10")] * 40), throttle, random.Random(seed))
        return asyncio.run(statuses_of(send, 40))

    # Every call is refused by the server; past min_requests the throttle refuses with a
    # chance of about n / (n + 1), so most calls are never sent.
    throttle = AdaptiveThrottle(ThrottlePolicy(min_requests=2))
    statuses = refused_throughout(throttle, seed=3)
    sent_by_the_first = num_sent
    # Its draws come from the generator it is given: the same seed refuses the same calls.
    assert refused_throughout(AdaptiveThrottle(ThrottlePolicy(min_requests=2)), 3) == statuses
    assert statuses[:2] == ["RESOURCE_EXHAUSTED"] * 2
    assert set(statuses) == {"RESOURCE_EXHAUSTED", THROTTLED}
    assert statuses.count("RESOURCE_EXHAUSTED") == sent_by_the_first < 20
    assert throttle.counts(time.monotonic()) == ThrottleCounts(
        num_requests=40, num_accepts=0, is_refusing=True
    )

    timing_out = AdaptiveThrottle(ThrottlePolicy(min_requests=0))
    slow = throttled(sender([None], delay_s=1.0), timing_out)
    assert asyncio.run(statuses_of(slow, 1, timeout_s=0.01)) == [CLIENT_TIMEOUT]
    # Not refused by the server: a timeout here counts as accepted, as DEADLINE_EXCEEDED does.
    assert timing_out.counts(time.monotonic()) == ThrottleCounts(
        num_requests=1, num_accepts=1, is_refusing=False
    )
