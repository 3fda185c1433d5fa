"""LatencyModel: the measured curve (interpolation, extrapolation, fallbacks, monotonicity),
the learned scale (outliers, slowdowns, recovery) and the spread predictions add to it."""

from __future__ import annotations

import pytest

from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.latency_model import MIN_PREDICTION_S, LatencyModel
from services.gpu_worker.batching.types import BatchKey

pytestmark = pytest.mark.unit


def make_key(
    *, model: str = "m", version: str = "1", fingerprint: str = "f", bucket: int = 32
) -> BatchKey:
    return BatchKey(model=model, version=version, fingerprint=fingerprint, bucket=bucket)


def make_model(
    seconds_by_size: dict[int, float] | None = None,
    *,
    key: BatchKey | None = None,
    slowdown_alpha: float = 0.0,
    default_s: float = 0.01,
) -> LatencyModel:
    """A model whose curve is `seconds_by_size` (measured in ascending order, as warm-up
    does); the scale is not learned unless asked for, so curve tests see the curve alone."""
    model = LatencyModel(slowdown_alpha=slowdown_alpha, default_s=default_s)
    for size, seconds in sorted((seconds_by_size or {}).items()):
        model.observe(key or make_key(), size, seconds)
    return model


def test_unknown_family_predicts_default() -> None:
    model = make_model({8: 0.5}, key=make_key(model="other"), default_s=0.007)

    assert model.predict(make_key(), 1) == 0.007
    assert model.predict(make_key(), 64) == 0.007


def test_first_observation_sets_the_curve_then_batches_scale_it() -> None:
    model = make_model(slowdown_alpha=0.5)
    key = make_key()

    model.observe(key, 4, 0.010)
    assert model.predict(key, 4) == pytest.approx(0.010)

    model.observe(key, 4, 0.020)
    assert model.predict(key, 4) == pytest.approx(0.015)
    assert model.predict(key, 8) == pytest.approx(0.030)  # the whole curve, scaled

    model.observe(key, 4, 0.010)
    assert model.predict(key, 4) == pytest.approx(0.0125)


def test_observations_are_per_key_and_size() -> None:
    model = make_model({4: 0.010})
    model.observe(make_key(bucket=64), 4, 0.100)
    model.observe(make_key(), 8, 0.020)

    assert model.predict(make_key(), 4) == pytest.approx(0.010)
    assert model.predict(make_key(bucket=64), 4) == pytest.approx(0.100)


def test_interpolates_linearly_between_known_sizes() -> None:
    model = make_model({4: 0.010, 8: 0.018})

    assert model.predict(make_key(), 6) == pytest.approx(0.014)
    assert model.predict(make_key(), 7) == pytest.approx(0.016)


def test_extrapolates_above_largest_from_two_largest_points() -> None:
    model = make_model({1: 0.001, 4: 0.010, 8: 0.018})

    assert model.predict(make_key(), 16) == pytest.approx(0.018 + 0.002 * 8)


def test_extrapolates_proportionally_from_a_single_point() -> None:
    model = make_model({8: 0.016})

    assert model.predict(make_key(), 16) == pytest.approx(0.032)
    assert model.predict(make_key(), 12) == pytest.approx(0.024)


def test_below_single_point_assumes_fixed_cost() -> None:
    model = make_model({8: 0.016})

    assert model.predict(make_key(), 1) == pytest.approx(0.016)


def test_below_smallest_interpolates_from_the_intercept() -> None:
    # Line through (4, 0.010) and (8, 0.014) meets size 0 at 0.006.
    model = make_model({4: 0.010, 8: 0.014})

    assert model.predict(make_key(), 2) == pytest.approx(0.008)
    assert model.predict(make_key(), 1) == pytest.approx(0.007)


