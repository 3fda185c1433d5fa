"""The generation engine's standing-queue rule (services/gpu_worker/generation/
standing_shedding.py) over a real scheduler's waiting queue: a burst that drains within the
interval is never refused; a queue whose oldest online sequence stays above the target for a
whole SLO refuses new online requests while a wait above the target is queued; `batch`
requests never are; refusals hold the standing."""

from __future__ import annotations

import pytest

from services.common.priority import PriorityClass
from services.gpu_worker.admission import Admitted
from services.gpu_worker.generation.first_token import (
    FIRST_TOKEN_DEADLINE,
    STANDING_QUEUE,
    FirstTokenRefusal,
)
from services.gpu_worker.generation.scheduler import GenerationScheduler
from services.gpu_worker.generation.sequence import Sequence
from services.gpu_worker.generation.standing_shedding import StandingShedding, admission_refusal
from tests.support.fake_generation import FakeEngine, make_config, make_seq

pytestmark = pytest.mark.unit

SLO_S = 2.0  # tiny-llama's: target 0.2 s, interval 2 s, hold 8 s
CRITICAL, INTERACTIVE, BATCH = (c.rank for c in PriorityClass)


def waiting(arrivals: dict[int, tuple[float, int]]) -> GenerationScheduler:
    """A scheduler whose sequences (seq_id -> (arrival, priority)) all wait: none scheduled."""
    scheduler = GenerationScheduler(make_config())
    for seq_id, (arrival_s, priority) in arrivals.items():
        scheduler.add(make_seq(seq_id=seq_id, arrival_s=arrival_s, priority=priority))
    return scheduler


def plan_every(shedding: StandingShedding, scheduler: GenerationScheduler, until_s: float) -> None:
    """Steps planned every 10 ms from 0 until `until_s`, the waiting queue left as it is."""
    for i in range(round(until_s / 0.01) + 1):
        shedding.planned(i * 0.01, scheduler)


def stood(shedding: StandingShedding) -> GenerationScheduler:
    """An online sequence waiting since 0, observed until its queue stands (interval 2 s)."""
    scheduler = waiting({1: (0.0, INTERACTIVE)})
    plan_every(shedding, scheduler, 1.9)
    assert not shedding.queue.is_standing
    plan_every(shedding, scheduler, 2.3)
    assert shedding.queue.is_standing
    return scheduler


def test_a_burst_that_drains_within_the_interval_is_never_refused() -> None:
    shedding = StandingShedding(SLO_S)
    scheduler = waiting({i: (0.0, INTERACTIVE) for i in range(1, 33)})

    plan_every(shedding, scheduler, 1.9)  # waited far above the target, not for an interval
    assert shedding.refusal(1.9, INTERACTIVE, "", scheduler) is None
    for seq_id in range(1, 33):
        scheduler.finish(seq_id)
    shedding.planned(1.95, scheduler)  # drained
    scheduler.add(make_seq(seq_id=40, arrival_s=1.96))
    for now_s in (2.0, 2.5, 3.0):
        shedding.planned(now_s, scheduler)
    assert not shedding.queue.is_standing
    assert shedding.refusal(3.0, INTERACTIVE, "", scheduler) is None


def test_a_standing_queue_refuses_new_online_requests_with_the_oldest_wait_as_hint() -> None:
    shedding = StandingShedding(SLO_S)
    scheduler = stood(shedding)  # an interactive sequence waiting since 0

    refusal = shedding.refusal(2.5, INTERACTIVE, "", scheduler)
    assert refusal is not None
    assert refusal.reason == STANDING_QUEUE
    assert refusal.retry_after_s == pytest.approx(2.5)
    assert "stands" in refusal.message
    # `batch` requests queue up to their deadline; a critical one waits behind no interactive
    # one (the scheduler admits the more urgent class first).
    assert shedding.refusal(2.5, BATCH, "", scheduler) is None
    assert shedding.refusal(2.5, CRITICAL, "", scheduler) is None
    # Behind a critical wait above the target, both online classes are refused.
    scheduler.add(make_seq(seq_id=2, arrival_s=2.0, priority=CRITICAL))
    # Each hint is the oldest wait ahead: the critical one's 0.5 s, the interactive one's 2.5 s.
    for rank, waited_s in ((CRITICAL, 0.5), (INTERACTIVE, 2.5)):
        refusal = shedding.refusal(2.5, rank, "", scheduler)
        assert refusal is not None and refusal.retry_after_s == pytest.approx(waited_s)


