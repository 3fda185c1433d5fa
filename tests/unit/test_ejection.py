"""TimeoutEjector: workers whose calls only time out leave routing, are probed, and return.

Unless a test says otherwise: 3 timeouts eject, for 10 s doubling up to 40 s; every timeout
waited 1 s for a call predicted at 0.01 s (it counts).
"""

from __future__ import annotations

from typing import Any

import pytest

from services.router.ejection import TimeoutEjectionConfig, TimeoutEjector

pytestmark = pytest.mark.unit


def make_ejector(**config: Any) -> TimeoutEjector:
    settings = {"timeouts_to_eject": 3, "eject_s": 10.0, "max_eject_s": 40.0, **config}
    return TimeoutEjector(TimeoutEjectionConfig(**settings))


def time_out(
    ejector: TimeoutEjector,
    now_s: float,
    *,
    worker_id: str = "w1",
    times: int = 1,
    waited_s: float = 1.0,
    predicted_s: float = 0.01,
) -> float | None:
    """`times` timeouts of calls to `worker_id` at `now_s`; the last one's answer."""
    period_s = None
    for _ in range(times):
        period_s = ejector.record_timeout(
            worker_id, now_s, waited_s=waited_s, predicted_s=predicted_s
        )
    return period_s


def test_consecutive_timeouts_eject_for_the_period_then_one_probe_goes() -> None:
    ejector = make_ejector()
    assert time_out(ejector, 1.0, times=2) is None
    assert ejector.may_route("w1", 1.0)
    assert time_out(ejector, 1.0) == 10.0
    assert not ejector.may_route("w1", 1.0)
    assert not ejector.may_route("w1", 10.9)
    assert ejector.may_route("w2", 1.0)  # others unaffected
    assert ejector.may_route("w1", 11.0)
    ejector.on_routed("w1", 11.0)  # the probe
    assert not ejector.may_route("w1", 11.0), "one probe at a time"
    ejector.record_success("w1", 11.2)
    assert ejector.may_route("w1", 11.2)


def test_a_success_between_timeouts_resets_the_streak() -> None:
    ejector = make_ejector()
    time_out(ejector, 1.0, times=2)
    ejector.record_success("w1", 1.5)
    # Past the 2 s of silence: the streak starts again from 0, so 2 more do not eject.
    assert time_out(ejector, 4.0, times=2) is None
    assert ejector.may_route("w1", 4.0)
    assert time_out(ejector, 4.0) == 10.0


def test_an_overloaded_worker_that_keeps_answering_is_never_ejected() -> None:
    # Overload: most calls time out in their callers' tight deadlines, but the worker answers
    # some every second. Timeouts within 2 s of an answer do not count.
    ejector = make_ejector()
    for step in range(100):
        now_s = step * 0.1
        if step % 10 == 0:
            ejector.record_success("w1", now_s)
        assert time_out(ejector, now_s, times=5) is None
        assert ejector.may_route("w1", now_s)
    # Once it goes silent for the full 2 s, its timeouts count again.
    assert time_out(ejector, 9.9 + 2.0, times=3) == 10.0


def test_a_probe_that_times_out_ejects_again_for_twice_as_long_up_to_the_bound() -> None:
    ejector = make_ejector()
    now_s = 0.0
    periods = []
    for _ in range(4):
        # The probe, routed at now_s, times out after its 1 s.
        now_s += 1.0 if periods else 0.0
        period_s = time_out(ejector, now_s, times=3 if not periods else 1)
        assert period_s is not None
        periods.append(period_s)
        now_s += period_s
        assert ejector.may_route("w1", now_s)
        ejector.on_routed("w1", now_s)
    assert periods == [10.0, 20.0, 40.0, 40.0]


def test_a_late_timeout_of_a_call_sent_before_probation_is_not_the_probes() -> None:
    """Calls sent before the ejection with long deadlines time out after its period: each was
    taken for the probe's timeout and ejected the worker again, for twice as long, and the
    probe's own success, sent before that new ejection, was then ignored."""
    ejector = make_ejector(timeouts_to_eject=1)
    assert time_out(ejector, 0.0) == 10.0
    ejector.on_routed("w1", 10.0)  # the probe
    assert time_out(ejector, 10.2, waited_s=15.0) is None  # sent at -4.8
    ejector.record_success("w1", 10.5, sent_s=10.0)
    assert ejector.may_route("w1", 10.6)