def test_negative_intercept_is_clamped_and_prediction_stays_positive() -> None:
    # Line through (2, 0.001) and (4, 0.010) would cross zero at a positive size.
    model = make_model({2: 0.001, 4: 0.010})

    assert model.predict(make_key(), 1) == pytest.approx(0.0005)

    zero = make_model({4: 0.0, 8: 0.0})
    assert zero.predict(make_key(), 1) >= MIN_PREDICTION_S > 0
    assert zero.per_item_s(make_key(), 8) > 0


def test_monotone_in_batch_size_with_sensible_data() -> None:
    model = make_model({1: 0.004, 2: 0.005, 8: 0.009, 32: 0.030})
    predictions = [model.predict(make_key(), n) for n in range(1, 129)]

    assert predictions == sorted(predictions)
    assert predictions[-1] > predictions[0]


def test_monotone_even_when_noise_makes_a_bigger_batch_look_cheaper() -> None:
    model = make_model({4: 0.020, 8: 0.015, 16: 0.030})
    predictions = [model.predict(make_key(), n) for n in range(1, 65)]

    assert predictions == sorted(predictions)
    assert model.predict(make_key(), 8) >= model.predict(make_key(), 4)


def test_unknown_bucket_uses_nearest_bucket_scaled_by_ratio() -> None:
    model = make_model({1: 0.004, 8: 0.010}, key=make_key(bucket=32))
    model.observe(make_key(bucket=256), 8, 1.0)

    assert model.predict(make_key(bucket=64), 8) == pytest.approx(0.020)
    assert model.predict(make_key(bucket=16), 8) == pytest.approx(0.005)
    assert model.predict(make_key(bucket=16), 4) == pytest.approx(
        model.predict(make_key(bucket=32), 4) / 2
    )


def test_unknown_bucket_tie_takes_the_larger_bucket() -> None:
    model = make_model({8: 0.010}, key=make_key(bucket=32))
    model.observe(make_key(bucket=96), 8, 0.060)

    # 64 is 32 away from both; the 96 curve scaled by 64/96 gives 0.040, the 32 curve 0.020.
    assert model.predict(make_key(bucket=64), 8) == pytest.approx(0.040)


@pytest.mark.parametrize(
    "other",
    [make_key(version="2"), make_key(fingerprint="g"), make_key(model="n")],
    ids=["version", "fingerprint", "model"],
)
def test_bucket_fallback_never_crosses_model_version_or_fingerprint(other: BatchKey) -> None:
    model = make_model({8: 0.5}, key=make_key(bucket=64), default_s=0.003)

    assert model.predict(BatchKey(other.model, other.version, other.fingerprint, 32), 8) == 0.003


def test_per_item_s_divides_by_batch_size() -> None:
    model = make_model({1: 0.004, 8: 0.016})

    assert model.per_item_s(make_key(), 8) == pytest.approx(0.002)
    assert model.per_item_s(make_key(), 1) == pytest.approx(0.004)


def test_known_keys_and_sizes() -> None:
    model = make_model({8: 0.01, 2: 0.005}, key=make_key(bucket=64))
    model.observe(make_key(bucket=16), 1, 0.001)

    assert model.known_keys() == (make_key(bucket=16), make_key(bucket=64))
    assert model.known_sizes(make_key(bucket=64)) == (2, 8)
    assert model.known_sizes(make_key(bucket=128)) == ()


@pytest.mark.parametrize(
    ("batch_size", "seconds"), [(0, 0.01), (4, -0.01), (4, float("nan")), (4, float("inf"))]
)
def test_observe_rejects_invalid_input(batch_size: int, seconds: float) -> None:
    with pytest.raises(ValueError):
        make_model().observe(make_key(), batch_size, seconds)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slowdown_alpha": 1.5},
        {"default_s": 0.0},
        {"slowdown_alpha": -0.1},
        {"max_ratio": 0.5},
        {"max_ratio": float("inf")},
        {"spread_weight": -1.0},
        {"spread_weight": float("nan")},
        {"spread_alpha": 1.5},
    ],
)
def test_constructor_rejects_invalid_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LatencyModel(**kwargs)


