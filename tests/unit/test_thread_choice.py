"""The torch thread-count choice: tries each option, prefers the cheapest per size, explores."""

from __future__ import annotations

import itertools

import pytest

from services.gpu_worker.thread_choice import (
    MAX_BACKOFF,
    ThreadChoice,
    size_bucket,
    thread_options,
)

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


def test_each_option_is_measured_fewest_threads_first_before_one_is_preferred() -> None:
    choice = ThreadChoice((1, 2), min_samples=3)
    first = run_calls(choice, 8, {1: 0.002, 2: 0.003}, 6)
    assert first == [1, 1, 1, 2, 2, 2]
    assert choice.best(8) == 1


def test_an_option_costing_past_the_rule_out_ratio_is_not_sampled_again() -> None:
    choice = ThreadChoice((1, 2), min_samples=3, explore_every=4)
    fair = {1: 0.001, 2: 0.0015}
    assert run_calls(choice, 300, fair, 6) == [1, 1, 1, 2, 2, 2]  # within the ratio: in full
    # Beside a flood two threads cost 10x one: its first sample (the 4th call), a costly try,
    # holds every size's tries back until 4 calls later, which the other size's calls pass.
    flood = {1: 0.001, 2: 0.010}
    assert run_calls(choice, 8, flood, 4) == [1, 1, 1, 2]
    assert run_calls(choice, 300, fair, 4) == [1, 1, 1, 2]  # its 8th call's turn, once free
    # Two threads are not sampled again (calls 5 to 7); only the 8th call's turn tries them.
    assert run_calls(choice, 8, flood, 4) == [1, 1, 1, 2]
    assert choice.samples(8) == {1: 6, 2: 2}


def test_a_lane_never_idle_still_samples_and_explores_every_so_often() -> None:
    choice = ThreadChoice((1, 2), explore_every=4, min_samples=1)
    costs = {1: 0.002, 2: 0.0015}
    chosen = []
    for _ in range(12):  # rows always queued: no call may explore
        threads = choice.choose(64, may_explore=False)
        choice.record(64, threads, costs[threads])
        chosen.append(threads)
    # The first call samples what it must; two threads' sample waits min_samples (1) call,
    # then is taken (the 3rd); the 4th call's turn waits explore_every (4) calls, taken by
    # the 8th.
    assert chosen == [1, 1, 2, 2, 2, 2, 2, 1, 2, 2, 2, 2]


def test_a_call_others_wait_for_runs_the_cheapest_so_far_not_a_sample() -> None:
    choice = ThreadChoice((1, 2), min_samples=2)
    # Nothing measured yet: the first call samples whatever waits.
    assert choice.choose(8, may_explore=False) == 1
    choice.record(8, 1, 0.001)
    assert choice.best(8) == 1  # the cheapest so far, before every option is sampled
    # Two threads are still unsampled; a call others wait for runs (and samples) one.
    assert choice.choose(8, may_explore=False) == 1
    choice.record(8, 1, 0.001)
    assert choice.choose(8, may_explore=False) == 1
    assert choice.choose(8) == 2  # the next call that may, samples


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


def test_costly_tries_hold_tries_back_then_space_out_until_a_fair_one() -> None:
    choice = ThreadChoice((1, 2), explore_every=4, min_samples=1)
    costs = {1: 0.001, 2: 0.0015}
    assert run_calls(choice, 8, costs, 2) == [1, 2]  # each sampled, within the ratio
    assert run_calls(choice, 300, costs, 2) == [1, 2]  # another size: its own samples
    costs[2] = 0.005  # the host got busy: two threads now five times dearer
    # The size's 4th call tries two threads: past twice their own mean, the host slowed them
    # down, so no try until 4 calls of any size later: the other size's 4th call does not try.
    assert run_calls(choice, 8, costs, 2) == [1, 2]
    assert run_calls(choice, 300, {1: 0.001, 2: 0.0015}, 2) == [1, 1]
    chosen = run_calls(choice, 8, costs, 58)  # the size's calls 5 to 62
    explored_at = [i + 5 for i, t in enumerate(chosen) if t == 2]
    # Two threads are now known costly: each costly try doubles the size's own interval, from
    # 4 to 8 after the 8th call's try, 16 after the 16th, 32 after the 32nd (the 64th next).
    assert explored_at == [8, 16, 32]
    costs[2] = 0.0015  # quiet again: the next try is fair and ends the backing off
    chosen = run_calls(choice, 8, costs, 20)  # calls 63 to 82
    explored_at = [i + 63 for i, t in enumerate(chosen) if t == 2]
    assert explored_at == [64, 68, 72, 76, 80]


def test_tries_stop_spacing_out_at_max_backoff_times_explore_every() -> None:
    choice = ThreadChoice((1, 2), explore_every=2, min_samples=1)
    chosen = run_calls(choice, 8, {1: 0.001, 2: 0.005}, 400)
    explored_at = [i + 1 for i, t in enumerate(chosen) if t == 2]
    gaps = [b - a for a, b in itertools.pairwise(explored_at)]
    # The sample (call 2), newly costly, holds tries 2 calls; then two threads are known
    # costly and the size's interval doubles per try, up to MAX_BACKOFF times explore_every.
    assert gaps[:4] == [2, 4, 8, 16]
    assert gaps[-3:] == [2 * MAX_BACKOFF] * 3


