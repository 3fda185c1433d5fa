"""WaitingSequences: the scheduler's backlog, grouped by priority class and tenant, must choose
exactly what a minimum over every waiting sequence chooses."""

from __future__ import annotations

import random

import pytest

from services.gpu_worker.generation.sequence import Sequence
from services.gpu_worker.generation.waiting import WaitingSequences

pytestmark = pytest.mark.unit


def _seq(seq_id: int, *, priority: int = 0, tenant: str = "", arrival_s: float = 0.0) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        prompt_token_ids=(1,),
        max_tokens=1,
        priority=priority,
        tenant=tenant,
        arrival_s=arrival_s,
    )


def test_the_next_sequence_is_the_least_over_the_whole_backlog_through_adds_and_removals() -> None:
    rng = random.Random(7)
    waiting = WaitingSequences()
    reference: list[Sequence] = []
    compute = {tenant: 0.0 for tenant in "abcd"}
    seq_ids = iter(range(1, 100_000))
    for _ in range(3_000):
        action = rng.random()
        if action < 0.45 or not reference:
            # Arrivals tie often (same clock reading), and a preempted sequence comes back
            # with an arrival earlier than the ones waiting.
            seq = _seq(
                next(seq_ids),
                priority=rng.choice((0, 1, 1, 2)),
                tenant=rng.choice("abcd"),
                arrival_s=float(rng.randrange(50)),
            )
            if rng.random() < 0.3:  # preempted after streaming a token: admitted, not a wait
                seq.output_token_ids.append(3)
            waiting.add(seq)
            reference.append(seq)
        elif action < 0.6:  # finished while waiting (a cancel)
            seq = rng.choice(reference)
            waiting.remove(seq)
            reference.remove(seq)
        else:  # admitted: the next one leaves; its tenant is charged
            expected = min(
                reference, key=lambda s: (s.priority, compute[s.tenant], s.arrival_s, s.seq_id)
            )
            chosen = waiting.next(compute.__getitem__)
            assert chosen is expected
            waiting.remove(chosen)
            reference.remove(chosen)
            compute[chosen.tenant] += rng.choice((0.5, 1.0, 3.0))
        assert len(waiting) == len(reference)
        assert bool(waiting) == bool(reference)
        unstarted = [s for s in reference if not s.output_token_ids]
        for rank in (0, 1, 2):
            oldest = min((s.arrival_s for s in unstarted if s.priority <= rank), default=None)
            assert waiting.oldest_arrival_s(rank) == oldest
            heads: dict[tuple[int, str], Sequence] = {}
            for s in sorted(unstarted, key=lambda s: (s.arrival_s, s.seq_id), reverse=True):
                if s.priority <= rank:
                    heads[s.priority, s.tenant] = s  # the group's earliest, last
            assert {(p, t): h for p, t, h in waiting.heads(rank)} == heads
            assert dict(waiting.class_heads(rank)) == {
                t: h for (p, t), h in heads.items() if p == rank
            }
            for tenant in "ab":
                assert waiting.head(rank, tenant) is heads.get((rank, tenant))


def test_removing_what_is_not_waiting_raises_and_changes_nothing() -> None:
    waiting = WaitingSequences()
    first, twin = _seq(1, tenant="a", arrival_s=1.0), _seq(1, tenant="a", arrival_s=1.0)
    waiting.add(first)
    with pytest.raises(ValueError, match="not waiting"):
        waiting.remove(twin)  # equal fields, another sequence: compared by identity
    with pytest.raises(ValueError, match="not waiting"):
        waiting.remove(_seq(2, tenant="b"))
    assert len(waiting) == 1
    assert waiting.next(lambda tenant: 0.0) is first
    waiting.remove(first)
    assert not waiting
    with pytest.raises(IndexError):
        waiting.next(lambda tenant: 0.0)


def test_only_admissions_count_as_admitted() -> None:
    """`num_admitted` counts the sequences taken out to run (the engine's admission rate, by
    which the standing rule counts the wait behind other tenants), each once: not those that
    finished while waiting (drops and cancels free no seat), nor a preempted one's return."""
    waiting = WaitingSequences()
    seqs = [_seq(i, tenant="a", arrival_s=float(i)) for i in range(1, 4)]
    for seq in seqs:
        waiting.add(seq)
    waiting.remove(seqs[1])  # cancelled, or dropped unrun
    waiting.admit(waiting.next(lambda tenant: 0.0))
    assert waiting.num_admitted == 1
    returned = _seq(9, tenant="b", arrival_s=0.5)
    returned.num_preemptions = 1  # ran, was preempted, and is admitted again
    waiting.add(returned)
    waiting.admit(returned)
    assert waiting.num_admitted == 1
    assert len(waiting) == 1
    with pytest.raises(ValueError, match="not waiting"):
        waiting.admit(seqs[1])
    assert waiting.num_admitted == 1


def test_tokens_by_class_follow_adds_admissions_and_removals() -> None:
    """`num_tokens_at_most`: the tokens of the sequences waiting at a priority or more urgent,
    a preempted one's outputs included (computed again once it runs), through random adds,
    admissions and removals, equal to a sum over the whole backlog."""
    rng = random.Random(11)
    waiting = WaitingSequences()
    queued: list[Sequence] = []
    for seq_id in range(400):
        if queued and rng.random() < 0.45:
            seq = queued.pop(rng.randrange(len(queued)))
            (waiting.admit if rng.random() < 0.5 else waiting.remove)(seq)
        else:
            seq = Sequence(
                seq_id=seq_id,
                prompt_token_ids=(1,) * rng.randint(1, 50),
                max_tokens=8,
                priority=rng.randrange(3),
                tenant=rng.choice("ab"),
                arrival_s=float(seq_id),
            )
            seq.output_token_ids.extend([2] * rng.choice((0, 0, 3)))  # some were preempted
            waiting.add(seq)
            queued.append(seq)
        for priority in range(3):
            expected = sum(s.num_tokens for s in queued if s.priority <= priority)
            assert waiting.num_tokens_at_most(priority) == expected
    for seq in queued:
        waiting.remove(seq)
    assert [waiting.num_tokens_at_most(p) for p in range(3)] == [0, 0, 0]
