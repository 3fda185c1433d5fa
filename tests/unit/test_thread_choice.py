"""The torch thread-count choice: tries each option, prefers the cheapest per size, explores."""

from __future__ import annotations

import pytest

from services.gpu_worker.thread_choice import ThreadChoice, size_bucket, thread_options

pytestmark = pytest.mark.unit


def run_calls(
    choice: ThreadChoice, size: int, cost_s: dict[int, float], num_calls: int
) -> list[int]:
    """`num_calls` calls of `size`, each costing what `cost_s` says for its count."""
    chosen = []
    for _ in range(num_calls):
        threads = choice.choose(size)
        choice.record(size, threads, cost_s[threads])
        chosen.append(threads)
    return chosen


def test_the_options_are_one_all_but_one_and_all() -> None:
    assert thread_options(1) == (1,)
    assert thread_options(2) == (1, 2)
    assert thread_options(16) == (1, 15, 16)


def test_sizes_share_a_bucket_up_to_the_next_power_of_two() -> None:
    assert [size_bucket(n) for n in (0, 1, 2, 3, 4, 5, 17, 512)] == [1, 1, 2, 4, 4, 8, 32, 512]


def test_each_option_is_measured_before_one_is_preferred() -> None:
    choice = ThreadChoice((1, 2), min_samples=3)
    first = run_calls(choice, 8, {1: 0.001, 2: 0.005}, 6)
    assert sorted(first) == [1, 1, 1, 2, 2, 2]
    assert choice.best(8) == 1


def test_the_cheapest_option_wins_per_size_bucket() -> None:
    choice = ThreadChoice((1, 2), explore_every=1000)
    small = run_calls(choice, 4, {1: 0.001, 2: 0.002}, 40)
    large = run_calls(choice, 500, {1: 0.080, 2: 0.050}, 40)
    assert small[-30:] == [1] * 30
    assert large[-30:] == [2] * 30
    assert (choice.best(3), choice.best(300)) == (1, 2)


def test_every_nth_call_explores_the_stalest_other_option() -> None:
    choice = ThreadChoice((1, 15, 16), explore_every=8, min_samples=1)
    chosen = run_calls(choice, 64, {1: 0.010, 15: 0.004, 16: 0.005}, 3 + 64)[3:]
    explored = [t for t in chosen if t != 15]
    assert len(explored) == 64 // 8
    # Both others are tried, in turn.
    assert explored[:4] == [1, 16, 1, 16] or explored[:4] == [16, 1, 16, 1]


def test_the_choice_follows_a_change_in_cost() -> None:
    choice = ThreadChoice((1, 2), explore_every=4, smoothing=0.5)
    assert run_calls(choice, 16, {1: 0.002, 2: 0.004}, 40)[-8:].count(1) >= 6
    # The host got busier: the parallel regions now stall.
    later = run_calls(choice, 16, {1: 0.002, 2: 0.009}, 10) + run_calls(
        choice, 16, {1: 0.009, 2: 0.003}, 60
    )
    assert later[-8:].count(2) >= 6


def test_one_option_is_always_chosen_and_unknown_ones_are_ignored() -> None:
    choice = ThreadChoice((1,))
    choice.record(8, 2, 0.001)
    assert [choice.choose(8) for _ in range(5)] == [1] * 5
    assert choice.best(8) == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"options": ()}, {"options": (0, 2)}, {"options": (1, 2), "explore_every": 1},
     {"options": (1, 2), "smoothing": 0.0}, {"options": (1, 2), "min_samples": 0}],
)  # fmt: skip
def test_bad_settings_are_refused(kwargs: dict) -> None:
    options = kwargs.pop("options")
    with pytest.raises(ValueError):
        ThreadChoice(options, **kwargs)