def test_a_probe_that_never_answers_frees_its_slot_after_the_first_period() -> None:
    ejector = make_ejector()
    time_out(ejector, 0.0, times=3)
    ejector.on_routed("w1", 10.0)
    assert not ejector.may_route("w1", 19.9)
    assert ejector.may_route("w1", 20.0)


def test_timeouts_of_calls_sent_before_the_ejection_neither_extend_nor_end_it() -> None:
    ejector = make_ejector()
    time_out(ejector, 0.0, times=3)
    assert time_out(ejector, 5.0, times=5) is None
    ejector.record_success("w1", 6.0)  # a late answer to an old call
    assert not ejector.may_route("w1", 9.9)
    assert ejector.may_route("w1", 10.0)


def test_repeats_start_over_once_the_worker_has_answered_for_max_eject_s() -> None:
    ejector = make_ejector()
    time_out(ejector, 0.0, times=3)  # ejected until 10
    ejector.on_routed("w1", 10.0)
    ejector.record_success("w1", 10.1)
    ejector.record_success("w1", 30.0)  # 20 s after: still a repeat
    assert time_out(ejector, 32.5, times=3) == 20.0  # after 2 s of silence; ejected until 52.5
    ejector.on_routed("w1", 52.5)
    ejector.record_success("w1", 52.6)
    ejector.record_success("w1", 92.5)  # 40 s after the last ejection ended: forgotten
    assert time_out(ejector, 95.0, times=3) == 10.0


def test_a_call_cut_short_by_its_callers_tight_deadline_does_not_count() -> None:
    ejector = make_ejector()
    # Predicted 0.1 s, waited 0.2 s: the caller's deadline, not the worker, was short.
    assert time_out(ejector, 1.0, times=10, waited_s=0.2, predicted_s=0.1) is None
    assert ejector.may_route("w1", 1.0)
    assert time_out(ejector, 1.0, times=3, waited_s=0.4, predicted_s=0.1) == 10.0


def test_zero_timeouts_to_eject_never_ejects() -> None:
    ejector = make_ejector(timeouts_to_eject=0)
    assert time_out(ejector, 1.0, times=100) is None
    assert ejector.may_route("w1", 1.0)


@pytest.mark.parametrize(
    "config",
    [
        {"timeouts_to_eject": -1},
        {"eject_s": 0.0},
        {"eject_s": 50.0, "max_eject_s": 40.0},
        {"min_wait_factor": -1.0},
    ],
)
def test_bad_settings_are_refused(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        make_ejector(**config)


def test_an_answer_to_a_call_sent_while_ejected_restores_the_worker_at_once() -> None:
    """Routed there anyway (the last worker of its model: services.router.routing), its
    answers are news; an answer to a call sent before the ejection is not."""
    ejector = make_ejector()
    assert time_out(ejector, 1.0, times=3) == 10.0
    ejector.record_success("w1", 2.0, sent_s=0.5)  # sent before the ejection
    assert ejector.is_ejected("w1", 2.0)
    ejector.record_success("w1", 3.0, sent_s=2.5)  # sent while ejected
    assert not ejector.is_ejected("w1", 3.0)
    assert ejector.may_route("w1", 3.0)
    # A repeat within max_eject_s still doubles: the restoration ended the period early.
    ejector.record_success("w1", 3.0)
    assert time_out(ejector, 6.0, times=3) == 20.0


def test_a_worker_ejected_again_and_again_keeps_the_longest_period() -> None:
    """A worker that answers nothing for days, each probe timing out: its period stays at
    max_eject_s. Before, the 1,025th ejection's doubling (2**1,024) overflowed a float and the
    probe's timeout raised."""
    ejector = make_ejector()
    now_s, periods = 1.0, [time_out(ejector, 1.0, times=3)]
    for _ in range(1_100):
        now_s += periods[-1] or 0.0
        assert ejector.may_route("w1", now_s)
        ejector.on_routed("w1", now_s)  # the probe, which times out a second later
        now_s += 1.0
        periods.append(time_out(ejector, now_s, waited_s=1.0))
    assert periods[:3] == [10.0, 20.0, 40.0] and set(periods[3:]) == {40.0}