def serve(
    shedding: StandingShedding, arrivals: list[Sequence], until_s: float, **config: int
) -> FakeEngine:
    """A fake engine of two sequence slots (and `config`), stepped every 10 ms from 0 until
    `until_s`, each of `arrivals` added at its arrival, and each plan observed by `shedding`."""
    engine = FakeEngine(make_config(max_num_seqs=2, **config))
    pending = sorted(arrivals, key=lambda seq: seq.arrival_s)
    for i in range(round(until_s / 0.01) + 1):
        now_s = i * 0.01
        while pending and pending[0].arrival_s <= now_s:
            assert isinstance(engine.add(pending.pop(0)), Admitted)
        if engine.scheduler.has_unfinished():
            engine.step()
        shedding.planned(now_s, engine.scheduler)
    return engine


def test_a_tenant_is_refused_behind_its_own_backlog_not_another_tenants() -> None:
    shedding = StandingShedding(SLO_S)
    flood = [
        make_seq(seq_id=i, arrival_s=0.0, priority=INTERACTIVE, tenant="flood")
        for i in range(1, 201)
    ]
    scheduler = serve(shedding, flood, 2.5).scheduler  # 4 s of work for two seats
    assert shedding.queue.is_standing

    assert shedding.refusal(2.5, INTERACTIVE, "flood", scheduler) is not None
    # Another tenant joins at the flood's compute, behind the flood's first sequence only,
    # which the next admission takes (the newcomer waits for it anyway), and charges the
    # flood past the newcomer: nothing to count.
    assert shedding.refusal(2.5, INTERACTIVE, "quiet", scheduler) is None
    # Steps go on for a second with nothing admitted (every seat busy): the admission rate
    # falls, but one first ahead still counts nothing.
    for i in range(1, 101):
        shedding.planned(2.5 + i * 0.01, scheduler)
    assert shedding.refusal(3.5, INTERACTIVE, "quiet", scheduler) is None
    scheduler.add(make_seq(seq_id=300, arrival_s=2.5, priority=INTERACTIVE, tenant="quiet"))
    assert shedding.refusal(2.55, INTERACTIVE, "quiet", scheduler) is None  # 50 ms: within
    assert shedding.refusal(2.8, INTERACTIVE, "quiet", scheduler) is not None  # its own


def test_a_new_tenant_waits_behind_no_tenant_with_more_compute_than_where_it_joins() -> None:
    shedding = StandingShedding(SLO_S)
    # Ten heavy tenants (weight 0.001: a token costs them 1,000) ran a sequence each at the
    # start; their second ones then wait for good behind a light tenant's backlog, which the
    # scheduler admits one after another (less compute).
    heavy = [
        make_seq(
            seq_id=i + 1000 * n,
            arrival_s=n * 0.05,
            priority=INTERACTIVE,
            tenant=f"heavy{i}",
            weight=0.001,
        )
        for i in range(10)
        for n in (0, 1)
    ]
    light = [
        make_seq(seq_id=i, arrival_s=0.0, priority=INTERACTIVE, tenant="light")
        for i in range(10, 210)
    ]
    scheduler = serve(shedding, [*heavy, *light], 2.5).scheduler
    assert shedding.queue.is_standing
    assert [scheduler.get(1000 + i).num_computed_tokens for i in range(10)] == [0] * 10
    assert scheduler.compute_s("quiet", joining=True) < scheduler.compute_s("heavy0")

    # A new tenant joins at the light one's compute: ahead of the heavy ones' firsts (ten
    # admissions: some 0.25 s), behind the light one's first only.
    assert shedding.refusal(2.5, INTERACTIVE, "light", scheduler) is not None
    assert shedding.refusal(2.5, INTERACTIVE, "quiet", scheduler) is None


