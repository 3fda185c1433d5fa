"""GenerationScheduler: continuous batching, KV admission, chunked prefill, preemption, static mode.

Tests drive the scheduler as the engine does (schedule -> model -> update_from_output -> finish)
with a fake model over a fake paged KV cache: computing a token writes it into its slot of a
physical block, and sampling reads the whole context back through the block table. The next
token depends only on that context, so any wrong block table, skipped or repeated position, or
block shared by two live sequences changes the outputs, and a preempted sequence recomputed
from scratch must produce exactly what an uninterrupted run does (tests/support/fake_generation).
"""

from __future__ import annotations

import itertools
import random

import pytest

from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.generation.scheduler import GenerationScheduler
from services.gpu_worker.generation.sequence import SchedulerOutput, Sequence, SequenceStatus
from tests.support.fake_generation import (
    FakeEngine,
    assert_outputs_match_reference,
    item_of,
    make_config,
    make_seq,
    scheduled_ids,
    soak,
)

pytestmark = pytest.mark.unit

# -- continuous batching -----------------------------------------------------------------------


def test_s18_new_request_joins_running_decode_batch_at_the_next_step() -> None:
    engine = FakeEngine(make_config())
    engine.add(make_seq(seq_id=1, max_tokens=10))
    engine.add(make_seq(seq_id=2, max_tokens=10))
    engine.step()  # both prefill
    decode = engine.step()
    assert [(s.start_position, len(s.token_ids)) for s in decode.scheduled] == [(4, 1), (4, 1)]
    engine.add(make_seq(seq_id=3, max_tokens=10))
    joined = engine.step()
    assert scheduled_ids(joined) == [1, 2, 3]
    assert [(s.start_position, len(s.token_ids)) for s in joined.scheduled[:2]] == [(5, 1)] * 2
    new = item_of(joined, 3)
    assert (new.start_position, new.token_ids, new.samples) == (
        0,
        make_seq(seq_id=3).prompt_token_ids,
        True,
    )


def test_a_step_that_may_not_admit_runs_the_running_and_leaves_the_waiting_waiting() -> None:
    # The engine's prefill hold (a GPU replaying decode graphs) plans such steps.
    engine = FakeEngine(make_config())
    engine.add(make_seq(seq_id=1, max_tokens=10))
    engine.step()
    engine.add(make_seq(seq_id=2, max_tokens=10))
    held = engine.step(admit=False)
    assert scheduled_ids(held) == [1] and engine.scheduler.num_waiting == 1
    assert scheduled_ids(engine.step()) == [1, 2]


def test_s18_finished_sequence_leaves_at_once_and_its_blocks_return() -> None:
    engine = FakeEngine(make_config(num_blocks=16))
    short = make_seq(seq_id=1, num_prompt_tokens=8, max_tokens=2)
    engine.add(short)
    engine.add(make_seq(seq_id=2, max_tokens=8))
    engine.step()
    engine.step()  # short's second token: the engine finishes it in this step
    assert engine.scheduler.get(1) is None
    assert short.status is SequenceStatus.FINISHED and short.block_table == []
    running = engine.scheduler.get(2)
    assert running is not None
    assert engine.scheduler.num_free_blocks == 16 - len(running.block_table)
    assert scheduled_ids(engine.step()) == [2]
    assert not engine.scheduler.finish(1)


def test_outputs_of_a_busy_batch_equal_unbatched_runs() -> None:
    engine = FakeEngine(make_config(max_num_seqs=3, max_num_batched_tokens=16, num_blocks=20))
    seqs = [make_seq(seq_id=i, num_prompt_tokens=3 + 2 * i, max_tokens=2 + i) for i in range(1, 7)]
    for seq in seqs:
        engine.add(seq)
    engine.run()
    assert_outputs_match_reference(engine, seqs)


# -- admission by free KV blocks ---------------------------------------------------------------


