"""A fake engine loop for GenerationScheduler tests: a fake model over a fake paged KV cache.

Computing a token writes it into its slot of a physical block, and sampling reads the whole
context back through the block table. The next token depends only on that context, so any
wrong block table, skipped or repeated position, or block wrongly shared changes the outputs,
and a preempted sequence recomputed from scratch must produce exactly what an uninterrupted
run does.

With prefix caching, blocks keep their contents after their owners free them (they are the
cache), a sequence admitted past a cached prefix must find exactly its own tokens in the blocks
it shares, and no slot is ever written twice while a block is owned: a write into a shared
block fails the test.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from services.gpu_worker.admission import Admitted, Rejected
from services.gpu_worker.generation.scheduler import GenerationScheduler
from services.gpu_worker.generation.scheduler_config import GenerationSchedulerConfig
from services.gpu_worker.generation.sequence import (
    ScheduledSequence,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
)

VOCAB_SIZE = 50


def next_token(context: Seq[int]) -> int:
    """The fake model: a function of every token so far, and of nothing else."""
    return (sum((i + 1) * t for i, t in enumerate(context)) + 7 * len(context)) % VOCAB_SIZE


def reference_output(prompt: Seq[int], max_tokens: int) -> list[int]:
    """What an uninterrupted, unbatched run of the fake model produces."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def make_config(**overrides: Any) -> GenerationSchedulerConfig:
    fields: dict[str, Any] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "num_blocks": 64,
        "block_size": 4,
        "max_model_len": 256,
    }
    fields.update(overrides)
    return GenerationSchedulerConfig(**fields)


def make_seq(
    *,
    seq_id: int,
    num_prompt_tokens: int = 4,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_s: float | None = None,
    tenant: str = "",
    weight: float = 1.0,
    prompt: Seq[int] | None = None,
    cache_salt: str = "",
) -> Sequence:
    """A sequence; its prompt is `prompt`, else `num_prompt_tokens` tokens unique to seq_id."""
    if prompt is None:
        prompt = [(seq_id * 7 + i) % VOCAB_SIZE for i in range(num_prompt_tokens)]
    return Sequence(
        seq_id=seq_id,
        prompt_token_ids=tuple(prompt),
        max_tokens=max_tokens,
        priority=priority,
        arrival_s=float(seq_id) if arrival_s is None else arrival_s,
        tenant=tenant,
        weight=weight,
        cache_salt=cache_salt,
    )