def test_a_busy_host_runs_each_size_on_the_fewest_threads_near_its_cheapest() -> None:
    choice = ThreadChoice((1, 2, 4), explore_every=8, min_samples=1)
    quiet = {1: 0.0015, 2: 0.0008, 4: 0.0012}  # size 64: two threads cheapest, one within 2x
    large = {1: 0.040, 2: 0.021, 4: 0.010}  # size 4096: four threads, one and two far dearer
    assert run_calls(choice, 64, quiet, 3) == [1, 2, 4]
    assert run_calls(choice, 4096, large, 3) == [1, 2, 4]
    assert run_calls(choice, 64, quiet, 1) == [2]
    # The 5th batch of size 64, on its cheapest count, takes past twice its mean: the host is
    # busy until 8 calls of any size later (call 16).
    choice.record(64, choice.choose(64), 0.0018)
    # Size 64 runs on one thread, size 4096 stays on four (one and two past the ratio there).
    assert run_calls(choice, 64, quiet, 2) == [1, 1]
    assert run_calls(choice, 4096, large, 1) == [4]
    # Size 64's 8th call (the 12th in all) has its exploring turn while busy: postponed to the
    # 16th, the first past the hold, which tries four threads; then back on two.
    assert run_calls(choice, 64, quiet, 8) == [1, 1, 1, 1, 4, 2, 2, 2]


def test_a_costly_try_holds_tries_back_but_does_not_make_the_host_busy() -> None:
    choice = ThreadChoice((1, 2), explore_every=4, min_samples=1)
    costs = {1: 0.0019, 2: 0.001}  # one thread a little under twice two's cost
    assert run_calls(choice, 64, costs, 2) == [1, 2]
    costs[1] = 0.0021  # its tries now just past twice the cheapest: costly, not slowed down
    # The 4th call's try holds the next until the 8th; between, the lane stays on two.
    assert run_calls(choice, 64, costs, 10) == [2, 1, 2, 2, 2, 1, 2, 2, 2, 2]


def test_a_busy_hosts_calls_are_judged_by_their_own_counts_mean() -> None:
    choice = ThreadChoice((1, 2), explore_every=4, min_samples=1)
    costs = {1: 0.0017, 2: 0.001}
    assert run_calls(choice, 64, costs, 2) == [1, 2]
    assert run_calls(choice, 300, {1: 0.001, 2: 0.001}, 2) == [1, 2]
    # Size 300's one thread takes five times its mean: the host is busy until 4 calls later.
    assert run_calls(choice, 300, {1: 0.005, 2: 0.001}, 1) == [1]
    # Size 64 runs on one thread (within twice its cheapest) at 2.1x two's mean: past twice
    # the cheapest, but not its own count's mean, so the host is not held busy by it. Then its
    # postponed turn tries one thread (costly: tries are held back), and it is back on two.
    costs[1] = 0.0021
    assert run_calls(choice, 64, costs, 6) == [1, 1, 1, 1, 2, 2]
    # Held back 8 calls by that try (not for as long as the busy calls would have made it):
    # the 8th call's turn is taken by the 14th. One thread, now known costly (its mean past
    # twice the cheapest), costly again: only its bucket's turns space out, to every 8th call.
    assert run_calls(choice, 64, costs, 8) == [2, 2, 2, 2, 2, 1, 2, 1]


def test_a_known_costly_option_spaces_its_own_buckets_tries_not_every_sizes() -> None:
    choice = ThreadChoice((1, 2), explore_every=4, min_samples=1)
    dear = {1: 0.001, 2: 0.005}  # size 8: two threads always five times dearer
    fair = {1: 0.001, 2: 0.0012}  # size 300: two threads within the ratio
    assert run_calls(choice, 8, dear, 2) == [1, 2]  # newly costly: every try held 4 calls
    chosen_8, chosen_300 = [], []
    for _ in range(200):  # strictly alternating sizes
        chosen_8 += run_calls(choice, 8, dear, 1)
        chosen_300 += run_calls(choice, 300, fair, 1)
    # Size 8 keeps trying two threads, ever less often (every 4th call, then 8th, ... 64th);
    # size 300 is not held back by those tries: it samples two threads and keeps exploring.
    explored_8 = [i for i, t in enumerate(chosen_8) if t == 2]
    assert 3 <= len(explored_8) <= 8
    assert choice.samples(300)[2] >= 10


def test_without_busy_host_detection_a_slow_call_changes_nothing() -> None:
    choice = ThreadChoice((1, 2), explore_every=1000, min_samples=1, detects_busy_host=False)
    quiet = {1: 0.002, 2: 0.001}
    assert run_calls(choice, 64, quiet, 3) == [1, 2, 2]
    choice.record(64, choice.choose(64), 0.003)  # three times its mean: a long step
    # Not busy: still the cheapest (with detection, one thread, within twice the cheapest).
    assert run_calls(choice, 64, quiet, 3) == [2, 2, 2]


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