def test_a_new_tenant_is_refused_behind_many_one_stream_tenants_at_the_floor() -> None:
    shedding = StandingShedding(SLO_S)
    # From 0.5 s, 100 one-stream tenants a second; beside a tenant streaming all along, the
    # engine serves about 25 a second. Each joins at the floor: the least compute among the
    # tenants with sequences here, the streaming one's when the first joins. A tenant served
    # at the start at weight 10 stays far below it.
    early = make_seq(seq_id=0, arrival_s=0.0, priority=INTERACTIVE, tenant="early", weight=10.0)
    along = make_seq(seq_id=1000, arrival_s=0.0, max_tokens=400, tenant="along")
    arrivals = [
        make_seq(seq_id=i, arrival_s=0.5 + i * 0.01, priority=INTERACTIVE, tenant=f"t{i}")
        for i in range(1, 250)
    ]
    config = {"num_blocks": 512, "max_model_len": 1024}
    scheduler = serve(shedding, [early, along, *arrivals], 3.0, **config).scheduler
    assert shedding.queue.is_standing
    assert scheduler.num_waiting > 100

    # Each waits at the floor a new tenant joins at, ahead of it by arrival: the new one would
    # wait behind them all, one admission each, so it is refused. The hint is the wait
    # counted up to the first past the target (about 25 admissions a second).
    refusal = shedding.refusal(3.0, INTERACTIVE, "fresh", scheduler)
    assert refusal is not None
    assert shedding.queue.target_s < refusal.retry_after_s < shedding.queue.target_s + 0.1
    # So is the early tenant: it rejoins at the floor, not at its own compute.
    assert scheduler.get(0) is None
    assert scheduler.compute_s("early") < scheduler.compute_s("early", joining=True)
    assert shedding.refusal(3.0, INTERACTIVE, "early", scheduler) is not None
    # A critical request waits behind none of them.
    assert shedding.refusal(3.0, CRITICAL, "fresh", scheduler) is None


def test_a_preempted_sequence_that_streamed_tokens_is_not_a_wait() -> None:
    shedding = StandingShedding(SLO_S)
    scheduler = GenerationScheduler(make_config())
    preempted = make_seq(seq_id=1, arrival_s=0.0, priority=INTERACTIVE)
    preempted.output_token_ids.extend((3, 4))  # ran from 0, then was preempted
    scheduler.add(preempted)

    plan_every(shedding, scheduler, 5.0)
    assert not shedding.queue.is_standing
    assert shedding.expired(5.0, scheduler) == {}


def test_only_online_waits_count_and_a_drained_head_admits_while_standing() -> None:
    shedding = StandingShedding(SLO_S)
    scheduler = waiting({1: (0.0, BATCH)})
    plan_every(shedding, scheduler, 5.0)  # a batch backlog of 5 s stands nothing
    assert not shedding.queue.is_standing

    shedding = StandingShedding(SLO_S)
    scheduler = stood(shedding)
    scheduler.finish(1)
    scheduler.add(make_seq(seq_id=2, arrival_s=2.3, priority=INTERACTIVE))
    # Still standing (held), but the oldest online wait is within the target: admitted.
    assert shedding.refusal(2.45, INTERACTIVE, "", scheduler) is None
    assert shedding.queue.is_standing
    # Once it has waited above the target, new ones are refused again, with no new interval.
    assert shedding.refusal(2.6, INTERACTIVE, "", scheduler) is not None


def test_refusals_hold_the_standing_and_it_ends_a_hold_after_the_last() -> None:
    shedding = StandingShedding(SLO_S)
    scheduler = stood(shedding)
    hold_s = shedding.queue.hold_s
    assert hold_s == pytest.approx(8.0)
    # The queue's own waits stay within the target from 2.3 on (refusals keep it short) ...
    scheduler.finish(1)
    scheduler.add(make_seq(seq_id=2, arrival_s=9.95, priority=INTERACTIVE))
    assert shedding.refusal(10.2, INTERACTIVE, "", scheduler) is not None  # refused at 10.2
    shedding.planned(10.25, waiting({}))
    # ... so it stands a hold past the last refusal, not past the last wait above the target.
    shedding.planned(2.3 + hold_s + 0.1, waiting({}))
    assert shedding.queue.is_standing
    shedding.planned(10.2 + hold_s + 0.1, waiting({}))
    assert not shedding.queue.is_standing
    # A new backlog then waits a whole interval before it is refused.
    late = waiting({3: (20.0, INTERACTIVE)})
    shedding.planned(20.5, late)
    assert shedding.refusal(20.5, INTERACTIVE, "", late) is None