def start_one_running(engine: FakeEngine) -> None:
    """Sequence 1: 15 prompt tokens in 4 of the 8 blocks; its one decode needs no new block."""
    engine.add(make_seq(seq_id=1, num_prompt_tokens=15, max_tokens=2))
    engine.step()
    assert engine.scheduler.num_free_blocks == 4


def test_admits_a_sequence_needing_exactly_the_free_blocks() -> None:
    engine = FakeEngine(make_config(num_blocks=8))
    start_one_running(engine)
    engine.add(make_seq(seq_id=2, num_prompt_tokens=16))
    output = engine.step()
    assert scheduled_ids(output) == [1, 2]
    assert len(item_of(output, 2).token_ids) == 16
    assert engine.scheduler.num_free_blocks == 4  # sequence 1 finished in this step


def test_one_token_more_than_fits_waits_until_blocks_free() -> None:
    engine = FakeEngine(make_config(num_blocks=8))
    start_one_running(engine)
    engine.add(make_seq(seq_id=2, num_prompt_tokens=17))
    assert scheduled_ids(engine.step()) == [1]  # 17 tokens need 5 blocks; 4 are free
    assert engine.scheduler.num_waiting == 1
    assert engine.scheduler.num_free_blocks == 8  # sequence 1 finished
    output = engine.step()
    assert scheduled_ids(output) == [2]
    assert len(item_of(output, 2).token_ids) == 17


def test_watermark_keeps_headroom_while_others_run() -> None:
    engine = FakeEngine(make_config(num_blocks=8, watermark_blocks=1))
    start_one_running(engine)
    engine.add(make_seq(seq_id=2, num_prompt_tokens=16))
    assert scheduled_ids(engine.step()) == [1]  # 4 free, 4 needed + 1 headroom
    assert scheduled_ids(engine.step()) == [2]  # nothing runs: headroom is not needed


def test_max_num_seqs_caps_running_and_the_next_joins_when_one_finishes() -> None:
    engine = FakeEngine(make_config(max_num_seqs=2))
    seqs = [make_seq(seq_id=i, max_tokens=m) for i, m in [(1, 2), (2, 5), (3, 3), (4, 1)]]
    for seq in seqs:
        engine.add(seq)
    assert scheduled_ids(engine.step()) == [1, 2]
    assert scheduled_ids(engine.step()) == [1, 2]  # 1 finishes here
    assert scheduled_ids(engine.step()) == [2, 3]
    engine.run()
    assert max(len(s.scheduled) for s in engine.steps) == 2
    assert_outputs_match_reference(engine, seqs)


def test_waiting_sequences_start_in_priority_then_arrival_order() -> None:
    engine = FakeEngine(make_config(max_num_seqs=1))
    for seq_id, priority in [(1, 2), (2, 0), (3, 1), (4, 0)]:
        engine.add(make_seq(seq_id=seq_id, priority=priority, max_tokens=1))
    engine.run()
    assert [scheduled_ids(s) for s in engine.steps] == [[2], [4], [3], [1]]


def test_within_a_priority_the_tenant_with_fewer_tokens_per_weight_starts_first() -> None:
    # One seat. "a" (weight 1) arrives first with three sequences, "b" (weight 3) after: once
    # a's first has run, b has computed fewer tokens per weight, so b's go before a's others.
    engine = FakeEngine(make_config(max_num_seqs=1))
    for seq_id in (1, 2, 3):
        engine.add(make_seq(seq_id=seq_id, tenant="a", max_tokens=1))
    for seq_id in (4, 5):
        engine.add(make_seq(seq_id=seq_id, tenant="b", weight=3.0, max_tokens=1))
    engine.run()
    assert [scheduled_ids(s) for s in engine.steps] == [[1], [4], [5], [2], [3]]