class FakeEngine:
    """The engine loop with a fake model; checks the scheduler's invariants after every step."""

    def __init__(self, config: GenerationSchedulerConfig) -> None:
        self.config = config
        self.scheduler = GenerationScheduler(config)
        self.live: dict[int, Sequence] = {}
        self.outputs: dict[int, list[int]] = {}
        self.steps: list[SchedulerOutput] = []
        # Physical KV cache: block id -> slot -> token id.
        self._kv: dict[int, dict[int, int]] = {}
        self._tables: dict[int, tuple[int, ...]] = {}

    def add(self, seq: Sequence) -> Admitted | Rejected:
        decision = self.scheduler.add(seq)
        if isinstance(decision, Admitted):
            self.live[seq.seq_id] = seq
        return decision

    def cancel(self, seq_id: int) -> bool:
        self.live.pop(seq_id, None)
        self._tables.pop(seq_id, None)
        return self.scheduler.finish(seq_id)

    def step(self, *, admit: bool = True) -> SchedulerOutput:
        output = self.scheduler.schedule(admit=admit)
        block_size = self.config.block_size
        for seq_id in output.preempted:
            self._tables.pop(seq_id, None)
        self._take_blocks(output.scheduled)
        sampled: dict[int, int] = {}
        for item in output.scheduled:
            for offset, token in enumerate(item.token_ids):
                position = item.start_position + offset
                block = self._kv[item.block_table[position // block_size]]
                assert position % block_size not in block, f"slot of position {position} rewritten"
                block[position % block_size] = token
            if item.samples:
                end = item.start_position + len(item.token_ids)
                context = [
                    self._kv[item.block_table[p // block_size]][p % block_size] for p in range(end)
                ]
                sampled[item.seq_id] = next_token(context)
        self.scheduler.update_from_output(sampled)
        for item in output.scheduled:
            seq = self.live[item.seq_id]
            if len(seq.output_token_ids) >= seq.max_tokens:
                self.outputs[item.seq_id] = list(seq.output_token_ids)
                del self.live[item.seq_id]
                del self._tables[item.seq_id]
                assert self.scheduler.finish(item.seq_id)
        self.steps.append(output)
        self._check_invariants(output)
        return output

    def run(self, *, max_steps: int = 2000) -> int:
        """Step until nothing is left; returns the number of steps."""
        num_steps = 0
        while self.scheduler.has_unfinished():
            self.step()
            num_steps += 1
            assert num_steps <= max_steps, "scheduler made no progress"
        return num_steps

    def _take_blocks(self, scheduled: Seq[ScheduledSequence]) -> None:
        """Blocks a sequence starts to own are wiped, so a read of a slot it did not compute
        fails instead of seeing a stale token, except the cached prefix it was admitted with,
        which must hold exactly its own leading tokens."""
        if not self.config.enable_prefix_caching:
            owned = {b for seq in self.live.values() for b in seq.block_table}
            for block in [b for b in self._kv if b not in owned]:
                del self._kv[block]
        block_size = self.config.block_size
        for item in scheduled:
            previous = self._tables.get(item.seq_id)
            if previous is None:  # admitted this step: new, or recomputed after a preemption
                num_shared = item.start_position // block_size
                assert item.start_position % block_size == 0, "a cached prefix is whole blocks"
                tokens = self.live[item.seq_id].all_token_ids
                for position in range(item.start_position):
                    block = item.block_table[position // block_size]
                    assert self._kv[block][position % block_size] == tokens[position], (
                        f"shared block {block} does not hold position {position}'s token"
                    )
                previous = item.block_table[:num_shared]
            # A running sequence's table only grows; earlier blocks keep their contents.
            assert item.block_table[: len(previous)] == previous
            for block in item.block_table[len(previous) :]:
                self._kv[block] = {}
            self._tables[item.seq_id] = item.block_table

    def _check_invariants(self, output: SchedulerOutput) -> None:
        config, scheduler = self.config, self.scheduler
        lengths = [len(s.token_ids) for s in output.scheduled]
        assert output.num_batched_tokens == sum(lengths) <= config.max_num_batched_tokens
        assert all(n >= 1 for n in lengths)
        assert len({s.seq_id for s in output.scheduled}) == len(output.scheduled)
        tables = [seq.block_table for seq in self.live.values()]
        owned = [b for table in tables for b in table]
        if not config.enable_prefix_caching:
            assert len(owned) == len(set(owned)), "a KV block is shared by two sequences"
        assert scheduler.num_free_blocks + len(set(owned)) == config.num_blocks
        assert scheduler.num_running + scheduler.num_waiting == len(self.live)
        assert scheduler.num_running <= config.max_num_seqs
        for seq in self.live.values():
            assert len(set(seq.block_table)) == len(seq.block_table), "a block listed twice"
            # Exactly the blocks its computed tokens need: no leak, no over-allocation.
            assert len(seq.block_table) == -(-seq.num_computed_tokens // config.block_size)
            if seq.status is SequenceStatus.WAITING:
                assert seq.num_computed_tokens == 0


def scheduled_ids(output: SchedulerOutput) -> list[int]:
    return [s.seq_id for s in output.scheduled]


def item_of(output: SchedulerOutput, seq_id: int) -> ScheduledSequence:
    (item,) = [s for s in output.scheduled if s.seq_id == seq_id]
    return item


def assert_outputs_match_reference(engine: FakeEngine, seqs: Seq[Sequence]) -> None:
    for seq in seqs:
        expected = reference_output(seq.prompt_token_ids, seq.max_tokens)
        assert engine.outputs[seq.seq_id] == expected, f"sequence {seq.seq_id}"


@dataclass
class Soak:
    """What `soak` did: the sequences added and cancelled, and the prefix-cache hits."""

    added: list[Sequence] = field(default_factory=list)
    cancelled: set[int] = field(default_factory=set)
    prefix_hit_tokens: int = 0


def soak(
    engine: FakeEngine,
    rng: random.Random,
    prompt: Callable[[random.Random], dict[str, Any]],
    *,
    num_steps: int = 300,
) -> Soak:
    """Random traffic through `engine`: each step a new sequence arrives with probability 0.4
    (`prompt(rng)` gives make_seq its prompt or prompt length), a live one is cancelled with
    probability 0.05, then the engine steps (checking its invariants); then it runs dry. Every
    block must be free again, and every sequence not cancelled must have produced exactly its
    unbatched reference output."""
    done = Soak()
    for step in range(num_steps):
        if rng.random() < 0.4:
            seq = make_seq(
                seq_id=len(done.added) + 1,
                **prompt(rng),
                max_tokens=rng.randint(1, 16),
                priority=rng.randint(0, 2),
                arrival_s=float(step),
            )
            assert engine.add(seq) == Admitted()
            done.added.append(seq)
        if engine.live and rng.random() < 0.05:
            seq_id = rng.choice(sorted(engine.live))
            assert engine.cancel(seq_id)
            done.cancelled.add(seq_id)
        done.prefix_hit_tokens += engine.step().num_prefix_hit_tokens
    engine.run()
    assert engine.scheduler.num_free_blocks == engine.config.num_blocks
    completed = [seq for seq in done.added if seq.seq_id not in done.cancelled]
    assert set(engine.outputs) == {seq.seq_id for seq in completed}
    assert_outputs_match_reference(engine, completed)
    return done
