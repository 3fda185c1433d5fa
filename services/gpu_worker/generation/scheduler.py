"""Iteration-level scheduling of generation: which tokens of which sequences run this step.

Follows vLLM v1's scheduler. Every sequence tracks `num_computed_tokens` (the leading tokens
whose KV is in the cache), and each step hands every sequence some of its uncomputed tokens under
one token budget, so single-token decodes and prefill chunks share a forward pass. Finished
sequences leave and waiting ones join between any two steps (continuous batching).

The binding resource is KV-cache memory, in paged blocks (`BlockAllocator`). Admission is by
free blocks; when a running sequence cannot grow, the lowest-priority running sequence is
preempted: its blocks are freed and, later, it is recomputed from its prompt plus the tokens it
already produced, so its output continues where it left off.

With prefix caching on, every full block a sequence computes is remembered under the digest of its
tokens and all before them (`prefix_cache`), and an admitted sequence shares the remembered blocks
of its leading full blocks instead of computing them: its prefill starts past them (a sequence
recomputed after a preemption finds its own blocks again while nobody reused them).

Synchronous and pure. The engine loop reads schedule() -> run the model -> update_from_output(),
and calls finish() whenever it decides a sequence stops (length, eos, stop string, cancel, error).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

from services.gpu_worker.admission import Admitted, Rejected, RejectReason
from services.gpu_worker.batching.fair_share import ComputeLedger, check_weight
from services.gpu_worker.generation.block_allocator import BlockAllocator
from services.gpu_worker.generation.prefix_cache import cached_prefix_of, remember_filled_blocks
from services.gpu_worker.generation.scheduler_config import (
    GenerationSchedulerConfig,
    check_config,
)
from services.gpu_worker.generation.sequence import (
    ScheduledSequence,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
)
from services.gpu_worker.generation.waiting import WaitingSequences


def _order(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival_s, seq.seq_id)


def _num_uncomputed(seq: Sequence) -> int:
    return seq.num_tokens - seq.num_computed_tokens


class GenerationScheduler:
    """Waiting and running sequences of one model, their KV blocks, and each step's plan."""

    def __init__(self, config: GenerationSchedulerConfig) -> None:
        """Raises ValueError if `config` is inconsistent."""
        check_config(config)
        self._config = config
        self._allocator = BlockAllocator(config.num_blocks, config.block_size)
        self._caches = config.enable_prefix_caching
        self._seqs: dict[int, Sequence] = {}
        # Running sequences sorted by _order: the last is the first to be preempted. A
        # preempted one re-enters waiting by its original arrival, ahead of later ones.
        self._waiting = WaitingSequences()
        # Tokens computed per tenant, per weight: fair share among waiting sequences.
        self._ledger = ComputeLedger()
        self._running: list[Sequence] = []
        # The last schedule()'s work, until update_from_output() accounts for it.
        self._in_flight: dict[int, ScheduledSequence] = {}
        # This schedule()'s admissions: tokens looked up in the prefix cache, and found.
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0

    @property
    def num_waiting(self) -> int:  # sequences waiting for admission (new or preempted)
        return len(self._waiting)

    @property
    def waiting(self) -> WaitingSequences:
        """The sequences waiting for admission, to read (never to change)."""
        return self._waiting

    def compute_s(self, tenant: str, *, joining: bool = False) -> float:
        """The tenant's tokens computed per weight, by which its waiting sequences are ranked;
        `joining`: as a new sequence of its would be ranked (a tenant with none here joins at
        the least among those with some: fair_share.ComputeLedger). Reads, changes nothing."""
        virtual_s = self._ledger.virtual_s(tenant)
        return max(virtual_s, self._ledger.lowest_s()) if joining else virtual_s

    @property
    def num_running(self) -> int:  # sequences holding KV blocks
        return len(self._running)

    @property
    def is_prefilling(self) -> bool:
        """Whether a running sequence has prompt tokens left to compute (chunked prefill): the
        next step carries a prompt chunk whatever is admitted."""
        return any(_num_uncomputed(seq) > 1 for seq in self._running)

    def prefill_tokens_ahead_of(self, priority: int) -> int:
        """Tokens computed before a new prompt of `priority` starts: the rest of each running
        prompt (one of a less urgent class preempted to seat it counted too), a preempted
        sequence's recompute of its prompt and outputs among them, then waiting sequences as
        urgent or more."""
        started = sum(n for s in self._running
                      if (n := _num_uncomputed(s)) > 1 or not s.output_token_ids)  # fmt: skip
        return started + self._waiting.num_tokens_at_most(priority)

    @property
    def max_num_batched_tokens(self) -> int:
        """Tokens one step may compute (decodes and prefill chunks together)."""
        return self._config.max_num_batched_tokens

    @property
    def num_free_blocks(self) -> int:
        """KV blocks owned by no sequence (prefix-cached ones included: they can be reused)."""
        return self._allocator.num_free

    @property
    def num_cached_blocks(self) -> int:
        """KV blocks the prefix cache remembers, owned or free."""
        return self._allocator.num_cached

    def get(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence `seq_id`, or None."""
        return self._seqs.get(seq_id)

    def has_sent(self, item: ScheduledSequence) -> bool:
        """Whether the sequence of `item` has produced tokens (its stream sent them)."""
        return bool((seq := self._seqs.get(item.seq_id)) and seq.output_token_ids)

    def has_unfinished(self) -> bool:
        """True while any sequence is waiting or running."""
        return bool(self._seqs)

    def add(self, seq: Sequence) -> Admitted | Rejected:
        """Queue a new sequence (Admitted: it appears in a later SchedulerOutput), or say why it
        can never run with this configuration (Rejected: nothing was queued). Raises ValueError
        on a duplicate seq_id or a sequence that is not new (caller bugs)."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} is not new")
        refusal = self.refusal(seq)
        if refusal is not None:
            return refusal
        check_weight(seq.weight)
        self._seqs[seq.seq_id] = seq
        self._waiting.add(seq)
        self._ledger.join(seq.tenant)
        return Admitted()

    def room_for(self, num_prompt: int) -> int:
        """The most tokens a prompt of `num_prompt` may be followed by: up to `max_model_len`,
        and to what the whole cache holds (a sequence's last token is sampled, never fed
        back: `refusal`); at least 1 (a prompt with no room left is refused as too long)."""
        config = self._config
        longest = min(config.max_model_len, config.num_blocks * config.block_size + 1)
        return max(1, longest - num_prompt)

    def refusal(self, seq: Sequence) -> Rejected | None:
        """Why `seq` can never run with this configuration (`add` refuses it so), or None."""
        num_prompt = len(seq.prompt_token_ids)
        num_total = num_prompt + seq.max_tokens
        if num_prompt == 0:
            return Rejected(RejectReason.EMPTY_PROMPT, "empty prompt")
        if seq.max_tokens < 1:
            return Rejected(
                RejectReason.INVALID_MAX_TOKENS, f"max_tokens must be >= 1, got {seq.max_tokens}"
            )
        if num_total > self._config.max_model_len:
            return Rejected(
                RejectReason.TOO_LONG,
                f"prompt ({num_prompt} tokens) + max_tokens ({seq.max_tokens}) exceeds"
                f" max_model_len ({self._config.max_model_len})",
            )
        # Checked at the edge so that a lone sequence can always grow to the end: a sequence
        # that fits the whole cache never has to preempt itself forever. Its last token is
        # sampled and never fed back, so one position fewer than its length holds KV.
        num_needed = self._allocator.blocks_for(num_total - 1)
        if num_needed > self._config.num_blocks:
            return Rejected(
                RejectReason.EXCEEDS_KV_CACHE,
                f"needs {num_needed} KV blocks, the cache has {self._config.num_blocks}",
            )
        return None

    def schedule(self, *, admit: bool = True) -> SchedulerOutput:
        """Plan one step: running sequences first (priority order), preempting when blocks run
        out, then admissions unless `admit` is False (static mode: a new batch only when
        nothing runs). Raises
        RuntimeError if the previous step was not accounted for with update_from_output() (or
        its sequences finished)."""
        if self._in_flight:
            raise RuntimeError("schedule() called before update_from_output() of the last step")
        cfg = self._config
        self._num_queried_tokens = self._num_hit_tokens = 0
        if cfg.is_static and not self._running:
            self._admit_static_batch()
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[int] = []
        if admit and not cfg.is_static and self._waiting:
            self._seat_urgent(preempted)
        num_seated = len(preempted)  # made room for an admission: it is admitted below
        # Static batches decode only once every admitted prefill is done. (A prefill with one
        # token left looks like a decode; running it with the decodes costs the same.)
        is_prefill_only = cfg.is_static and any(_num_uncomputed(s) > 1 for s in self._running)
        i = 0
        # Preemption pops from the end of _running, so index i stays valid: victims are always
        # at or after it.
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            i += 1
            if is_prefill_only and _num_uncomputed(seq) <= 1:
                continue
            num_new = min(_num_uncomputed(seq), budget)
            if not self._grow(seq, num_new, preempted):
                break  # seq preempted itself: it was the last running sequence
            scheduled.append(self._plan(seq, num_new))
            budget -= num_new
        # Blocks freed by a preemption are for the running sequences' next steps; admitting
        # into them now would only cause the next preemption (vLLM v1 does the same).
        if admit and not cfg.is_static and len(preempted) == num_seated:
            self._admit_waiting(budget, scheduled)
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            preempted=tuple(preempted),
            num_batched_tokens=sum(len(s.token_ids) for s in scheduled),
            num_prefix_queried_tokens=self._num_queried_tokens,
            num_prefix_hit_tokens=self._num_hit_tokens,
        )

    def update_from_output(self, sampled: Mapping[int, int]) -> None:
        """Account for the last schedule(): its tokens are now computed, and each sequence that
        sampled gets its new token from `sampled` (seq_id -> token id; entries for sequences
        that did not sample are ignored). Sequences finished since schedule() are skipped.
        Raises KeyError, changing nothing, if a sampling sequence has no entry."""
        missing = [i for i, s in self._in_flight.items() if s.samples and i not in sampled]
        if missing:
            raise KeyError(f"no sampled token for sequences {missing}")
        in_flight, self._in_flight = self._in_flight, {}
        for seq_id, step in in_flight.items():
            seq = self._seqs[seq_id]
            start = seq.num_computed_tokens
            seq.num_computed_tokens += len(step.token_ids)
            # Charged once: not a recompute after a preemption (Sequence.num_charged_tokens).
            if (num_new := seq.num_computed_tokens - max(start, seq.num_charged_tokens)) > 0:
                self._ledger.charge(seq.tenant, num_new, seq.weight)
                seq.num_charged_tokens = seq.num_computed_tokens
            if step.samples:
                seq.output_token_ids.append(sampled[seq_id])
            if self._caches:
                remember_filled_blocks(seq, self._allocator, step.start_position)

    def finish(self, seq_id: int) -> bool:
        """Stop a waiting or running sequence now and free its blocks. True if it was known."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        self._ledger.leave(seq.tenant)
        # Finished mid-step (cancel, error): its in-flight work is dropped, not accounted.
        self._in_flight.pop(seq_id, None)
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        return True

    def _grow(self, seq: Sequence, num_new: int, preempted: list[int]) -> bool:
        """Give `seq` blocks for `num_new` more tokens, preempting from the back of the running
        order until they fit. False if `seq` itself had to be preempted."""
        num_needed = self._allocator.blocks_for(seq.num_computed_tokens + num_new) - len(
            seq.block_table
        )
        while not self._allocator.can_allocate(num_needed):
            victim = self._running[-1]
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return False
        seq.block_table.extend(self._allocator.allocate(num_needed))
        return True

    def _seat_urgent(self, preempted: list[int]) -> None:
        """The next waiting sequence takes the seats and blocks of running ones of a less urgent
        class (batch generations kept an interactive one waiting past its SLO: review finding),
        preempted from the least urgent and latest until its first chunk fits; none in vain."""
        seq, cfg, running = self._next_waiting(), self._config, self._running
        if not running or running[-1].priority <= seq.priority:
            return

        def num_short() -> tuple[int, int, list[int]]:  # seats, blocks it lacks; its prefix
            cached = cached_prefix_of(seq, self._allocator) if self._caches else []
            num_new = min(seq.num_tokens - len(cached) * cfg.block_size, cfg.max_num_batched_tokens)
            num_fresh = self._allocator.blocks_for(len(cached) * cfg.block_size + num_new)
            num_taken = num_fresh - len(cached) + self._allocator.num_free_among(cached)
            num_blocks = num_taken + cfg.watermark_blocks - self._allocator.num_free
            return len(running) + 1 - cfg.max_num_seqs, num_blocks, cached

        seats, blocks, cached = num_short()
        if seats <= 0 and blocks <= 0:  # it fits as it is
            return
        less_urgent = [s for s in running if s.priority > seq.priority]  # freed: none shared
        kept = {b for s in running if s.priority <= seq.priority for b in s.block_table} | {*cached}
        freed = {b for s in less_urgent for b in s.block_table} - kept
        if len(less_urgent) < seats or len(freed) < blocks:
            return
        while (seats > 0 or blocks > 0) and running and running[-1].priority > seq.priority:
            victim = running[-1]
            self._preempt(victim)
            preempted.append(victim.seq_id)
            seats, blocks, cached = num_short()

    def _preempt(self, seq: Sequence) -> None:
        """Free all of `seq`'s blocks; it is recomputed from all_token_ids once readmitted."""
        self._running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._waiting.add(seq)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSequence]) -> None:
        """Admit waiting sequences in order with a first chunk each, while seats, budget and
        blocks last. The first that does not fit stops admission: no overtaking."""
        cfg = self._config
        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            seq = self._next_waiting()
            cached = cached_prefix_of(seq, self._allocator) if self._caches else []
            num_cached = len(cached) * cfg.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            num_fresh = self._allocator.blocks_for(num_cached + num_new) - len(cached)
            # With nothing running the headroom protects nobody, and keeping it could leave a
            # sequence that fits the cache waiting forever.
            headroom = cfg.watermark_blocks if self._running else 0
            num_taken = num_fresh + self._allocator.num_free_among(cached)
            if not self._allocator.can_allocate(num_taken + headroom):
                break
            self._waiting.admit(seq)
            self._start_running(seq, cached, num_fresh)
            scheduled.append(self._plan(seq, num_new))
            budget -= num_new

    def _admit_static_batch(self) -> None:
        """Form the next static batch: waiting sequences in order while seats last and the
        blocks of all their prefills fit. Blocks are taken chunk by chunk as prefill runs."""
        cfg = self._config
        num_reserved = 0
        while self._waiting and len(self._running) < cfg.max_num_seqs:
            seq = self._next_waiting()
            cached = cached_prefix_of(seq, self._allocator) if self._caches else []
            headroom = cfg.watermark_blocks if self._running else 0
            num_needed = self._allocator.blocks_for(seq.num_tokens) - len(cached)
            num_taken = num_needed + self._allocator.num_free_among(cached)
            if num_reserved + num_taken + headroom > self._allocator.num_free:
                break
            self._waiting.admit(seq)
            self._start_running(seq, cached, 0)
            num_reserved += num_needed

    def _free_blocks(self, seq: Sequence) -> None:
        """Gives up `seq`'s blocks, tail first: free blocks are reused least recently freed
        first, so the blocks nearest the start of a prompt, which more sequences share, are the
        last of it the prefix cache forgets (vLLM does the same)."""
        self._allocator.free(reversed(seq.block_table))
        seq.block_table = []

    def _start_running(self, seq: Sequence, cached: list[int], num_fresh: int) -> None:
        """Moves an admitted `seq` (already out of waiting) to running: it shares the `cached`
        blocks of its leading tokens, whose KV it need not compute, and takes `num_fresh` free
        blocks after them."""
        self._allocator.share(cached)
        seq.block_table = cached + self._allocator.allocate(num_fresh)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self._config.block_size
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self._running, seq, key=_order)
        if self._caches:
            self._num_queried_tokens += seq.num_tokens
            self._num_hit_tokens += seq.num_computed_tokens

    def _next_waiting(self) -> Sequence:
        """The waiting sequence to admit next: the most urgent priority class, then the tenant
        with the fewest tokens computed per weight (fair_share.ComputeLedger, counted in
        tokens), then the earliest arrival."""
        return self._waiting.next(self._ledger.virtual_s)

    def _plan(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        step = ScheduledSequence(
            seq_id=seq.seq_id,
            token_ids=seq.token_slice(start, start + num_new),
            start_position=start,
            block_table=tuple(seq.block_table),
            samples=start + num_new == seq.num_tokens,
        )
        self._in_flight[seq.seq_id] = step
        return step
