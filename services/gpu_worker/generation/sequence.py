"""What the generation scheduler (scheduler.py) works on and hands out: a sequence, one
generation request as it tracks it (`Sequence`, `SequenceStatus`), and the plan of one step,
the work of each sequence in it (`SchedulerOutput` of `ScheduledSequence`s). Plain data."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation request. Owned and mutated by the scheduler once added; compared by
    identity."""

    seq_id: int
    prompt_token_ids: tuple[int, ...]
    #: Most tokens to generate. The engine, not the scheduler, finishes the sequence there.
    max_tokens: int
    #: Lower runs first; ties go to the earlier arrival_s, then the lower seq_id.
    priority: int = 0
    #: Who asked, and their fair-share weight: among waiting sequences of one priority, the
    #: tenant with the fewest tokens computed per weight is admitted first.
    tenant: str = ""
    weight: float = 1.0
    #: Seconds on the engine's monotonic clock.
    arrival_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    #: Leading tokens of all_token_ids whose KV is in the cache.
    num_computed_tokens: int = 0
    #: Physical KV blocks in position order: position p lives in block_table[p // block_size].
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    #: Prefix caching shares blocks only among sequences with the same salt.
    cache_salt: str = ""
    #: Digests of the leading full blocks of all_token_ids computed so far (prefix_cache);
    #: tokens only grow, so they stay valid.
    block_digests: list[bytes] = field(default_factory=list)
    #: Leading tokens whose KV its last admission found in the prefix cache.
    num_cached_tokens: int = 0
    #: Leading tokens of all_token_ids its tenant has been charged for computing (the fair
    #: share's ledger): a recompute after a preemption is not charged again.
    num_charged_tokens: int = 0

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        """Prompt followed by the tokens generated so far."""
        return (*self.prompt_token_ids, *self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """len(all_token_ids), without building it."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """all_token_ids[start:stop], without building the whole of it for a decode."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return tuple(self.output_token_ids[start - num_prompt : stop - num_prompt])
        return self.all_token_ids[start:stop]


class ScheduledSequence(NamedTuple):
    """The work of one sequence in one step (a named tuple: made for every sequence of every
    step, at a third of a frozen dataclass's cost)."""

    seq_id: int
    #: Tokens to compute: a prefill chunk, or for a decode the single last known token.
    token_ids: tuple[int, ...]
    #: Position of token_ids[0] in the sequence (its num_computed_tokens).
    start_position: int
    #: Blocks covering positions [0, start_position + len(token_ids)).
    block_table: tuple[int, ...]
    #: True when this step reaches the end of the known tokens: sample one new token from the
    #: logits of the last position.
    samples: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. No scheduled sequences means idle."""

    #: Running sequences (priority order) first, then sequences admitted this step.
    scheduled: tuple[ScheduledSequence, ...]
    #: Sequences preempted this step (blocks freed, back to waiting for recompute).
    preempted: tuple[int, ...]
    #: sum(len(s.token_ids)); never above max_num_batched_tokens.
    num_batched_tokens: int
    #: Known tokens of the sequences admitted this step, and how many of them the prefix
    #: cache held (hits / queries is its hit rate; both 0 with prefix caching off).
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