def test_priority_outranks_fair_share_among_waiting_sequences() -> None:
    engine = FakeEngine(make_config(max_num_seqs=1))
    engine.add(make_seq(seq_id=1, tenant="busy", max_tokens=1))
    engine.run()
    engine.add(make_seq(seq_id=2, tenant="idle", priority=2, max_tokens=1))
    engine.add(make_seq(seq_id=3, tenant="busy", priority=1, max_tokens=1))
    engine.run()
    assert [scheduled_ids(s) for s in engine.steps][1:] == [[3], [2]]


def test_a_weight_that_is_not_positive_is_a_caller_bug() -> None:
    scheduler = GenerationScheduler(make_config())
    with pytest.raises(ValueError, match="positive and finite"):
        scheduler.add(make_seq(seq_id=1, weight=0.0))


def test_a_waiting_sequence_that_does_not_fit_blocks_later_ones() -> None:
    engine = FakeEngine(make_config(num_blocks=8))
    start_one_running(engine)
    engine.add(make_seq(seq_id=2, num_prompt_tokens=20, max_tokens=4))  # 5 blocks: no room
    engine.add(make_seq(seq_id=3, num_prompt_tokens=2))  # 1 block would fit, but no overtaking
    assert scheduled_ids(engine.step()) == [1]
    assert scheduled_ids(engine.step()) == [2, 3]


# -- chunked prefill ---------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    engine = FakeEngine(make_config(max_num_batched_tokens=8))
    seq = make_seq(seq_id=1, num_prompt_tokens=21, max_tokens=3)
    engine.add(seq)
    engine.run()
    plan = [
        (s.start_position, len(s.token_ids), s.samples) for o in engine.steps for s in o.scheduled
    ]
    assert plan == [(0, 8, False), (8, 8, False), (16, 5, True), (21, 1, True), (22, 1, True)]
    assert engine.steps[0].scheduled[0].token_ids == seq.prompt_token_ids[:8]
    assert_outputs_match_reference(engine, [seq])


def test_chunks_share_the_budget_with_running_decodes() -> None:
    engine = FakeEngine(make_config(max_num_batched_tokens=8))
    decoder = make_seq(seq_id=1, num_prompt_tokens=2, max_tokens=12)
    engine.add(decoder)
    engine.step()
    long = make_seq(seq_id=2, num_prompt_tokens=21, max_tokens=2)
    engine.add(long)
    engine.run()
    chunks = [item_of(s, 2) for s in engine.steps if 2 in scheduled_ids(s)]
    assert [len(c.token_ids) for c in chunks[:3]] == [7, 7, 7]  # 8 minus one decode token
    assert [c.samples for c in chunks[:3]] == [False, False, True]
    for previous, current in itertools.pairwise(chunks):
        assert current.start_position == previous.start_position + len(previous.token_ids)
    assert all(s.num_batched_tokens <= 8 for s in engine.steps)
    assert [len(item_of(s, 1).token_ids) for s in engine.steps[1:4]] == [1, 1, 1]
    assert_outputs_match_reference(engine, [decoder, long])


# -- preemption --------------------------------------------------------------------------------


def preemption_engine() -> tuple[FakeEngine, Sequence, Sequence]:
    """Two sequences in 6 blocks of 2 tokens: both grow to 3 blocks, then the fourth block of
    the first (at position 6, step 4) forces a preemption."""
    engine = FakeEngine(make_config(block_size=2, num_blocks=6))
    first = make_seq(seq_id=1, max_tokens=6)
    second = make_seq(seq_id=2, max_tokens=6)
    engine.add(first)
    engine.add(second)
    for _ in range(3):
        assert engine.step().preempted == ()
    return engine, first, second


def test_preemption_frees_the_latest_sequence_which_resumes_with_identical_outputs() -> None:
    engine, first, second = preemption_engine()
    output = engine.step()
    assert output.preempted == (2,)
    assert scheduled_ids(output) == [1]
    assert second.status is SequenceStatus.WAITING
    assert (second.block_table, second.num_computed_tokens) == ([], 0)
    assert len(second.output_token_ids) == 3  # kept: recompute continues from here
    assert second.num_preemptions == 1
    engine.run()
    resumed = next(item_of(s, 2) for s in engine.steps[4:] if 2 in scheduled_ids(s))
    assert resumed.start_position == 0
    assert resumed.token_ids == second.prompt_token_ids + tuple(engine.outputs[2][:3])
    assert first.num_preemptions == 0
    assert_outputs_match_reference(engine, [first, second])


