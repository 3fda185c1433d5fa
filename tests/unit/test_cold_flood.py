"""bench.cold_flood's schedule and per-phase summary (the benchmark itself runs a stack)."""

from __future__ import annotations

import pytest

from bench.cold_flood import BURST, schedule, summary
from bench.fabric.loadgen import OK, Outcome

pytestmark = pytest.mark.unit


def test_the_phases_follow_one_another_with_the_bursts_at_their_starts() -> None:
    phases = schedule(flood_per_s=160.0, flood_s=8.0, seed=7)
    names = [name for name, _ in phases]
    assert names == ["cold_burst", "normal", "warm_burst", "before_flood", "flood", "after_flood"]
    offsets = dict(phases)
    assert offsets["cold_burst"] == [0.0] * BURST and offsets["warm_burst"] == [4.0] * BURST
    spans = {"normal": (0.0, 4.0), "before_flood": (4.0, 6.0), "flood": (6.0, 14.0),
             "after_flood": (14.0, 17.0)}  # fmt: skip
    for name, (start_s, end_s) in spans.items():
        sent = offsets[name]
        assert sent == sorted(sent) and start_s < sent[0] and sent[-1] < end_s, name
    # Poisson at 160/s for 8 s: 1,280 expected, well within five standard deviations.
    assert abs(len(offsets["flood"]) - 1280) < 5 * 1280**0.5
    assert schedule(160.0, 8.0, seed=7) == phases


def test_a_phase_counts_answers_within_the_slo_and_every_status() -> None:
    outcomes = [Outcome(0.0, 0.0, latency, status) for latency, status in
                [(0.1, OK), (0.25, OK), (0.4, OK), (0.01, "RESOURCE_EXHAUSTED")]]  # fmt: skip
    errors = ["RESOURCE_EXHAUSTED: minilm/1: predicted to finish 0.31s from now"]
    figures = summary(outcomes, errors, slo_s=0.25)
    assert (figures["calls"], figures["good"]) == (4, 2)
    assert figures["statuses"] == {OK: 3, "RESOURCE_EXHAUSTED": 1}
    assert figures["p50_ms"] == 250.0
    predicted = "RESOURCE_EXHAUSTED: minilm/N: predicted to finish Ns from now"
    assert figures["refused_by"] == {predicted: 1}
    assert summary([], [], slo_s=0.25) == {"calls": 0, "good": 0, "late": 0, "p50_ms": None,
                                            "p99_ms": None, "statuses": {},
                                            "refused_by": {}}  # fmt: skip


def test_a_late_send_is_counted_and_waits_in_its_latency() -> None:
    """A send the generator held back 0.5 s is counted late and waited as long as its caller
    would have: it was good from when it left (bench review)."""
    figures = summary([Outcome(0.0, 0.5, 0.01, OK), Outcome(0.1, 0.0, 0.01, OK)], [], 0.25)
    assert (figures["good"], figures["late"]) == (1, 1)
    assert summary([Outcome(0.0, 0.5, 0.01, OK)], [], 0.25)["p99_ms"] == 510.0


def test_refusals_are_counted_alike_whatever_their_figures() -> None:
    errors = [f"RESOURCE_EXHAUSTED: minilm/1: predicted to finish {s}s from now" for s in
              ("0.31", "1.2", "0.044")] + ["DEADLINE_EXCEEDED: Deadline Exceeded"]  # fmt: skip
    refused = summary([], errors, slo_s=0.25)["refused_by"]
    assert refused == {"RESOURCE_EXHAUSTED: minilm/N: predicted to finish Ns from now": 3,
                       "DEADLINE_EXCEEDED: Deadline Exceeded": 1}  # fmt: skip