def test_a_standing_queue_drops_the_online_sequences_that_waited_past_the_slo_unrun() -> None:
    shedding = StandingShedding(SLO_S)
    scheduler = waiting(
        {
            1: (0.0, INTERACTIVE),  # past the SLO at 2.5: dropped
            2: (0.4, CRITICAL),  # likewise
            3: (0.3, BATCH),  # `batch`: queues to its deadline
            4: (1.0, INTERACTIVE),  # within the SLO at 2.5
        }
    )
    preempted = make_seq(seq_id=5, arrival_s=0.1, priority=INTERACTIVE)
    preempted.output_token_ids.append(7)  # streamed a token before its preemption
    scheduler.add(preempted)
    assert shedding.expired(2.5, scheduler) == {}  # not standing (yet): nothing goes

    plan_every(shedding, scheduler, 2.3)
    assert shedding.queue.is_standing
    expired = dict(shedding.expired(2.5, scheduler))

    assert sorted(expired) == [1, 2]
    assert expired[1].reason == STANDING_QUEUE
    assert expired[1].retry_after_s == pytest.approx(2.5)
    assert expired[2].retry_after_s == pytest.approx(2.1)
    assert "dropped unrun" in expired[1].message


def test_an_engine_that_admits_nothing_counts_an_admission_an_slo() -> None:
    """Every seat busy for good: the admission rate measured is 0, and is taken as one an SLO
    (a queue that admits none for longer stands still), so one other tenant's first ahead
    counts nothing (the next admission takes it) and each further one a whole SLO."""
    shedding = StandingShedding(SLO_S)
    scheduler = GenerationScheduler(make_config())
    for seq_id, tenant in ((1, "a"), (2, "b")):
        scheduler.add(make_seq(seq_id=seq_id, arrival_s=0.0, priority=INTERACTIVE, tenant=tenant))
    plan_every(shedding, scheduler, 5.0)  # nothing is admitted
    assert shedding.queue.is_standing

    refusal = shedding.refusal(5.0, INTERACTIVE, "fresh", scheduler)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(SLO_S)
    scheduler.finish(2)  # one first ahead: the next admission takes it
    assert shedding.refusal(5.0, INTERACTIVE, "fresh", scheduler) is None


def test_a_batch_backlog_is_not_ahead_of_an_urgent_requests_first_token() -> None:
    """The first-token prediction counts the prefill the scheduler runs before the new prompt:
    the rest of each running prompt (nothing preempts a running sequence to seat it), and the
    waiting sequences of its class or more urgent. A `batch` backlog waiting is not ahead of a
    critical or interactive request (the scheduler admits by class), so one whose deadline
    allows a few steps is admitted; a `batch` request behind it is refused. Before, every
    prompt without a first token counted, whatever its class, and refused the critical one."""
    scheduler = GenerationScheduler(make_config(max_num_seqs=1, max_num_batched_tokens=16))
    scheduler.add(make_seq(seq_id=1, arrival_s=0.0, num_prompt_tokens=40, priority=BATCH))
    scheduler.schedule()  # seq 1 runs: 16 of its 40 prompt tokens computed in this step
    scheduler.update_from_output({})
    for seq_id in range(2, 12):  # ten batch prompts of 20 waiting: 200 tokens
        scheduler.add(make_seq(seq_id=seq_id, arrival_s=0.1, num_prompt_tokens=20, priority=BATCH))
    scheduler.add(make_seq(seq_id=12, arrival_s=0.2, num_prompt_tokens=8, priority=INTERACTIVE))

    assert scheduler.prefill_tokens_ahead_of(CRITICAL) == 40 - 16
    assert scheduler.prefill_tokens_ahead_of(INTERACTIVE) == 40 - 16 + 8
    assert scheduler.prefill_tokens_ahead_of(BATCH) == 40 - 16 + 8 + 200

    def refusal(rank: int) -> object:
        # 16 tokens a step, 1 running: 15 a step for prefill; 10 ms a step; 100 ms allowed.
        return admission_refusal(
            None, scheduler, now_s=0.3, rank=rank, tenant="", limit_s=0.1,
            num_prompt_tokens=8, step_s=0.01,
        )  # fmt: skip

    assert refusal(CRITICAL) is None  # (24 + 8) / 15: 3 steps, 30 ms
    assert refusal(INTERACTIVE) is None  # (32 + 8) / 15: 3 steps
    batch = refusal(BATCH)  # (232 + 8) / 15: 16 steps, 160 ms
    assert isinstance(batch, FirstTokenRefusal) and batch.reason == FIRST_TOKEN_DEADLINE, batch
