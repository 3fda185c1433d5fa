"""Prefix caching: block digests, the allocator's shared and remembered blocks, and the scheduler
admitting sequences past the cached prefix they share (outputs checked against the fake model's
unbatched reference, shared blocks checked to hold the sequence's own tokens)."""

from __future__ import annotations

import random

import pytest

from services.gpu_worker.generation.block_allocator import BlockAllocator
from services.gpu_worker.generation.prefix_cache import extend_digests
from tests.support.fake_generation import (
    VOCAB_SIZE,
    FakeEngine,
    assert_outputs_match_reference,
    item_of,
    make_config,
    make_seq,
    soak,
)

pytestmark = pytest.mark.unit

BLOCK = 4
SHARED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]  # three full blocks of 4


def digests(tokens: list[int], num_blocks: int, salt: str = "") -> list[bytes]:
    return extend_digests([], tokens, block_size=BLOCK, num_blocks=num_blocks, salt=salt)


def caching_engine(**overrides: object) -> FakeEngine:
    return FakeEngine(make_config(block_size=BLOCK, enable_prefix_caching=True, **overrides))


# -- digests -----------------------------------------------------------------------------------


def test_a_blocks_digest_covers_every_token_before_it() -> None:
    base = digests(SHARED, 3)
    changed_first = digests([0, *SHARED[1:]], 3)
    changed_last = digests([*SHARED[:-1], 0], 3)
    assert len(set(base)) == 3
    assert all(a != b for a, b in zip(base, changed_first, strict=True))
    assert base[:2] == changed_last[:2] and base[2] != changed_last[2]


def test_salts_separate_the_chains_and_extending_equals_computing_at_once() -> None:
    assert digests(SHARED, 3, salt="tenant-a") != digests(SHARED, 3, salt="tenant-b")
    partial = digests(SHARED, 1)
    extended = extend_digests(partial, SHARED, block_size=BLOCK, num_blocks=3, salt="")
    assert extended == digests(SHARED, 3)
    with pytest.raises(ValueError, match="need 16 tokens"):
        digests(SHARED, 4)


# -- allocator ---------------------------------------------------------------------------------


def test_a_remembered_block_is_shared_then_kept_after_its_owners_free_it() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=BLOCK)
    (block,) = allocator.allocate(1)
    key = digests(SHARED, 1)[0]
    allocator.remember(block, key)
    assert allocator.cached_prefix([key, b"unknown"]) == [block]
    allocator.share([block])  # a second owner
    allocator.free([block])
    assert allocator.num_free == 3  # still owned once
    allocator.free([block])
    assert allocator.num_free == 4 and allocator.num_cached == 1
    assert allocator.num_free_among([block]) == 1
    allocator.share([block])  # out of the free list again, contents intact
    assert allocator.num_free == 3 and allocator.cached_prefix([key]) == [block]
    allocator.free([block])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([block])  # one owner, freed twice


def test_reusing_a_free_cached_block_forgets_it_least_recently_freed_first() -> None:
    allocator = BlockAllocator(num_blocks=2, block_size=BLOCK)
    first, second = allocator.allocate(2)
    keys = digests(SHARED, 2)
    allocator.remember(first, keys[0])
    allocator.remember(second, keys[1])
    allocator.free([first])
    allocator.free([second])
    assert allocator.allocate(1) == [first]  # freed first, reused first
    assert allocator.cached_prefix(keys) == []  # the chain now breaks at block 0
    assert allocator.cached_prefix(keys[1:]) == [second]
    assert allocator.num_cached == 1


def test_only_owned_blocks_are_remembered_and_only_remembered_ones_shared() -> None:
    allocator = BlockAllocator(num_blocks=3, block_size=BLOCK)
    a, b = allocator.allocate(2)
    key = digests(SHARED, 1)[0]
    allocator.remember(a, key)
    allocator.remember(b, key)  # computed alongside: a keeps the digest, b stays private
    assert allocator.cached_prefix([key]) == [a] and allocator.num_cached == 1
    with pytest.raises(ValueError, match="only remembered"):
        allocator.share([b])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.remember(2, digests(SHARED, 2)[1])


# -- scheduler ---------------------------------------------------------------------------------


