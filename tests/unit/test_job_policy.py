"""Durable batch jobs' pure rules: state from counts, backoff schedule, chunking, result paging."""

from __future__ import annotations

import pytest

from services.common.job_policy import (
    FLEET_CODES,
    FLEET_ROUNDS,
    GiveUp,
    ItemCounts,
    JobState,
    Retry,
    RetryPolicy,
    chunk_ends,
    chunk_ranges,
    eta_s,
    finished_prefix,
    fleet_patience_spent,
    job_state,
    progress,
)
from services.gateway.jobs_api import JobsApiConfig

pytestmark = pytest.mark.unit


def make_counts(*, num_ok: int = 0, num_failed: int = 0, num_cancelled: int = 0) -> ItemCounts:
    return ItemCounts(num_ok=num_ok, num_failed=num_failed, num_cancelled=num_cancelled)


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        (make_counts(), JobState.QUEUED),
        (make_counts(num_ok=3), JobState.RUNNING),
        (make_counts(num_failed=1), JobState.RUNNING),
        (make_counts(num_ok=10), JobState.SUCCEEDED),
        (make_counts(num_ok=9, num_failed=1), JobState.PARTIALLY_FAILED),
        (make_counts(num_failed=10), JobState.FAILED),
        (make_counts(num_failed=4, num_cancelled=6), JobState.FAILED),
    ],
)
def test_state_follows_counts(counts: ItemCounts, expected: JobState) -> None:
    assert job_state(10, counts, is_cancelled=False) is expected


def test_cancelled_wins_over_counts_and_is_terminal() -> None:
    for counts in (make_counts(), make_counts(num_ok=4), make_counts(num_ok=10)):
        assert job_state(10, counts, is_cancelled=True) is JobState.CANCELLED
    assert JobState.CANCELLED.is_terminal and not JobState.RUNNING.is_terminal


def test_progress_and_eta_from_rate_so_far() -> None:
    counts = make_counts(num_ok=20, num_failed=5)
    assert progress(100, counts) == 0.25
    # 25 items in 5 s: 5 items/s, 75 left -> 15 s.
    assert eta_s(100, counts, started_s=1000.0, now_s=1005.0) == pytest.approx(15.0)
    assert eta_s(100, make_counts(), started_s=1000.0, now_s=1005.0) == 0.0
    assert eta_s(100, counts, started_s=0.0, now_s=1005.0) == 0.0
    assert eta_s(25, counts, started_s=1000.0, now_s=1005.0) == 0.0


def test_backoff_doubles_up_to_the_cap_with_full_jitter() -> None:
    policy = RetryPolicy(max_attempts=10, base_delay_s=0.1, max_delay_s=1.0)
    ceilings = [policy.ceiling_s(n) for n in range(1, 7)]
    assert ceilings == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert policy.decide(3, "UNAVAILABLE", "down", jitter=0.5) == Retry(after_s=pytest.approx(0.2))
    assert policy.decide(3, "UNAVAILABLE", "down", jitter=0.0) == Retry(after_s=0.0)


def test_a_retry_waits_at_least_the_refusals_hint() -> None:
    policy = RetryPolicy(base_delay_s=0.1, max_delay_s=1.0)
    assert policy.decide(1, "RESOURCE_EXHAUSTED", "busy", 0.5, hint_s=3.0) == Retry(after_s=3.0)
    assert policy.decide(1, "RESOURCE_EXHAUSTED", "busy", 0.5, hint_s=900.0) == Retry(after_s=60.0)
    # A hint shorter than the backoff's draw leaves the draw.
    decision = policy.decide(4, "RESOURCE_EXHAUSTED", "busy", 0.5, hint_s=0.01)
    assert decision == Retry(after_s=pytest.approx(0.4))


def test_retries_stop_at_max_attempts_with_the_last_status() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert isinstance(policy.decide(2, "RESOURCE_EXHAUSTED", "busy", jitter=0.3), Retry)
    decision = policy.decide(3, "RESOURCE_EXHAUSTED", "busy", jitter=0.3)
    assert isinstance(decision, GiveUp)
    assert decision.code == "RESOURCE_EXHAUSTED" and "after 3 attempts" in decision.message


def test_a_call_the_gateway_dropped_unseen_is_retried_and_waits_for_the_fleet() -> None:
    """CANCELLED from the gateway is a call its grpc dropped before any Python saw it (past
    --max-pending-calls): the fleet is overloaded, the item is not bad."""
    assert isinstance(RetryPolicy().decide(1, "CANCELLED", "dropped", jitter=0.5), Retry)
    assert "CANCELLED" in FLEET_CODES


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED"])
def test_errors_a_retry_cannot_fix_are_dead_lettered_at_once(code: str) -> None:
    assert RetryPolicy().decide(1, code, "bad item", jitter=0.9) == GiveUp(code, "bad item")