def test_a_preempted_sequences_tenant_is_not_charged_again_for_its_recompute() -> None:
    """Two tenants' sequences of the same length, one preempted and recomputed: each tenant
    is charged its prompt and the outputs fed back once (4 + 5 tokens), as if nobody were
    preempted."""
    engine = FakeEngine(make_config(block_size=2, num_blocks=6))
    first = make_seq(seq_id=1, max_tokens=6, tenant="a")
    second = make_seq(seq_id=2, max_tokens=6, tenant="b")
    engine.add(first)
    engine.add(second)
    engine.run()
    assert second.num_preemptions == 1
    scheduler = engine.scheduler
    assert scheduler.compute_s("a") == scheduler.compute_s("b") == 4 + 5


def test_a_preempted_sequences_recompute_counts_ahead_of_a_new_prompts_first_token() -> None:
    """Preempted after its first outputs, the second sequence recomputes its prompt and outputs in
    chunks of a 3-token budget: while it does, that recompute is prefill a new prompt waits
    behind (admission's first-token prediction reads it). Before, a running sequence with
    outputs counted nothing, as if it only decoded."""
    engine = FakeEngine(make_config(block_size=2, num_blocks=6, max_num_batched_tokens=3))
    first, second = make_seq(seq_id=1, max_tokens=6), make_seq(seq_id=2, max_tokens=6)
    engine.add(first)
    engine.add(second)
    seen = []
    while engine.live:
        engine.step()
        uncomputed = second.num_tokens - second.num_computed_tokens
        if second.status is SequenceStatus.RUNNING and second.output_token_ids:
            seen.append((uncomputed, engine.scheduler.prefill_tokens_ahead_of(0)))
    assert second.num_preemptions >= 1
    recomputing = [(left, ahead) for left, ahead in seen if left > 1]
    assert recomputing and all(ahead == left for left, ahead in recomputing), seen
    assert all(ahead == 0 for left, ahead in seen if left == 1)  # decoding: no prefill
    assert_outputs_match_reference(engine, [first, second])


def test_preempted_sequence_keeps_its_place_ahead_of_later_arrivals() -> None:
    engine, _, second = preemption_engine()
    queued_before = make_seq(seq_id=3, num_prompt_tokens=2, max_tokens=1, arrival_s=10.0)
    engine.add(queued_before)  # waits behind the running ones before the preemption
    assert engine.step().preempted == (2,)
    queued_after = make_seq(seq_id=4, num_prompt_tokens=2, max_tokens=1, arrival_s=11.0)
    engine.add(queued_after)
    # 2 blocks are free: enough for either newcomer, not for the preempted sequence ahead.
    while 2 not in scheduled_ids(step := engine.step()):
        assert not {3, 4} & set(scheduled_ids(step))
    assert scheduled_ids(step) == [2, 3, 4]
    engine.run()
    assert_outputs_match_reference(engine, [second, queued_before, queued_after])


def test_a_later_higher_priority_arrival_runs_first_and_is_not_the_victim() -> None:
    engine = FakeEngine(make_config(block_size=2, num_blocks=6))
    low = make_seq(seq_id=1, max_tokens=6, priority=1)
    engine.add(low)
    engine.step()
    high = make_seq(seq_id=2, max_tokens=6, priority=0)
    engine.add(high)
    engine.run()
    assert scheduled_ids(engine.steps[2]) == [2, 1]  # running order is priority order
    preempted = [i for s in engine.steps for i in s.preempted]
    assert preempted[0] == 1
    assert high.num_preemptions == 0
    assert_outputs_match_reference(engine, [low, high])


