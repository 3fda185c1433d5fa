"""Checks on the capacity planner's answers shared by the simulator's tests."""

from __future__ import annotations

from services.sim.planner import Plan


def assert_fewest_meeting(answer: Plan) -> int:
    """The plan found a worker count whose simulated run meets the SLO while one fewer does
    not; returns that count."""
    assert answer.workers is not None, answer
    by_count = {trial.workers: trial for trial in answer.trials}
    assert by_count[answer.workers].meets
    if answer.workers > 1:
        assert not by_count[answer.workers - 1].meets
    return answer.workers
