"""The torch threads of one embedding batch (execution.batch_threads): a backfill held short,
the model's own count, or the count a lane's thread choice measured cheapest per padded token,
and which batches teach the latency model."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.types import BatchKey, CloseReason, Dispatch
from services.gpu_worker.execution import batch_threads, resolve_threads
from services.gpu_worker.thread_choice import ThreadChoice

pytestmark = pytest.mark.unit

NOW_S = 100.0


def dispatch(reason: CloseReason = CloseReason.FULL, bucket: int = 16) -> Dispatch:
    return Dispatch(BatchKey("m", "1", "f", bucket), (), reason)


def test_a_backfill_beside_online_traffic_runs_short_and_teaches_nothing() -> None:
    choice = ThreadChoice((1, 2), min_samples=1)
    threads = batch_threads(choice, dispatch(CloseReason.BACKFILL), 4, 1, NOW_S - 0.1, NOW_S)

    assert (threads.count, threads.teaches_latency) == (1, False)
    threads.record(0.5)
    assert choice.best(64) is None  # nothing recorded: the choice never saw this batch


def test_a_backfill_runs_on_fewer_threads_still_when_the_lane_measured_fewer_best() -> None:
    choice = ThreadChoice((1, 2, 4), min_samples=1)
    for cost_s in (0.064, 0.128, 0.192):  # one thread, then two, then four: one is best
        choice.record(64, choice.choose(64), cost_s)
    assert choice.best(64) == 1

    threads = batch_threads(choice, dispatch(CloseReason.BACKFILL), 4, 2, NOW_S - 0.1, NOW_S)
    assert (threads.count, threads.teaches_latency) == (1, False)


def test_without_a_choice_a_batch_runs_on_the_models_threads_and_teaches() -> None:
    threads = batch_threads(None, dispatch(), 4, 1, NOW_S - 0.1, NOW_S)

    assert (threads.count, threads.teaches_latency) == (0, True)
    threads.record(0.5)  # nowhere to record: no error


def test_the_choice_settles_on_the_count_cheapest_per_padded_token() -> None:
    choice = ThreadChoice((1, 2), explore_every=4, min_samples=1)
    # Four rows of bucket 16: 64 padded tokens. Each count is tried once, fewest threads
    # first; the first teaches (nothing is known yet), the second does not, as one thread is
    # the cheapest so far: a sample's time says how another count does, not the lane's batches.
    seen, taught = [], []
    for _ in range(2):
        threads = batch_threads(choice, dispatch(), 4, 1, NOW_S - 10.0, NOW_S)
        threads.record(0.064 if threads.count == 1 else 0.096)  # 1 or 1.5 ms a token
        seen.append(threads.count)
        taught.append(threads.teaches_latency)
    assert (seen, taught) == ([1, 2], [True, False])
    assert choice.best(64) == 1

    counts, teaches = [], []
    for _ in range(6):
        threads = batch_threads(choice, dispatch(), 4, 1, NOW_S - 10.0, NOW_S)
        counts.append(threads.count)
        teaches.append(threads.teaches_latency)
    # Every fourth call of the size explores the other count, and teaches nothing: its time
    # says how the other count does, not how the lane's batches run.
    assert counts == [1, 2, 1, 1, 1, 2]
    assert teaches == [c == 1 for c in counts]


def test_a_batch_others_wait_behind_postpones_its_exploring_turn() -> None:
    choice = ThreadChoice((1, 2), explore_every=3, min_samples=1)
    for cost_s in (0.064, 0.096):
        choice.record(64, choice.choose(64), cost_s)

    # Calls 3 to 6 of the size; the 3rd and the 6th are exploring turns.
    threads = [
        batch_threads(choice, dispatch(), 4, 1, 0.0, NOW_S, may_explore=may_explore)
        for may_explore in (False, True, True, True)
    ]
    # The 3rd, its turn while others wait, runs on the best and teaches; the 4th, with
    # nothing else queued, takes the turn (postponed, not lost); the 6th takes its own.
    assert [(t.count, t.teaches_latency) for t in threads] == [
        (1, True),
        (2, False),
        (1, True),
        (2, False),
    ]


def test_a_busy_hosts_batch_on_a_count_other_than_the_cheapest_still_teaches() -> None:
    choice = ThreadChoice((1, 2), explore_every=1000, min_samples=1)
    for _ in range(2):  # one thread 1.875 ms a token, two 1 ms: two is the cheapest
        threads = batch_threads(choice, dispatch(), 4, 1, NOW_S - 10.0, NOW_S)
        threads.record(0.120 if threads.count == 1 else 0.064)
    busy = batch_threads(choice, dispatch(), 4, 1, NOW_S - 10.0, NOW_S)
    assert busy.count == 2
    busy.record(0.130)  # past twice its mean: the host slowed it down; still the cheapest
    assert choice.best(64) == 2
    # The lane now runs on one thread while the host is busy: not a try, so it teaches the
    # latency model how the lane's batches run now.
    threads = batch_threads(choice, dispatch(), 4, 1, NOW_S - 10.0, NOW_S)
    assert (threads.count, threads.teaches_latency) == (1, True)


def test_the_cost_recorded_is_per_padded_token() -> None:
    choice = ThreadChoice((1, 2), min_samples=1)
    # Two batches of one size class (48 and 64 padded tokens): the smaller one on one thread
    # takes less time, but more per token.
    first = batch_threads(choice, dispatch(), 3, 1, NOW_S - 10.0, NOW_S)
    assert (first.count, first.size) == (1, 48)
    first.record(0.048)  # 1 ms a token
    second = batch_threads(choice, dispatch(), 4, 1, NOW_S - 10.0, NOW_S)
    assert (second.count, second.size) == (2, 64)  # the untried count next
    second.record(0.056)  # 0.875 ms a token, though the longer batch

    assert choice.best(64) == 2


@pytest.mark.parametrize("bucket", [0, 1])
def test_a_tensor_models_size_is_its_rows(bucket: int) -> None:
    threads = batch_threads(ThreadChoice((1, 2)), dispatch(bucket=bucket), 5, 1, 0.0, NOW_S)
    assert threads.size == 5


def test_thread_counts_are_resolved_once_at_start() -> None:
    threads = torch.get_num_threads()
    cpu = resolve_threads(DriverConfig(), torch.device("cpu"))
    assert (cpu.model_threads, cpu.backfill_threads) == (threads, threads // 2)
    # A configured backfill count is never more than the model's own.
    wide = resolve_threads(DriverConfig(backfill_threads=threads + 4), torch.device("cpu"))
    assert wide.backfill_threads == threads
    # A GPU's kernels leave the cores alone: nothing to choose, no backfill count.
    gpu = resolve_threads(DriverConfig(), torch.device("cuda"))
    assert (gpu.model_threads, gpu.backfill_threads) == (0, 0)
    # Set counts stay as set.
    pinned = resolve_threads(DriverConfig(model_threads=1, backfill_threads=1), torch.device("cpu"))
    assert (pinned.model_threads, pinned.backfill_threads) == (1, 1)
