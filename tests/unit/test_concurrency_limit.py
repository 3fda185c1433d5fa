"""The door's concurrency limit (services.common.concurrency_limit): pure, time given."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from services.common.concurrency_limit import MAX_HINT_INTERVALS, LimitConfig, QueueDelayLimit
from services.common.door_config import MIN_DERIVED_TARGET_S, DoorConfig
from services.common.errors import retry_after_trailer

pytestmark = pytest.mark.unit

CONFIG = LimitConfig(initial=128, minimum=8, target_s=0.025, interval_s=0.25)
PROBE_S = 0.05


def run(limit: QueueDelayLimit, start_s: float, delays_s: list[float], in_flight: int) -> float:
    """One update per probe period; returns the time after the last."""
    now_s = start_s
    for delay_s in delays_s:
        limit.update(now_s, delay_s, in_flight)
        now_s += PROBE_S
    return now_s


def test_a_burst_shorter_than_the_interval_is_absorbed() -> None:
    limit = QueueDelayLimit(CONFIG)
    # Four probes (0.15 s) far above the target, then one below: never standing.
    run(limit, 0.0, [0.2, 0.3, 0.3, 0.2, 0.01], in_flight=128)
    assert limit.limit >= CONFIG.initial
    assert not limit.is_standing


def test_a_standing_queue_backs_off_from_the_calls_in_flight_down_to_the_minimum() -> None:
    limit = QueueDelayLimit(CONFIG)
    # Above the target from t=0: standing once 0.25 s have passed (the sixth probe).
    now_s = run(limit, 0.0, [0.04] * 5, in_flight=128)
    assert limit.limit == CONFIG.initial and not limit.is_standing
    limit.update(now_s, 0.04, 40)
    assert limit.is_standing
    # Backs off from the 40 calls actually in flight, not from 128.
    assert limit.limit == int(40 * CONFIG.backoff)
    now_s = run(limit, now_s + PROBE_S, [0.04] * 20, in_flight=limit.limit)
    assert limit.limit == CONFIG.minimum


def test_a_standing_queue_sheds_until_a_measurement_finds_it_drained() -> None:
    """Shedding (every call over its share refused, whatever is in flight) starts when the
    queue has stood for the interval, with no call in flight at all (a process picking calls
    up slower than they come), stops at the first delay at or below the target, and starts
    again after a fifth of the interval above it while the limit is still backed off."""
    limit = QueueDelayLimit(CONFIG)
    now_s = run(limit, 0.0, [0.1] * 5, in_flight=0)
    assert not limit.is_shedding
    now_s = run(limit, now_s, [0.1], in_flight=0)
    assert limit.is_shedding and limit.limit == CONFIG.minimum
    now_s = run(limit, now_s, [0.1] * 3, in_flight=0)
    assert limit.is_shedding
    now_s = run(limit, now_s, [CONFIG.target_s], in_flight=0)
    assert not limit.is_shedding
    # Limited (backed off, not yet back at rest): a fifth of the interval above will do
    # (0.05 s), not the whole of it (0.25 s): shedding again by the third probe above.
    assert limit.limit < CONFIG.initial
    now_s = run(limit, now_s, [0.1], in_flight=0)
    assert not limit.is_shedding
    run(limit, now_s, [0.1] * 2, in_flight=0)
    assert limit.is_shedding


def test_the_limit_holds_while_shedding_and_at_the_first_measurement_after() -> None:
    """Calls in flight fall while the door sheds: the limit does not back off from them, nor
    at the measurement that ends shedding; later it does, from the calls in flight."""
    limit = QueueDelayLimit(CONFIG)
    for k in range(6):  # standing at 0.25 s with 40 in flight: the limit backs off, binding
        limit.update(k * 0.05, 0.1, 40)
    assert limit.limit == int(40 * CONFIG.backoff) and not limit.is_shedding
    limit.update(0.26, 0.1, 5)  # few in flight, well under the limit: sheds
    assert limit.is_shedding and limit.limit == int(40 * CONFIG.backoff)
    for k in range(10):
        limit.update(0.3 + k * 0.05, 0.1, 0)
    assert limit.is_shedding and limit.limit == int(40 * CONFIG.backoff)
    between_s = 1.5 * CONFIG.target_s  # above the target, short of shedding
    limit.update(1.0, between_s, 0)
    assert not limit.is_shedding and limit.limit == int(40 * CONFIG.backoff)
    limit.update(1.1, between_s, 20)
    assert limit.limit == int(20 * CONFIG.backoff) and not limit.is_shedding


def test_a_late_queue_is_only_limited_while_calls_in_flight_reach_the_limit() -> None:
    """Calls in flight at the limit: the limit is what holds them back, and backs off; the
    queue sheds only once they stay short of it."""
    limit = QueueDelayLimit(CONFIG)
    now_s = run(limit, 0.0, [0.1] * 6, in_flight=CONFIG.initial)
    assert limit.is_standing and not limit.is_shedding
    assert limit.limit == int(CONFIG.initial * CONFIG.backoff)
    run(limit, now_s, [0.1], in_flight=2)
    assert limit.is_shedding


def test_a_queue_standing_under_the_shed_delay_is_only_limited() -> None:
    """Standing, but with a delay short of `shed_factor` targets (calls still in time): the
    limit backs off, nothing sheds; with shed_factor 0 no delay sheds."""
    limit = QueueDelayLimit(CONFIG)
    run(limit, 0.0, [CONFIG.shed_factor * CONFIG.target_s * 0.9] * 12, in_flight=40)
    assert limit.is_standing and limit.limit < 40 and not limit.is_shedding
    never = QueueDelayLimit(dataclasses.replace(CONFIG, shed_factor=0))
    run(never, 0.0, [10.0] * 12, in_flight=0)
    assert never.is_standing and not never.is_shedding


def test_a_process_starved_of_cpu_does_not_shed() -> None:
    limit = QueueDelayLimit(CONFIG)
    now_s = 0.0
    for _ in range(20):
        limit.update(now_s, 0.2, 0, busy_share=0.2)
        now_s += PROBE_S
    assert limit.is_standing and not limit.is_shedding


def test_below_the_target_a_used_limit_grows_and_an_unused_one_returns_to_initial() -> None:
    limit = QueueDelayLimit(CONFIG)
    now_s = run(limit, 0.0, [0.1] * 6, in_flight=20)
    assert limit.limit == 15
    # In use (calls in flight at the limit): grows by 10%, at least one call, per probe.
    now_s = run(limit, now_s, [0.01], in_flight=15)
    assert limit.limit == 16
    now_s = run(limit, now_s, [0.01] * 10, in_flight=200)
    assert 16 < limit.limit < CONFIG.initial
    # Unused (few in flight): back to the initial level within a few probes, never above it.
    run(limit, now_s, [0.001] * 6, in_flight=2)
    assert limit.limit == CONFIG.initial
    run(limit, now_s + 1.0, [0.001] * 20, in_flight=2)
    assert limit.limit == CONFIG.initial


def test_a_used_limit_grows_past_initial_up_to_the_maximum() -> None:
    config = LimitConfig(initial=10, minimum=1, maximum=12)
    limit = QueueDelayLimit(config)
    run(limit, 0.0, [0.0] * 5, in_flight=1000)
    assert limit.limit == 12


def test_a_limit_grown_past_initial_returns_to_it_once_unused() -> None:
    # A busy spell grew the limit to its maximum; once calls stop using it, a later cold burst
    # must meet the limit at rest (and back off from it within a fifth of the interval), not
    # the spell's. Before, nothing brought it down.
    config = LimitConfig(initial=64, minimum=8, maximum=4096, target_s=0.025, interval_s=0.25)
    limit = QueueDelayLimit(config)
    now_s = run(limit, 0.0, [0.001] * 60, in_flight=5000)
    assert limit.limit == config.maximum
    run(limit, now_s, [0.001] * 20, in_flight=2)
    assert limit.limit == config.initial


@pytest.mark.parametrize(
    "kwargs", [{"interval_s": math.inf}, {"target_s": math.nan}, {"target_s": math.inf}]
)
def test_a_limit_of_infinite_or_nan_times_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="finite"):
        LimitConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"probe_interval_s": math.nan}, {"probe_interval_s": math.inf}, {"share_window_s": math.inf},
     {"interval_s": math.inf}],
)  # fmt: skip
def test_a_door_of_infinite_or_nan_times_is_refused(kwargs: dict[str, float]) -> None:
    # NaN probed on every loop turn, inf never probed (so never limited), and an infinite
    # interval made each refusal's retry hint an internal error.
    with pytest.raises(ValueError, match="finite"):
        DoorConfig(**kwargs)  # type: ignore[arg-type]


def test_the_interval_restarts_when_the_delay_dips_below_the_target() -> None:
    limit = QueueDelayLimit(CONFIG)
    # 0.2 s above, one dip, 0.2 s above again: never 0.25 s above in a row.
    run(limit, 0.0, [0.1] * 5 + [0.01] + [0.1] * 5, in_flight=100)
    assert limit.limit == CONFIG.initial
    assert not limit.is_standing


def test_the_retry_hint_is_the_recent_drain_time_at_least_the_interval() -> None:
    limit = QueueDelayLimit(CONFIG)
    assert limit.retry_after_s() == CONFIG.interval_s
    limit.update(0.0, 0.8, 10)
    assert limit.retry_after_s() == 0.8
    limit.update(0.1, 30.0, 10)  # measured across a 30 s stall of the process
    assert limit.retry_after_s() == MAX_HINT_INTERVALS * CONFIG.interval_s


@pytest.mark.parametrize(
    "changes",
    [
        {"minimum": 0},
        {"minimum": 5000},
        {"maximum": 64},
        {"target_s": 0.0},
        {"interval_s": -1.0},
        {"backoff": 1.0},
        {"recovery": 1.0},
        {"growth": 0.0},
        {"used_share": 0.0},
        {"shed_factor": 0.5},
        {"shed_factor": float("inf")},
    ],
)
def test_unusable_settings_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LimitConfig(**changes)  # type: ignore[arg-type]


def test_retry_trailers_are_jittered_around_the_hint() -> None:
    rng = random.Random(7)
    values = [int(retry_after_trailer(0.2, rng)[1]) for _ in range(200)]
    assert min(values) >= 150 and max(values) <= 250
    assert len(set(values)) > 20
    assert retry_after_trailer(0.0001)[1] == "1"


def test_once_limited_a_fifth_of_the_interval_above_the_target_backs_off_again() -> None:
    limit = QueueDelayLimit(CONFIG)
    now_s = run(limit, 0.0, [0.1] * 6, in_flight=40)
    assert limit.limit == 30
    # One probe below the target (the queue drained, the limit in use grows by one), then the
    # flood queues again: 0.05 s above (a fifth of 0.25 s) backs off, not a whole interval.
    now_s = run(limit, now_s, [0.01], in_flight=30)
    assert limit.limit == 33
    limit.update(10.0, 0.1, 33)
    limit.update(10.04, 0.1, 33)
    assert limit.limit == 33, "not yet a fifth of the interval above"
    limit.update(10.06, 0.1, 33)
    assert limit.limit == int(33 * CONFIG.backoff)
    assert not limit.is_standing


def test_once_limited_it_backs_off_once_per_fifth_of_the_interval_however_often_measured() -> None:
    limit = QueueDelayLimit(CONFIG)
    run(limit, 0.0, [0.04] * 6, in_flight=100)  # standing at 0.25 s: 100 x 0.75
    limit.update(0.3, 0.01, 100)  # drained for a moment; in use, so it grows by a tenth
    assert limit.limit == 82
    # Measured every 20 ms above the target for 0.2 s: one back-off per 0.05 s above (at
    # 10.06, 10.12 and 10.18), not one per measurement.
    for k in range(11):
        limit.update(10.0 + k * 0.02, 0.04, 1000)
    assert limit.limit == int(82.5 * CONFIG.backoff**3)


def test_a_process_starved_of_cpu_is_not_limited_for_its_wait() -> None:
    """The same standing delay, once while the process was busy (its own queue) and once while
    it got a tenth of a core (its neighbours' doing): only the first backs off."""
    busy, starved = QueueDelayLimit(CONFIG), QueueDelayLimit(CONFIG)
    for k in range(8):
        busy.update(k * 0.05, 0.3, 20, busy_share=0.9)
        starved.update(k * 0.05, 0.3, 20, busy_share=0.1)
    assert busy.limit < CONFIG.initial
    assert starved.limit == CONFIG.initial


def test_a_stretch_starved_of_cpu_does_not_count_as_the_queue_standing() -> None:
    """Starved for 0.6 s (its neighbours' doing, above the target all along), then one busy
    measurement above the target: the queue has stood for this process only since then, not
    for the interval, so it neither backs off nor sheds."""
    limit = QueueDelayLimit(CONFIG)
    for k in range(12):
        limit.update(k * 0.05, 0.3, 20, busy_share=0.4)
    limit.update(0.6, 0.3, 20, busy_share=0.55)
    assert limit.limit == CONFIG.initial
    assert not limit.is_shedding


def test_probes_grpc_drops_unseen_count_as_a_standing_queue() -> None:
    """A probe grpc dropped (the queue past --max-pending-calls) comes back at once; counted
    as its own short wait it would read as no queue, and the limit would never back off."""
    limit = QueueDelayLimit(CONFIG)
    assert limit.dropped_probe_delay_s(0.001) == 2 * CONFIG.target_s
    limit.update(0.0, 0.3, 128)
    assert limit.dropped_probe_delay_s(0.001) == 0.3  # the queue last seen
    dropped = QueueDelayLimit(CONFIG)
    run(dropped, 0.0, [dropped.dropped_probe_delay_s(0.001)] * 8, in_flight=128)
    assert dropped.limit < CONFIG.initial


def test_a_raised_target_no_longer_backs_off_for_delays_below_it() -> None:
    """`retarget` (the SLO the door's target derives from changed): delays that stood above
    the old target but below the new one no longer back the limit off."""
    limit = QueueDelayLimit(CONFIG)
    limit.retarget(0.1)
    assert limit.config.target_s == 0.1
    run(limit, 0.0, [0.05] * 20, in_flight=128)
    assert limit.limit >= CONFIG.initial and not limit.is_standing
    limit.retarget(0.025)
    run(limit, 1.0, [0.05] * 20, in_flight=128)
    assert limit.limit < CONFIG.initial and limit.is_standing


def test_the_door_target_derives_from_the_tightest_slo_unless_set() -> None:
    derived = DoorConfig()
    assert derived.target_for(0.25) == pytest.approx(0.0625)  # a quarter of the SLO
    assert derived.target_for(None) == LimitConfig.target_s  # no guarded model known
    assert DoorConfig(target_slo_share=0.1).target_for(2.0) == pytest.approx(0.2)
    assert DoorConfig(target_s=0.04).target_for(0.25) == 0.04  # set: the SLO does not matter
    # Within the interval (a longer target would judge a queue over less than itself) and a
    # few ms (the loop's own jitter).
    assert derived.target_for(30.0) == derived.interval_s
    assert derived.target_for(0.004) == MIN_DERIVED_TARGET_S
    unusable_settings = (
        {"target_s": -0.01}, {"target_s": math.nan}, {"target_slo_share": 0.0},
        {"target_slo_share": 1.5},
    )  # fmt: skip
    for unusable in unusable_settings:
        with pytest.raises(ValueError):
            DoorConfig(**unusable)  # type: ignore[arg-type]


def test_a_backed_off_limit_recovers_while_the_process_waits_for_cpu() -> None:
    """A flood backed the limit off to its minimum; once it ends, the neighbours on the same
    cores drain their backlog, and this process's probe waits for a core, not for its calls
    (a tenth of a core used, nothing in flight): the unused limit returns to `initial`, ready
    for the next burst, instead of holding it at the minimum while they drain."""
    limit = QueueDelayLimit(CONFIG)
    now_s = 0.0
    for _ in range(40):  # the flood: a standing queue of the process's own calls
        limit.update(now_s, 0.3, 200, busy_share=0.9)
        now_s += PROBE_S
    assert limit.limit == CONFIG.minimum
    for _ in range(20):
        limit.update(now_s, 0.3, 0, busy_share=0.1)
        now_s += PROBE_S
    assert limit.limit == CONFIG.initial
    # In use at its limit while starved, it is left where it is (neither backed off nor grown).
    used = QueueDelayLimit(CONFIG)
    now_s = 0.0
    for _ in range(40):
        used.update(now_s, 0.3, 200, busy_share=0.9)
        now_s += PROBE_S
    for _ in range(20):
        used.update(now_s, 0.3, CONFIG.minimum, busy_share=0.1)
        now_s += PROBE_S
    assert used.limit == CONFIG.minimum