def test_a_later_sequence_starts_past_the_cached_blocks_it_shares() -> None:
    engine = caching_engine()
    first = make_seq(seq_id=1, prompt=[*SHARED, 7, 7], max_tokens=3)
    engine.add(first)
    engine.step()  # first's prompt computed: its three full blocks are remembered
    second = make_seq(seq_id=2, prompt=[*SHARED, 9], max_tokens=5, tenant="b")
    engine.add(second)
    joined_at = engine.scheduler.compute_s("b")  # lifted to the floor: first's prompt
    output = engine.step()
    item = item_of(output, 2)
    assert item.start_position == 12 and item.token_ids == (9,)
    assert item.block_table[:3] == item_of(engine.steps[0], 1).block_table[:3]
    assert (output.num_prefix_queried_tokens, output.num_prefix_hit_tokens) == (13, 12)
    assert second.num_cached_tokens == 12
    engine.run()
    assert_outputs_match_reference(engine, [first, second])
    # Its tenant is charged what it computed: its last prompt token and 4 outputs fed back.
    assert engine.scheduler.compute_s("b") - joined_at == 1 + 4


def test_the_last_prompt_token_is_always_computed() -> None:
    engine = caching_engine()
    engine.add(make_seq(seq_id=1, prompt=SHARED, max_tokens=2))
    engine.step()
    same = make_seq(seq_id=2, prompt=SHARED, max_tokens=2)
    engine.add(same)
    item = item_of(engine.step(), 2)
    # All three blocks are cached, but the third holds the last token, whose logits sample.
    assert item.start_position == 8 and item.token_ids == tuple(SHARED[8:])
    engine.run()
    assert engine.outputs[1] == engine.outputs[2]


def test_sequences_with_different_salts_or_caching_off_share_nothing() -> None:
    for engine, salts in ((caching_engine(), ("a", "b")), (FakeEngine(make_config()), ("", ""))):
        engine.add(make_seq(seq_id=1, prompt=[*SHARED, 1], cache_salt=salts[0]))
        engine.step()
        engine.add(make_seq(seq_id=2, prompt=[*SHARED, 1], cache_salt=salts[1]))
        output = engine.step()
        assert item_of(output, 2).start_position == 0
        assert output.num_prefix_hit_tokens == 0
        engine.run()
        assert engine.outputs[1] == engine.outputs[2]


def test_a_preempted_sequence_finds_its_own_blocks_again() -> None:
    # 8 blocks: two sequences of 20 computed tokens (5 blocks) each cannot both grow to their
    # end. Blocks are freed tail first, so the survivor's growth reuses the victim's tail.
    engine = caching_engine(num_blocks=8, max_num_batched_tokens=64)
    first = make_seq(seq_id=1, num_prompt_tokens=9, max_tokens=12)
    second = make_seq(seq_id=2, num_prompt_tokens=9, max_tokens=12)
    engine.add(first)
    engine.add(second)
    while not any(s.preempted for s in engine.steps[-1:]):
        engine.step()
    assert engine.steps[-1].preempted == (2,)
    while not second.block_table:
        engine.step()
    assert second.num_cached_tokens >= 8  # its prompt's two full blocks, at least
    engine.run()
    assert_outputs_match_reference(engine, [first, second])


def test_cached_blocks_never_keep_a_sequence_waiting() -> None:
    engine = caching_engine(num_blocks=8)
    for seq_id in range(1, 5):  # each leaves two remembered blocks behind
        engine.add(make_seq(seq_id=seq_id, num_prompt_tokens=8, max_tokens=1))
        engine.run()
    assert engine.scheduler.num_free_blocks == 8 and engine.scheduler.num_cached_blocks == 8
    big = make_seq(seq_id=9, num_prompt_tokens=28, max_tokens=4)  # needs all 8 blocks
    engine.add(big)
    assert item_of(engine.step(), 9).start_position == 0
    engine.run()
    assert_outputs_match_reference(engine, [big])


@pytest.mark.parametrize("is_static", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_soak_with_shared_prefixes_keeps_outputs_exact(
    seed: int, is_static: bool
) -> None:
    """Prompts drawn from a few shared system prompts plus a tail, under memory pressure,
    preemption and cancels: every output equals the unbatched reference, and the cache hits."""
    rng = random.Random(seed)
    config = make_config(
        max_num_seqs=6,
        max_num_batched_tokens=32,
        num_blocks=24,
        block_size=BLOCK,
        max_model_len=64,
        watermark_blocks=1,
        is_static=is_static,
        enable_prefix_caching=True,
    )
    engine = FakeEngine(config)
    systems = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    done = soak(
        engine,
        rng,
        lambda r: {
            "prompt": r.choice(systems) + [r.randrange(VOCAB_SIZE) for _ in range(r.randint(1, 10))]
        },
    )
    assert done.prefix_hit_tokens > 0