def test_predict_rejects_non_positive_batch_size() -> None:
    with pytest.raises(ValueError):
        make_model({4: 0.01}).predict(make_key(), 0)


# Recovery from outliers and slowdowns -----------------------------------------------------------


def test_one_outlier_moves_the_scale_by_a_bounded_step_and_fades() -> None:
    model = make_model({1: 0.010, 4: 0.010}, slowdown_alpha=0.2)
    key = make_key()

    model.observe(key, 4, 5.0)  # a 500x stall, counted as 2x
    assert model.predict(key, 4) == pytest.approx(0.010 * 1.2)
    for _ in range(10):
        model.observe(key, 4, 0.010)
    assert model.predict(key, 4) == pytest.approx(0.010, rel=0.05)


def test_fast_batches_bring_an_over_estimate_down() -> None:
    model = make_model({1: 0.5, 4: 1.0}, slowdown_alpha=0.5)

    for _ in range(4):
        model.observe(make_key(), 4, 0.010)  # far faster than measured: counted as 1/2
    assert model.predict(make_key(), 4) < 0.6


def test_slowdown_reaches_shapes_that_did_not_run() -> None:
    model = make_model({1: 0.010, 8: 0.040, 16: 0.080}, slowdown_alpha=0.3)
    key = make_key()

    for _ in range(6):
        model.observe(key, 8, 0.120)  # everything runs 3x slower now (contention)
    # Size 16 never ran slow, but it is predicted slower too.
    assert model.slowdown(key) > 1.8
    assert model.predict(key, 16) > 1.8 * 0.080
    # Another bucket of the same family, with no batches of its own, shares the family scale.
    assert model.predict(make_key(bucket=64), 1) > 1.8 * 0.010 * 2


def test_a_slowdown_past_max_ratio_is_learned_whole() -> None:
    # A small CPU model beside a flooded gateway ran 2.3x its warm-up: a scale bounded by
    # max_ratio itself (2) would predict its batches short for as long as the flood lasts, and
    # the worker would admit and size batches that end past the SLO.
    model = make_model({1: 0.010, 8: 0.040}, slowdown_alpha=0.2)
    key = make_key()
    for _ in range(30):
        model.observe(key, 8, 0.160)  # 4x

    assert model.slowdown(key) == pytest.approx(4.0, rel=0.02)
    assert model.predict(key, 8) == pytest.approx(0.160, rel=0.02)
    assert model.family_slowdown(key) == pytest.approx(4.0, rel=0.02)


def test_a_row_alone_is_predicted_at_most_max_ratio_slower_than_its_curve() -> None:
    # What refuses or drops a lone row unrun: were it the whole learned scale, a stall could
    # make every lone row look too slow for its deadline, and no batch would run to correct it.
    model = make_model({1: 0.010, 8: 0.040}, slowdown_alpha=0.5)
    key = make_key()
    model.observe(key, 1, 0.015)
    assert model.predict_alone(key) == pytest.approx(model.predict(key, 1))  # 1.25x: as is
    for _ in range(40):
        model.observe(key, 8, 4.0)  # a 100x stall

    assert model.slowdown(key) == pytest.approx(100.0, rel=0.01)
    assert model.predict(key, 1) == pytest.approx(1.0, rel=0.01)
    assert model.predict_alone(key) == pytest.approx(0.020)
    # A bucket read through a sibling's curve is bounded alike.
    assert model.predict_alone(make_key(bucket=64)) == pytest.approx(0.020 * 64 / 32)


def test_each_step_is_bounded_relative_to_the_scale() -> None:
    model = make_model({1: 0.010, 4: 0.010}, slowdown_alpha=0.2)
    key = make_key()
    for _ in range(30):
        model.observe(key, 4, 0.030)  # a lasting 3x
    before = model.slowdown(key)

    model.observe(key, 4, 5.0)  # then a 500x stall: counted as 2x the scale
    assert model.slowdown(key) == pytest.approx(before * 1.2)
    model.observe(key, 4, 1e-6)  # and a batch that took nothing: half the scale
    assert model.slowdown(key) == pytest.approx(before * 1.2 * (1 - 0.2 * (1 - 1 / 2)))


