"""Heartbeats on the router's clock (services.router.registry_reader.HeartbeatClock): a score
read again ages on the router's clock, whatever Redis's clock does between reads."""

from __future__ import annotations

import pytest

from services.router.registry_reader import HeartbeatClock
from tests.unit.test_routing import make_worker

pytestmark = pytest.mark.unit

W0, W1 = make_worker(worker_id="w0"), make_worker(worker_id="w1")


def times(
    clock: HeartbeatClock, scores: dict[str, float], redis_now_s: float, now_s: float
) -> dict[str, float]:
    records = [(W0 if worker_id == "w0" else W1, s) for worker_id, s in scores.items()]
    return {r.worker_id: at_s for r, at_s in clock.on_our_clock(records, redis_now_s, now_s)}


def test_a_heartbeat_converts_by_its_age_at_the_first_read() -> None:
    clock = HeartbeatClock()
    assert times(clock, {"w0": 1000.0, "w1": 998.5}, 1001.0, 50.0) == {"w0": 49.0, "w1": 47.5}


def test_a_score_ahead_of_redis_is_now_and_then_ages_on_our_clock() -> None:
    """Written before Redis's clock stepped back 60 s: at the first read it is "now", and at
    later reads it keeps that time, so it goes stale like any other. Converted afresh, it
    stayed 60 s in our future."""
    clock = HeartbeatClock()
    assert times(clock, {"w0": 1060.0}, 1000.0, 50.0) == {"w0": 50.0}
    assert times(clock, {"w0": 1060.0}, 1004.0, 54.0) == {"w0": 50.0}


def test_redis_stepping_forward_ages_no_heartbeat_already_read() -> None:
    clock = HeartbeatClock()
    times(clock, {"w0": 1000.0}, 1000.5, 50.0)
    assert times(clock, {"w0": 1000.0}, 1100.7, 50.2) == {"w0": 49.5}


def test_a_new_score_converts_afresh_and_a_worker_gone_is_forgotten() -> None:
    clock = HeartbeatClock()
    times(clock, {"w0": 1060.0, "w1": 1000.0}, 1000.0, 50.0)
    # w0 beats again (its new score in Redis's stepped-back clock); w1 left the registry.
    assert times(clock, {"w0": 1001.0}, 1001.2, 51.2) == {"w0": pytest.approx(51.0)}
    # w1 back with the very score it had (our clock ran 7 s further than Redis's meanwhile):
    # converted afresh (57), not given its first read's time (50).
    assert times(clock, {"w1": 1000.0}, 1003.0, 60.0) == {"w1": 57.0}