def test_victim_is_the_lowest_priority_even_if_it_arrived_earlier() -> None:
    engine = FakeEngine(make_config(block_size=2, num_blocks=9))
    seqs = [
        make_seq(seq_id=1, max_tokens=6, priority=0, arrival_s=0.0),
        make_seq(seq_id=2, max_tokens=6, priority=1, arrival_s=0.0),
        make_seq(seq_id=3, max_tokens=6, priority=0, arrival_s=2.0),
    ]
    for seq in seqs:
        engine.add(seq)
    engine.run()
    preempted = [i for s in engine.steps for i in s.preempted]
    assert preempted[0] == 2
    assert seqs[0].num_preemptions == 0
    assert_outputs_match_reference(engine, seqs)


def test_the_lowest_running_sequence_preempts_itself() -> None:
    engine = FakeEngine(make_config(block_size=2, num_blocks=4))
    first = make_seq(seq_id=1, num_prompt_tokens=3, max_tokens=3)
    second = make_seq(seq_id=2, num_prompt_tokens=4, max_tokens=3)
    engine.add(first)
    engine.add(second)
    engine.step()
    assert engine.scheduler.num_free_blocks == 0
    output = engine.step()  # 1 fits its block; 2 needs a new one and is last in order
    assert output.preempted == (2,)
    assert scheduled_ids(output) == [1]
    engine.run()
    assert second.num_preemptions == 1
    assert_outputs_match_reference(engine, [first, second])


def test_no_admission_in_a_step_that_preempted() -> None:
    engine, _, _ = preemption_engine()
    # Of 2's class, first in line (a more urgent one takes its place in the same step:
    # test_a_waiting_sequence_takes_the_blocks_of_less_urgent_running_ones).
    engine.add(make_seq(seq_id=3, num_prompt_tokens=1, max_tokens=1, arrival_s=-1.0))
    output = engine.step()
    assert output.preempted == (2,)
    assert 3 not in scheduled_ids(output)  # 3 free blocks after the preemption, but not now
    assert 3 in scheduled_ids(engine.step())


# -- finish ------------------------------------------------------------------------------------


def test_finish_of_a_running_sequence_frees_its_blocks_and_a_waiting_one_starts() -> None:
    engine = FakeEngine(make_config(num_blocks=4))
    engine.add(make_seq(seq_id=1, num_prompt_tokens=12, max_tokens=4))
    engine.step()
    engine.add(make_seq(seq_id=2, num_prompt_tokens=8))
    assert scheduled_ids(engine.step()) == [1]  # 2 needs 2 blocks, 0 free after 1 grew
    assert engine.cancel(1)
    assert engine.scheduler.num_free_blocks == 4
    assert engine.scheduler.get(1) is None
    assert not engine.cancel(1)
    assert scheduled_ids(engine.step()) == [2]


def test_finish_of_the_waiting_head_lets_the_next_one_start() -> None:
    engine = FakeEngine(make_config(num_blocks=8))
    start_one_running(engine)
    engine.add(make_seq(seq_id=2, num_prompt_tokens=20))
    engine.add(make_seq(seq_id=3, num_prompt_tokens=2))
    assert engine.cancel(2)
    assert engine.scheduler.num_free_blocks == 4
    assert scheduled_ids(engine.step()) == [1, 3]


def test_finish_between_schedule_and_update_drops_that_work() -> None:
    scheduler = GenerationScheduler(make_config())
    for seq_id in (1, 2):
        scheduler.add(make_seq(seq_id=seq_id))
    scheduler.schedule()
    assert scheduler.finish(1)
    scheduler.update_from_output({2: 5})  # no entry needed for the finished sequence
    second = scheduler.get(2)
    assert second is not None and second.output_token_ids == [5]
    assert scheduler.num_free_blocks == 64 - 1
    assert scheduled_ids(scheduler.schedule()) == [2]


