"""AdaptiveThrottle: no refusals while downstream accepts, ~k x accepts sent under overload,
recovery after a flood, retry hints, per-model isolation."""

from __future__ import annotations

import random
import time

import pytest
from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.gateway.metrics import GatewayMetrics
from services.gateway.throttle import HIGHEST_FRESH_S, AdaptiveThrottle, Shed, ThrottleConfig

pytestmark = pytest.mark.unit


def make_throttle(**overrides: float) -> AdaptiveThrottle:
    return AdaptiveThrottle(ThrottleConfig(**overrides))


def offer(
    throttle: AdaptiveThrottle,
    *,
    rate_per_s: float,
    capacity_per_s: float,
    seconds: float,
    start_s: float = 0.0,
    model: str = "m",
    seed: int = 0,
) -> tuple[int, int, int]:
    """`rate_per_s` requests for `seconds`; downstream is a server of `capacity_per_s` that
    accepts while its backlog stays under 0.25 s and refuses the rest with a 50 ms hint.
    Returns (offered, shed locally, refused downstream)."""
    rng = random.Random(seed)
    backlog_s, last_s = 0.0, start_s
    offered = shed = refused = 0
    for i in range(int(rate_per_s * seconds)):
        now_s = start_s + i / rate_per_s
        offered += 1
        if throttle.admit(model, now_s, rng.random()) is not None:
            shed += 1
            continue
        backlog_s = max(0.0, backlog_s - (now_s - last_s))
        last_s = now_s
        if backlog_s + 1.0 / capacity_per_s <= 0.25:
            backlog_s += 1.0 / capacity_per_s
            throttle.record(model, now_s, is_accepted=True)
        else:
            refused += 1
            throttle.record(model, now_s, is_accepted=False, retry_after_s=0.05)
    return offered, shed, refused


def test_nothing_is_shed_while_downstream_accepts_everything() -> None:
    throttle = make_throttle()
    _, shed, refused = offer(throttle, rate_per_s=100, capacity_per_s=200, seconds=5)

    assert (shed, refused) == (0, 0)
    assert throttle.reject_probability("m", 5.0) == 0.0


@pytest.mark.parametrize("factor", [2.0, 10.0])
def test_s03_overload_sends_about_k_times_what_downstream_accepts(factor: float) -> None:
    k, capacity_per_s, seconds = 1.5, 100, 10
    throttle = make_throttle(accepts_multiplier=k)
    offered, shed, refused = offer(
        throttle, rate_per_s=capacity_per_s * factor, capacity_per_s=capacity_per_s, seconds=seconds
    )

    sent = offered - shed
    accepted = sent - refused
    # Downstream stays full: it accepts all it can take over the run...
    assert accepted >= 0.95 * capacity_per_s * seconds
    # ...and is sent about k times what it accepts (the SRE formula's fixed point), a little
    # more while the decaying counts catch up, never the whole flood.
    assert accepted < sent <= 1.1 * k * accepted
    assert shed > 0.5 * (offered - k * capacity_per_s * seconds)


def test_normal_traffic_after_a_flood_is_no_longer_shed_within_a_few_memories() -> None:
    throttle = make_throttle(accepts_multiplier=1.5, memory_s=0.25)
    offer(throttle, rate_per_s=1000, capacity_per_s=100, seconds=10)

    # Normal traffic resumes at once: its accepts wash the flood out of the counts (with no
    # traffic at all the counts decay but their ratio, and so the throttle, would stay).
    _, shed_early, _ = offer(throttle, rate_per_s=50, capacity_per_s=100, seconds=2, start_s=10)
    _, shed_late, _ = offer(throttle, rate_per_s=50, capacity_per_s=100, seconds=5, start_s=12)
    assert shed_early > 0
    assert shed_late <= 0.01 * 250
    assert throttle.reject_probability("m", 17.0) == 0.0


def test_a_local_refusal_carries_downstreams_recent_retry_hint() -> None:
    throttle = make_throttle(accepts_multiplier=1.0, default_retry_after_s=0.5)
    for i in range(50):
        throttle.admit("m", i * 0.001, 0.99)
        throttle.record("m", i * 0.001, is_accepted=False, retry_after_s=0.2)

    decision = throttle.admit("m", 0.05, 0.0)
    assert isinstance(decision, Shed)
    assert decision.retry_after_s == pytest.approx(0.2)
    assert decision.probability == pytest.approx(0.95)  # the cap


def test_models_are_throttled_apart() -> None:
    throttle = make_throttle()
    offer(throttle, rate_per_s=1000, capacity_per_s=100, seconds=5, model="flooded")

    assert throttle.reject_probability("flooded", 5.0) > 0.5
    assert throttle.reject_probability("quiet", 5.0) == 0.0
    assert throttle.admit("quiet", 5.0, 0.0) is None


def test_multiplier_zero_disables_the_throttle() -> None:
    throttle = make_throttle(accepts_multiplier=0.0)
    _, shed, _ = offer(throttle, rate_per_s=1000, capacity_per_s=10, seconds=2)

    assert shed == 0