def test_slowdown_returns_to_one_when_the_machine_recovers() -> None:
    model = make_model({1: 0.010, 8: 0.040}, slowdown_alpha=0.3)
    key = make_key()
    for _ in range(6):
        model.observe(key, 8, 0.120)
    for _ in range(20):
        model.observe(key, 8, 0.040)

    assert model.slowdown(key) == pytest.approx(1.0, abs=0.01)
    assert model.predict(key, 8) == pytest.approx(0.040, rel=0.01)


def test_a_shape_seen_only_under_overload_does_not_stay_inflated() -> None:
    # The batch-size cap follows predictions: if a slow spell could rewrite the curve at the
    # sizes it happened to run, bigger batches would look too slow to form, and never run
    # again to correct it.
    model = make_model({1: 0.010, 2: 0.015, 4: 0.025, 8: 0.045}, slowdown_alpha=0.2)
    key = make_key()
    for _ in range(50):
        model.observe(key, 2, 0.060)  # a flood: tiny batches, each 4x slower
    for _ in range(30):
        model.observe(key, 1, 0.010)  # after it: only singles run, at their normal speed

    assert model.predict(key, 8) == pytest.approx(0.045, rel=0.05)


def test_sizes_beyond_the_curve_record_shape_not_contention() -> None:
    model = make_model({1: 0.010, 4: 0.020}, slowdown_alpha=1.0)
    key = make_key()
    model.observe(key, 4, 0.040)  # scale 2 now

    model.observe(key, 8, 0.080)  # a new, bigger size, measured under that scale
    assert model.known_sizes(key) == (1, 4, 8)
    model.observe(key, 4, 0.020)  # the machine is back to normal
    assert model.predict(key, 8) == pytest.approx(0.040)


def test_seeding_new_sizes_is_not_a_slowdown() -> None:
    model = make_model(slowdown_alpha=0.3)
    key = make_key()
    # Warm-up order: each size beyond the measured ones is a new point, not a re-observation.
    for size, seconds in ((1, 0.010), (2, 0.030), (4, 0.090), (8, 0.300)):
        model.observe(key, size, seconds)

    assert model.slowdown(key) == 1.0


def spread_model(weight: float) -> tuple[LatencyModel, BatchKey]:
    model = LatencyModel(slowdown_alpha=0.2, spread_weight=weight, spread_alpha=0.25)
    key = make_key()
    model.observe(key, 4, 0.010)  # the curve
    return model, key


def test_steady_batches_carry_no_margin() -> None:
    model, key = spread_model(2.0)
    for _ in range(20):
        model.observe(key, 4, 0.010)

    assert model.predict(key, 4) == pytest.approx(0.010)


def test_batches_that_spread_are_predicted_by_their_slow_end() -> None:
    """Alternating 10 and 20 ms: the scale settles near the middle, and the prediction adds
    two spreads of it (about 5 ms each), so it lands past the slow end, not in the middle."""
    margined, key = spread_model(2.0)
    plain, _ = spread_model(0.0)
    for seconds in [0.010, 0.020] * 20:
        margined.observe(key, 4, seconds)
        plain.observe(key, 4, seconds)

    middle = plain.predict(key, 4)
    assert 0.013 < middle < 0.017
    assert margined.predict(key, 4) > middle + 0.008  # two spreads of about 5 ms
    assert margined.slowdown(key) == pytest.approx(plain.slowdown(key))  # the scale alone


def test_a_budget_share_trades_the_models_spreads_for_others() -> None:
    """Predictions at two spreads that fit a budget times the share for four fit the whole
    budget at four; with no spread, or the model's own weight, the share is the whole."""
    model, key = spread_model(2.0)
    four, _ = spread_model(4.0)
    assert model.budget_share(key, 4.0) == 1.0  # no spread learned yet
    for seconds in [0.010, 0.020] * 20:
        model.observe(key, 4, seconds)
        four.observe(key, 4, seconds)

    share = model.budget_share(key, 4.0)
    assert 0.6 < share < 0.9
    assert model.predict(key, 4) / share == pytest.approx(four.predict(key, 4))
    assert model.budget_share(key, 2.0) == 1.0
    assert model.budget_share(key, 0.0) > 1.0  # fewer spreads: more of the budget


