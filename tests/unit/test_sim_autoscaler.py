"""The HPA's rule as the simulator restates it: tolerance, scale-up policies, the scale-down
stabilisation window (Kubernetes autoscaling/v2 defaults)."""

from __future__ import annotations

import pytest

from services.sim.autoscaler import HorizontalAutoscaler, HpaConfig

pytestmark = pytest.mark.unit


def make_hpa(**overrides: object) -> HorizontalAutoscaler:
    fields: dict[str, object] = {"target": 0.02, "min_replicas": 1, "max_replicas": 100}
    fields.update(overrides)
    return HorizontalAutoscaler(HpaConfig(**fields))  # type: ignore[arg-type]


def test_within_tolerance_the_count_stays() -> None:
    hpa = make_hpa()
    assert hpa.desired(0.0, current=10, ready=10, metric=0.0219) == 10
    assert hpa.desired(15.0, current=10, ready=10, metric=0.0181) == 10


def test_desired_is_ready_times_metric_over_target_rounded_up() -> None:
    assert make_hpa().desired(0.0, current=4, ready=4, metric=0.03) == 6


def test_scale_up_is_bounded_by_max_of_four_pods_and_doubling_per_period() -> None:
    hpa = make_hpa()
    assert hpa.desired(0.0, current=2, ready=2, metric=1.0) == 6  # +4 pods beats +100%
    assert hpa.desired(5.0, current=6, ready=6, metric=1.0) == 6  # this period's budget spent
    assert hpa.desired(15.0, current=6, ready=6, metric=1.0) == 12  # +100% beats +4 pods


def test_scale_down_waits_for_the_stabilisation_window() -> None:
    hpa = make_hpa()
    assert hpa.desired(0.0, current=10, ready=10, metric=0.02) == 10
    for time_s in range(15, 300, 15):
        assert hpa.desired(float(time_s), current=10, ready=10, metric=0.002) == 10
    # 300 s after the last recommendation of 10, the highest left in the window is 1.
    assert hpa.desired(315.0, current=10, ready=10, metric=0.002) == 1


def test_the_count_stays_within_min_and_max_replicas() -> None:
    hpa = make_hpa(min_replicas=2, max_replicas=5, scale_down_window_s=0.0)
    assert hpa.desired(0.0, current=4, ready=4, metric=1.0) == 5
    assert hpa.desired(15.0, current=5, ready=5, metric=0.0001) == 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown HPA metric"):
        HpaConfig(target=1.0, metric="memory")
    with pytest.raises(ValueError, match="target"):
        HpaConfig(target=0.0)