def test_finish_of_an_unknown_sequence_returns_false() -> None:
    assert not GenerationScheduler(make_config()).finish(7)


# -- static baseline ---------------------------------------------------------------------------


@pytest.mark.parametrize(("is_static", "joins_at_step"), [(False, 2), (True, 5)])
def test_static_admits_nothing_while_a_sequence_runs(is_static: bool, joins_at_step: int) -> None:
    engine = FakeEngine(make_config(is_static=is_static))
    engine.add(make_seq(seq_id=1, max_tokens=4))
    engine.step()
    engine.add(make_seq(seq_id=2, max_tokens=1))
    engine.run()
    first_step = next(i for i, s in enumerate(engine.steps, 1) if 2 in scheduled_ids(s))
    assert first_step == joins_at_step


def test_static_prefills_the_whole_batch_before_any_decode() -> None:
    def plans(is_static: bool) -> list[list[tuple[int, int, int]]]:
        engine = FakeEngine(make_config(is_static=is_static, max_num_batched_tokens=8))
        for seq_id in (1, 2, 3):
            engine.add(make_seq(seq_id=seq_id, num_prompt_tokens=6, max_tokens=3))
        engine.run()
        return [
            [(s.seq_id, s.start_position, len(s.token_ids)) for s in o.scheduled]
            for o in engine.steps
        ]

    static = plans(is_static=True)
    assert static[:4] == [
        [(1, 0, 6), (2, 0, 2)],
        [(2, 2, 4), (3, 0, 4)],
        [(3, 4, 2)],  # 1 and 2 could decode, but the batch's prefill comes first
        [(1, 6, 1), (2, 6, 1), (3, 6, 1)],
    ]
    # Continuous: 1 decodes while 2 and 3 still prefill.
    assert plans(is_static=False)[1] == [(1, 6, 1), (2, 2, 4), (3, 0, 3)]


def test_continuous_needs_fewer_steps_than_static_on_mixed_lengths() -> None:
    def run(is_static: bool) -> int:
        engine = FakeEngine(make_config(is_static=is_static, max_num_seqs=4))
        seqs = [make_seq(seq_id=i, max_tokens=2 if i % 2 else 24) for i in range(1, 9)]
        for seq in seqs:
            engine.add(seq)
        num_steps = engine.run()
        assert_outputs_match_reference(engine, seqs)
        return num_steps

    assert run(is_static=False) <= 0.75 * run(is_static=True)


# -- add(), contract errors, configuration -----------------------------------------------------


@pytest.mark.parametrize(
    ("num_prompt_tokens", "max_tokens", "reason", "detail"),
    [
        (0, 4, RejectReason.EMPTY_PROMPT, "empty prompt"),
        (4, 0, RejectReason.INVALID_MAX_TOKENS, "max_tokens"),
        (30, 3, RejectReason.TOO_LONG, "max_model_len (32)"),  # 33 > 32
        # 28 tokens need 7 blocks of 4; the cache has 6.
        (20, 8, RejectReason.EXCEEDS_KV_CACHE, "needs 7 KV blocks, the cache has 6"),
    ],
)
def test_add_rejects_sequences_that_can_never_run(
    num_prompt_tokens: int, max_tokens: int, reason: RejectReason, detail: str
) -> None:
    scheduler = GenerationScheduler(make_config(max_model_len=32, num_blocks=6))
    decision = scheduler.add(
        make_seq(seq_id=1, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens)
    )
    assert isinstance(decision, Rejected)
    assert decision.reason is reason
    assert detail in decision.detail
    assert not scheduler.has_unfinished()
    assert scheduler.schedule().scheduled == ()