def test_bad_retry_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_chunks_cover_every_item_once_in_order() -> None:
    assert chunk_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_ranges(8, 4) == [(0, 4), (4, 8)]
    assert chunk_ranges(0, 4) == []
    covered = [i for start, end in chunk_ranges(1001, 64) for i in range(start, end)]
    assert covered == list(range(1001))
    with pytest.raises(ValueError):
        chunk_ranges(10, 0)


def test_results_stream_stops_at_the_first_unfinished_item() -> None:
    assert finished_prefix([b"0", b"1", None, b"3"]) == [b"0", b"1"]
    assert finished_prefix([None, b"1"]) == []
    assert finished_prefix([b"0", b"1"]) == [b"0", b"1"]


def test_resuming_from_the_next_index_yields_each_result_once_in_order() -> None:
    stored: list[bytes | None] = [str(i).encode() for i in range(6)] + [None] * 4
    seen: list[bytes] = []
    offset = 0
    for finished_upto in (6, 10):  # the job makes progress between calls
        stored[:finished_upto] = [str(i).encode() for i in range(finished_upto)]
        page = finished_prefix(stored[offset:])
        seen += page
        offset += len(page)
    assert seen == [str(i).encode() for i in range(10)]


def test_a_chunk_the_fleet_cannot_serve_waits_rounds_and_time_both() -> None:
    """Before, 10 rounds (about 5 minutes of claim timeouts) failed a chunk's items: a rollout
    of any tier longer than that failed every queued job's items (review finding)."""
    patience_s = 1800.0
    assert not fleet_patience_spent(FLEET_ROUNDS, patience_s - 1, patience_s)
    assert not fleet_patience_spent(FLEET_ROUNDS - 1, patience_s * 10, patience_s)
    assert fleet_patience_spent(FLEET_ROUNDS, patience_s, patience_s)
    assert fleet_patience_spent(FLEET_ROUNDS, 0.0, 0.0)  # no patience: the rounds alone


def test_a_deadline_passed_in_the_fleet_is_no_items_fault() -> None:
    assert "DEADLINE_EXCEEDED" in FLEET_CODES
    assert not {"INVALID_ARGUMENT", "INTERNAL", "NOT_FOUND"} & FLEET_CODES


def test_chunks_end_at_their_item_count_or_their_bytes_and_a_large_item_goes_alone() -> None:
    assert chunk_ends([1] * 10, 4, 100) == [4, 8, 10]
    assert chunk_ends([40] * 8, 8, 128) == [3, 6, 8]
    # One large item shrinks its own chunk, not every chunk of its job.
    assert chunk_ends([1, 1, 200, 1, 1, 1], 4, 100) == [2, 3, 6]
    assert chunk_ends([70] + [1] * 63, 8, 128) == [8, 16, 24, 32, 40, 48, 56, 64]
    assert chunk_ends([], 4, 100) == []
    covered = chunk_ends([5] * 1001, 64, 10**9)
    assert covered[-1] == 1001 and len(covered) == 16


@pytest.mark.parametrize(
    ("limit", "max_chunk", "max_item"),
    [
        (4 * 1024 * 1024, 2 * 1024 * 1024, 4 * 1024 * 1024 - 64 * 1024),  # the default
        (32 * 1024, 16 * 1024, 24 * 1024),  # a small limit: an item still fits (was -32 KiB)
        (1024**3, 32 * 1024 * 1024, 64 * 1024 * 1024 - 64 * 1024),  # runners' channel: 64 MiB
    ],
)
def test_job_chunks_and_items_are_bounded_by_the_gateways_message_limit(
    limit: int, max_chunk: int, max_item: int
) -> None:
    config = JobsApiConfig.for_limits(limit, 256)
    assert (config.max_chunk_bytes, config.max_item_bytes) == (max_chunk, max_item)


@pytest.mark.parametrize(("max_inputs", "chunk_size"), [(256, 64), (64, 64), (16, 16), (1, 1)])
def test_job_chunks_hold_no_more_items_than_the_gateway_takes_in_one_call(
    max_inputs: int, chunk_size: int
) -> None:
    """A runner's call of a chunk is a Predict like any other: past the gateway's
    --max-inputs-per-request every chunk was refused, and its items run one a call (review
    finding)."""
    assert JobsApiConfig.for_limits(4 * 1024 * 1024, max_inputs).chunk_size == chunk_size


@pytest.mark.parametrize(
    "message",
    ["Received message larger than max (5000000 vs. 4194304)", "message larger than max: x"],
)
def test_a_message_past_its_size_limit_is_not_retried(message: str) -> None:
    """It fails alike however often it is retried (a chunk's answer too large: its items run
    alone may pass); a RESOURCE_EXHAUSTED for load is retried."""
    policy = RetryPolicy(max_attempts=5)
    assert policy.decide(1, "RESOURCE_EXHAUSTED", message, 0.5) == GiveUp(
        "RESOURCE_EXHAUSTED", message
    )
    assert isinstance(policy.decide(1, "RESOURCE_EXHAUSTED", "queue full", 0.5), Retry)