@pytest.mark.parametrize(
    "overrides",
    [
        {"accepts_multiplier": -1.0},
        # Below 1, calls all accepted count as excess: refusals climbed to the cap (review).
        {"accepts_multiplier": 0.5},
        {"accepts_multiplier": float("inf")},
        {"accepts_multiplier": float("nan")},
        {"memory_s": 0.0},
        {"default_retry_after_s": -1.0},
        {"default_retry_after_s": 0.0},  # a refusal with no retry-after-ms
        {"default_retry_after_s": float("inf")},  # INTERNAL: round(inf) raised
        {"default_retry_after_s": float("nan")},
        {"max_reject_probability": 1.0},
    ],
)
def test_config_rejects_nonsense(overrides: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ThrottleConfig(**overrides)


def test_a_burst_with_no_answers_yet_is_not_throttled() -> None:
    throttle = make_throttle(accepts_multiplier=1.5)

    assert all(throttle.admit("m", i * 1e-4, 0.0) is None for i in range(64))


def test_when_downstream_accepted_nothing_some_requests_still_go_through() -> None:
    throttle = make_throttle(accepts_multiplier=1.5, max_reject_probability=0.95)
    for i in range(500):  # downstream refused everything for a moment
        throttle.record("m", i * 0.001, is_accepted=False)

    rng = random.Random(0)
    sent = sum(throttle.admit("m", 0.5, rng.random()) is None for _ in range(1000))
    assert 20 < sent < 100
    # It accepts again: the throttle opens within a few memories of steady accepts.
    offer(throttle, rate_per_s=50, capacity_per_s=100, seconds=3, start_s=0.5)
    assert throttle.reject_probability("m", 3.5) == 0.0


def test_a_silence_after_a_flood_forgets_it() -> None:
    # Callers honouring retry-after go quiet: nothing is sent that could be accepted, yet the
    # throttle must not keep the flood's ratio.
    throttle = make_throttle(accepts_multiplier=1.5, memory_s=0.25)
    offer(throttle, rate_per_s=1000, capacity_per_s=100, seconds=10)

    assert throttle.reject_probability("m", 10.0) > 0.8
    assert throttle.reject_probability("m", 11.5) < 0.01


def test_keys_silent_for_many_memories_are_forgotten() -> None:
    """Each model, class and tenant seen kept its counts for the gateway's life (review
    finding): keys silent FORGET_MEMORIES (10 s here) are dropped as new ones come, while a
    key in use stays, its counts whole."""
    throttle = make_throttle(memory_s=1.0)
    for i in range(1_000):  # a new tenant every 0.1 s: about 100 within the last 10 s
        throttle.record(f"m/interactive/t{i}", i * 0.1, is_accepted=True)
        throttle.record("busy", i * 0.1, is_accepted=False)
    assert throttle.num_keys <= 2 * 101 + 2
    assert throttle.reject_probability("busy", 100.0) > 0.5


def test_a_models_gauge_reads_its_online_keys_highest_probability_and_changes_nothing() -> None:
    """The gauge showed the last call's outcome (0 for each call sent on while 60% were
    refused) and the last tenant's key; it reads the highest of the model's online keys,
    decayed to the scrape, without touching the counts (a scrape runs on another thread)."""
    throttle = make_throttle(memory_s=0.5)
    offer(throttle, rate_per_s=1000, capacity_per_s=100, seconds=5, model="m/interactive/a")
    offer(throttle, rate_per_s=1000, capacity_per_s=100, seconds=5, model="m/batch/b")
    offer(throttle, rate_per_s=10, capacity_per_s=100, seconds=5, model="m/interactive/c")
    flooded = throttle.reject_probability("m/interactive/a", 5.0)
    assert flooded > 0.5 and throttle.reject_probability("m/interactive/c", 5.0) == 0.0
    assert throttle.highest_probability("m", 5.0) == pytest.approx(flooded)
    assert throttle.highest_probability("other", 5.0) == 0.0
    # Decayed to the time asked (one pass serves HIGHEST_FRESH_S), as a request arriving then
    # would find it; nothing changed.
    assert throttle.highest_probability("m", 5.0 + HIGHEST_FRESH_S / 2) == pytest.approx(flooded)
    later = throttle.highest_probability("m", 5.0 + 2 * HIGHEST_FRESH_S)
    assert later < 0.2 * flooded
    assert throttle.reject_probability("m/interactive/a", 5.0) == pytest.approx(flooded)
    assert throttle.highest_probability("m", 5.0) == pytest.approx(flooded)  # passed again


def test_the_gateways_gauge_follows_the_throttle_at_each_scrape() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    throttle = make_throttle(memory_s=60.0)
    start_s = time.monotonic() - 5.0
    offer(throttle, rate_per_s=1000, capacity_per_s=100, seconds=5, start_s=start_s,
          model="m/interactive/a")  # fmt: skip
    metrics.follow_throttle("m", throttle.highest_probability)
    shown = registry.get_sample_value(names.GATEWAY_THROTTLE_PROBABILITY, {"model": "m"})
    assert shown is not None and shown > 0.5