@pytest.mark.parametrize(
    ("num_prompt_tokens", "max_tokens", "num_blocks"),
    [
        (29, 3, 8),  # exactly max_model_len
        (20, 4, 6),  # exactly the whole cache
    ],
)
def test_add_accepts_sequences_exactly_at_the_limits(
    num_prompt_tokens: int, max_tokens: int, num_blocks: int
) -> None:
    scheduler = GenerationScheduler(make_config(max_model_len=32, num_blocks=num_blocks))
    seq = make_seq(seq_id=1, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens)
    assert scheduler.add(seq) == Admitted()
    assert scheduler.num_waiting == 1
    assert scheduler.get(1) is seq


def test_a_sequence_whose_kv_fills_exactly_the_whole_cache_runs_to_its_end() -> None:
    """20 prompt tokens and 5 to generate: the last one is sampled, never fed back, so 24
    positions hold KV, exactly the cache's 6 blocks of 4. Admitted (it was refused as
    needing 7), and it finishes without ever preempting itself."""
    engine = FakeEngine(make_config(max_model_len=32, num_blocks=6))
    assert engine.add(make_seq(seq_id=1, num_prompt_tokens=20, max_tokens=5)) == Admitted()
    for _ in range(50):
        if not engine.scheduler.has_unfinished():
            break
        assert engine.step().preempted == ()
    assert len(engine.outputs[1]) == 5
    assert engine.scheduler.num_free_blocks == 6


def test_add_of_a_duplicate_or_used_sequence_raises() -> None:
    scheduler = GenerationScheduler(make_config())
    scheduler.add(make_seq(seq_id=1))
    with pytest.raises(ValueError, match="already"):
        scheduler.add(make_seq(seq_id=1))
    used = make_seq(seq_id=2)
    used.num_computed_tokens = 2
    with pytest.raises(ValueError, match="not new"):
        scheduler.add(used)


def test_update_without_a_sampled_token_raises_and_changes_nothing() -> None:
    scheduler = GenerationScheduler(make_config())
    scheduler.add(make_seq(seq_id=1))
    scheduler.schedule()
    with pytest.raises(KeyError):
        scheduler.update_from_output({})
    seq = scheduler.get(1)
    assert seq is not None and seq.num_computed_tokens == 0
    scheduler.update_from_output({1: 9})
    assert (seq.num_computed_tokens, seq.output_token_ids) == (4, [9])


def test_schedule_before_update_of_the_last_step_raises() -> None:
    scheduler = GenerationScheduler(make_config())
    scheduler.add(make_seq(seq_id=1))
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="update_from_output"):
        scheduler.schedule()


