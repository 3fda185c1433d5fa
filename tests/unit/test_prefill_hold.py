"""The prefill hold: prompts wait, while sequences decode, for at most the extra cost of one
step with a prompt since the last such step."""

from __future__ import annotations

import pytest

from services.gpu_worker.generation.prefill_hold import PrefillHold

pytestmark = pytest.mark.unit


def test_prompts_are_admitted_at_once_until_both_step_costs_are_known() -> None:
    hold = PrefillHold()
    assert hold.admits(0.0, num_running=4)
    hold.record(has_prompt=True, seconds=0.003, end_s=1.0)
    assert hold.hold_s == 0.0 and hold.admits(1.0, num_running=4)


def test_after_a_step_with_a_prompt_the_next_waits_its_extra_cost() -> None:
    hold = PrefillHold()
    hold.record(has_prompt=False, seconds=0.0005, end_s=0.5)
    hold.record(has_prompt=True, seconds=0.0030, end_s=1.0)
    assert hold.hold_s == pytest.approx(0.0025)
    assert not hold.admits(1.0, num_running=4)
    assert not hold.admits(1.002, num_running=4)
    assert hold.admits(1.003, num_running=4)
    # Nothing decoding: nothing to overlap, the prompt goes in at once.
    assert hold.admits(1.001, num_running=0)


def test_step_costs_are_moving_averages_and_equal_costs_hold_nothing() -> None:
    hold = PrefillHold()
    hold.record(has_prompt=False, seconds=0.002, end_s=0.1)
    hold.record(has_prompt=True, seconds=0.002, end_s=0.2)
    assert hold.hold_s == 0.0 and hold.admits(0.2, num_running=8)
    hold.record(has_prompt=True, seconds=0.012, end_s=0.3)
    assert hold.mixed_s == pytest.approx(0.003)  # 0.002 + 0.1 * (0.012 - 0.002)
    assert hold.hold_s == pytest.approx(0.001)
    # A decode step costlier than a mixed one never makes the hold negative.
    hold.record(has_prompt=False, seconds=0.05, end_s=0.4)
    assert hold.hold_s == 0.0