def test_four_spreads_against_two_cut_at_most_half_a_budget() -> None:
    """However wide the spread (batches 1x and 4x the curve in turn), the share stays above
    own weight / weight."""
    model, key = spread_model(2.0)
    for seconds in [0.010, 0.040] * 30:
        model.observe(key, 4, seconds)

    assert model.spread(key) > 0.4 * model.slowdown(key)
    assert 0.5 < model.budget_share(key, 4.0) < 0.7


def test_the_margin_fades_once_batches_run_steady_again() -> None:
    model, key = spread_model(2.0)
    for seconds in [0.010, 0.030] * 10:
        model.observe(key, 4, seconds)
    spread_out = model.predict(key, 4)
    for _ in range(40):
        model.observe(key, 4, 0.010)

    assert spread_out > 0.025
    assert model.predict(key, 4) == pytest.approx(0.010, rel=0.02)


def test_a_key_without_batches_takes_its_familys_spread() -> None:
    model, key = spread_model(2.0)
    for seconds in [0.010, 0.020] * 20:
        model.observe(key, 4, seconds)
    sibling = make_key(bucket=64)  # no batches: the nearest bucket's curve, the family's scale

    scaled_curve = 0.010 * 64 / 32 * model.family_slowdown(sibling)
    assert model.predict(sibling, 4) > scaled_curve + 0.008 * 64 / 32


def test_a_row_alone_is_bounded_margin_included() -> None:
    """The floor (predict_bounded) stays within max_ratio of the curve whatever the spread: a
    refused row leaves no batch to shrink it."""
    model, key = spread_model(2.0)
    for seconds in [0.010, 0.019] * 20:  # a scale under max_ratio, a margin past it
        model.observe(key, 4, seconds)

    assert model.predict(key, 4) > 2.0 * 0.010
    assert model.predict_bounded(key, 4) == pytest.approx(2.0 * 0.010)


def test_curve_points_teach_neither_scale_nor_spread() -> None:
    """A batch size beyond the curve becomes a point of it (shape, not contention): the
    spread learned so far stays as it was."""
    model, key = spread_model(2.0)
    for seconds in [0.010, 0.020] * 20:
        model.observe(key, 4, seconds)
    before = (model.slowdown(key), model.spread(key), model.predict(key, 4))

    model.observe(key, 8, 0.050)

    assert (model.slowdown(key), model.spread(key), model.predict(key, 4)) == before


def test_a_key_with_steady_batches_keeps_its_own_narrow_spread() -> None:
    """Spreads are per key: a bucket whose batches run steady carries no margin beside one
    whose batches spread, while a bucket without batches takes the family's."""
    model, spread_key = spread_model(2.0)
    steady_key = make_key(bucket=16)
    model.observe(steady_key, 4, 0.005)  # its curve
    for seconds in [0.010, 0.020] * 20:
        model.observe(spread_key, 4, seconds)
        model.observe(steady_key, 4, 0.005 * model.slowdown(steady_key))

    assert model.spread(steady_key) < 0.01
    assert model.spread(spread_key) > 0.3
    assert model.spread(make_key(bucket=64)) > 0.1  # the family's, both keys' batches


@pytest.mark.parametrize("spreads", [-1.0, float("inf"), float("nan")])
@pytest.mark.parametrize("setting", ["prediction_spreads", "slo_prediction_spreads"])
def test_the_workers_setting_refuses_spreads_that_are_no_margin(
    setting: str, spreads: float
) -> None:
    with pytest.raises(ValueError, match=f"^{setting}"):
        DriverConfig(**{setting: spreads})