def test_idle_scheduler_returns_an_empty_output() -> None:
    scheduler = GenerationScheduler(make_config())
    assert scheduler.schedule() == SchedulerOutput(scheduled=(), preempted=(), num_batched_tokens=0)
    scheduler.update_from_output({})
    assert scheduler.schedule().scheduled == ()


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"num_blocks": 0},
        {"block_size": 0},
        {"max_model_len": 0},
        {"watermark_blocks": -1},
    ],
)
def test_inconsistent_config_raises(overrides: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        GenerationScheduler(make_config(**overrides))


# -- randomized soak ---------------------------------------------------------------------------


@pytest.mark.parametrize("is_static", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_s12_randomized_soak_keeps_block_accounting_and_outputs_exact(
    seed: int, is_static: bool
) -> None:
    rng = random.Random(seed)
    config = make_config(
        max_num_seqs=6,
        max_num_batched_tokens=32,
        num_blocks=24,
        block_size=4,
        max_model_len=64,
        watermark_blocks=1,
        is_static=is_static,
    )
    engine = FakeEngine(config)
    done = soak(engine, rng, lambda r: {"num_prompt_tokens": r.randint(1, 30)})
    assert done.cancelled
    assert any(s.preempted for s in engine.steps), "the soak should exercise preemption"


def test_a_waiting_sequence_of_a_more_urgent_class_takes_the_place_of_less_urgent_ones() -> None:
    """Batch generations (class 2) hold both seats when an interactive one (1) arrives: it
    waited for one to finish, past its SLO, as nothing preempted to seat a sequence (review
    finding). Now it runs at the next step, the latest batch one preempted for it; a batch
    one waiting takes no seat from another of its class."""
    engine = FakeEngine(make_config(max_num_seqs=2))
    batch = [make_seq(seq_id=i, max_tokens=20, priority=2) for i in (1, 2)]
    for seq in batch:
        engine.add(seq)
    engine.step()
    interactive = make_seq(seq_id=3, max_tokens=2, priority=1)
    later_batch = make_seq(seq_id=4, max_tokens=2, priority=2)
    engine.add(later_batch)
    engine.add(interactive)
    output = engine.step()
    assert output.preempted == (2,)
    assert scheduled_ids(output) == [1, 3]
    engine.run()
    assert interactive.num_preemptions == 0 and batch[0].num_preemptions == 0
    assert_outputs_match_reference(engine, [*batch, interactive, later_batch])


def test_a_waiting_sequence_takes_the_blocks_of_less_urgent_running_ones() -> None:
    """Seats are free, blocks are not: the batch sequence holding them is preempted, the
    interactive one admitted in its place at once."""
    engine = FakeEngine(make_config(num_blocks=8))
    batch = make_seq(seq_id=1, num_prompt_tokens=28, max_tokens=4, priority=2)
    engine.add(batch)
    engine.step()
    interactive = make_seq(seq_id=2, num_prompt_tokens=8, max_tokens=2, priority=1)
    engine.add(interactive)
    output = engine.step()
    assert output.preempted == (1,)
    assert scheduled_ids(output) == [2]
    engine.run()
    assert_outputs_match_reference(engine, [batch, interactive])


def test_no_sequence_is_preempted_in_vain_for_an_urgent_one() -> None:
    """A critical sequence holds most of the cache, a batch one a little: an interactive one
    waiting needs more than the batch one's blocks would free. It waits, and the batch one
    keeps decoding (preempted, it lost its KV and still seated nobody: diff review)."""
    engine = FakeEngine(make_config(num_blocks=10))
    critical = make_seq(seq_id=1, num_prompt_tokens=30, max_tokens=4, priority=0)
    batch = make_seq(seq_id=2, num_prompt_tokens=2, max_tokens=8, priority=2)
    engine.add(critical)
    engine.add(batch)
    engine.step()  # 8 blocks and 1, each with room for its next token: 1 block free
    interactive = make_seq(seq_id=3, num_prompt_tokens=16, max_tokens=2, priority=1)
    engine.add(interactive)
    output = engine.step()
    assert output.preempted == ()
    assert scheduled_ids(output) == [1, 2]
    engine.run()
    assert_outputs_match_reference(engine, [critical, batch, interactive])


def test_blocks_a_more_urgent_sequence_shares_are_not_counted_as_freed() -> None:
    """With prefix caching a batch sequence shares the prompt blocks of a critical one: giving
    it up frees only its own block, too few to seat the interactive one waiting, so it keeps
    running (its whole block table was counted, and it was preempted in vain: diff review)."""
    engine = FakeEngine(make_config(num_blocks=10, enable_prefix_caching=True))
    prefix = list(range(100, 112))  # three full blocks
    critical = make_seq(seq_id=1, prompt=[*prefix, 200, 201], max_tokens=8, priority=0)
    batch = make_seq(seq_id=2, prompt=[*prefix, 300, 301], max_tokens=8, priority=2)
    engine.add(critical)
    engine.step()
    engine.add(batch)
    engine.step()  # the batch one shares the critical one's three prompt blocks: 5 in use
    interactive = make_seq(seq_id=3, prompt=list(range(500, 528)), max_tokens=2, priority=1)
    engine.add(interactive)
    output = engine.step()  # it needs 7 blocks: 5 are free, and the batch one frees 1
    assert output.preempted == ()
    assert scheduled_ids(output) == [1, 2]
    engine.run()
    assert_outputs_match_reference(engine, [critical, batch, interactive])
