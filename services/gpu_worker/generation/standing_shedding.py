"""When a generation engine refuses an online request because its waiting queue stands.

The first-token rule (first_token.py) refuses a request predicted to miss its caller's
deadline. A caller that allows minutes is admitted behind any backlog, though: an HTTP client
sends no deadline (its stream gets the model's `default_timeout_ms`, five minutes for
tiny-llama). Past the engine's capacity, every first token then comes late, and the callers
that give up first leave their places to others who are just as late (issue 33).

So the engine applies CoDel's test to its waiting queue, derived from the model's
time-to-first-token SLO as the batcher's lanes derive theirs (batching.slo_shedding.
standing_queue_for). After each step's plan, it observes how long the oldest online
(critical or interactive) sequence still waiting has waited, or 0 when none waits. The queue
stands once that has stayed above a tenth of the SLO for a whole SLO. While it stands:
- A new online request is refused with a retry hint when it would wait above the target
  behind others, even where its caller's deadline would allow more. It waits behind every
  more urgent class and its own tenant's sequences of its class (as long as the oldest of
  them has waited), and behind the first of each other tenant's there with no more compute
  than its own (one admission each, at the rate the engine admits sequences, the next
  admission's aside: `wait_ahead_above_target_s`). So a critical request is not refused
  behind interactive ones, nor a tenant within its share behind another tenant's flood, but
  a new tenant is, behind many one-stream tenants that all wait at the fair-share floor it
  joins at. The hint is that wait.
- Before each plan, an online sequence that has waited past the SLO with no token yet is
  dropped unrun, with the same status: its first token is late already, and its place can
  serve a request in time (CoDel drops at the head). Without this, what was admitted during
  the first interval, before the queue stood, waited for the whole flood (16 s at 10x).
- Each refusal holds the standing (StandingQueue.hold), since the queue is short only because
  it refuses.

A burst drains within the interval: it is served whole. `batch` requests queue up to their
deadline; they are never counted, refused or dropped. Neither is a preempted sequence that
has streamed tokens: it waits again, but from its own arrival, which is not when it began to
wait.

What a tenant's own earlier sequences and more urgent ones have waited counts whole, waits
for a free seat included: as CoDel's target must exceed one packet's transmission, the target
should exceed the longest gap between two admissions (about a sequence's run where seats free
together; tiny-llama's steps are a few ms against a 200 ms target). Other tenants' firsts are
counted, not timed: a tenant within its share is not refused behind the one sequence of a
flood that the next admission takes, however slowly seats free, nor behind floods that take
turns above its compute. (Timing each first while others left ahead of it did refuse there:
the others had been ahead of it then, not of the newcomer now.)

Pure: time comes in as `now_s`. The engine and the simulator's generation worker
(services.sim.generation) use it alike.
"""

from __future__ import annotations

import math

from services.common.priority import PriorityClass
from services.gpu_worker.batching.slo_shedding import standing_queue_for
from services.gpu_worker.generation.first_token import (
    STANDING_QUEUE,
    FirstTokenRefusal,
    deadline_refusal,
    predicted_first_token_s,
)
from services.gpu_worker.generation.scheduler import GenerationScheduler

#: Requests at this rank or more urgent are online traffic.
ONLINE_RANK = PriorityClass.INTERACTIVE.rank


class StandingShedding:
    """One engine's rule, for a model whose time-to-first-token SLO is `slo_s`."""

    def __init__(self, slo_s: float) -> None:
        self.slo_s = slo_s
        self.queue = standing_queue_for(slo_s)
        self._planned_s = -math.inf
        #: Sequences admitted from the waiting queue per second, decaying over an SLO, and how
        #: many had been by the last plan (`WaitingSequences.num_admitted`). Drops and cancels
        #: do not count: they free no seat, and would make the queue look faster.
        self._admit_rate_per_s = 0.0
        self._num_admitted = 0

    def expired(self, now_s: float, scheduler: GenerationScheduler) -> dict[int, FirstTokenRefusal]:
        """While the queue stands: the online sequences of `scheduler` that have waited past
        the SLO at `now_s` with no token yet, by seq_id, each with its refusal. Their first
        tokens are late already, so they go before the next plan, unrun, and leave their
        places to requests that can still be served in time (CoDel drops at the head)."""
        expired: dict[int, FirstTokenRefusal] = {}
        if not self.queue.is_standing:
            return expired
        for seq in scheduler.waiting.waited_since(now_s - self.slo_s, ONLINE_RANK):
            waited_s = now_s - seq.arrival_s
            message = (
                f"generation request dropped unrun: it waited {waited_s:.3f}s for its first"
                f" token, past the model's {self.slo_s:.3f}s objective, while the waiting queue"
                " stands"
            )
            expired[seq.seq_id] = FirstTokenRefusal(STANDING_QUEUE, message, waited_s)
        return expired

    def planned(self, now_s: float, scheduler: GenerationScheduler) -> None:
        """`scheduler` planned a step at `now_s`: what it left waiting is observed, and the
        rate at which it admits sequences (`_admit_rate_per_s`)."""
        waiting = scheduler.waiting
        oldest_s = waiting.oldest_arrival_s(ONLINE_RANK)
        self.queue.observe(now_s, 0.0 if oldest_s is None else now_s - oldest_s)
        elapsed_s = now_s - self._planned_s
        if elapsed_s <= 0.0:
            return  # a second plan at the same instant: its admissions count with the next
        if math.isfinite(elapsed_s):
            rate_per_s = (waiting.num_admitted - self._num_admitted) / elapsed_s
            alpha = -math.expm1(-elapsed_s / self.slo_s)
            self._admit_rate_per_s += alpha * (rate_per_s - self._admit_rate_per_s)
        self._planned_s, self._num_admitted = now_s, waiting.num_admitted

    def wait_ahead_above_target_s(
        self, now_s: float, rank: int, tenant: str, scheduler: GenerationScheduler
    ) -> float | None:
        """How long a new sequence of priority `rank` from `tenant` would wait behind others,
        when that is above the target at `now_s`, else None. The scheduler admits by class,
        then the tenant with the least compute, then arrival (`WaitingSequences.next`), and
        charges a tenant as its sequences run. So the new one waits behind:
        - every more urgent sequence and its own tenant's earlier ones: as long as the oldest
          of them has waited (CoDel's sojourn);
        - the first sequence of each other tenant of its class with no more compute than its
          own, since once that runs its tenant has more: one admission each, at the rate
          the engine admits sequences. The first of them goes at the next admission, which the
          new one waits for anyway (a free seat), so it does not count.
        Many one-stream tenants, all at the floor a new tenant joins at, count one each; a
        flood beside a quiet tenant counts its first only, and several floods in turn only
        those at the floor. The count stops once it is above the target."""
        waiting, target_s = scheduler.waiting, self.queue.target_s
        own = waiting.head(rank, tenant)
        arrivals = (waiting.oldest_arrival_s(rank - 1), None if own is None else own.arrival_s)
        waited_s = max((now_s - s for s in arrivals if s is not None), default=0.0)
        if waited_s > target_s:
            return waited_s
        # At least one admission an SLO: a queue that admits none for longer stands still.
        admit_rate_per_s = max(self._admit_rate_per_s, 1.0 / self.slo_s)
        own_compute_s, is_lifted, num_ahead = scheduler.compute_s(tenant), False, 0
        for other, _ in waiting.class_heads(rank):
            if other == tenant:
                continue
            other_compute_s = scheduler.compute_s(other)
            if other_compute_s > own_compute_s and not is_lifted:
                # Where the tenant would join (the ledger's floor): a look per tenant waiting,
                # so only when its own compute does not settle it.
                own_compute_s, is_lifted = scheduler.compute_s(tenant, joining=True), True
            if other_compute_s <= own_compute_s:
                num_ahead += 1
                if (ahead_s := (num_ahead - 1) / admit_rate_per_s) > target_s:
                    return ahead_s
        return None

    def refusal(
        self, now_s: float, rank: int, tenant: str, scheduler: GenerationScheduler
    ) -> FirstTokenRefusal | None:
        """The refusal of a new request of priority `rank` from `tenant` arriving at `now_s` at
        `scheduler`, or None: refused when it would wait above the target behind others
        (`wait_ahead_above_target_s`), which is its retry hint."""
        if rank > ONLINE_RANK or not self.queue.is_standing:
            return None
        waited_s = self.wait_ahead_above_target_s(now_s, rank, tenant, scheduler)
        if waited_s is None:
            return None
        self.queue.hold(now_s)
        message = (
            "generation request refused: the waiting queue stands (it would wait"
            f" {waited_s:.3f}s behind others for its first token)"
        )
        return FirstTokenRefusal(STANDING_QUEUE, message, waited_s)


def admission_refusal(
    shedding: StandingShedding | None,
    scheduler: GenerationScheduler,
    *,
    now_s: float,
    rank: int,
    tenant: str,
    limit_s: float | None,
    num_prompt_tokens: int,
    step_s: float,
) -> FirstTokenRefusal | None:
    """Why a new request of priority `rank` from `tenant` is refused before it is queued, or
    None: behind a standing queue (`shedding`; None: never), or predicted to see its first
    token past `limit_s` (None: no limit) at `step_s` a step (first_token.py), behind the
    prefill the scheduler runs before it (`prefill_tokens_ahead_of`: running prompts, and
    waiting ones as urgent or more; a `batch` backlog is not ahead of an interactive request).
    The engine and the simulator's worker admit by it."""
    refusal = shedding.refusal(now_s, rank, tenant, scheduler) if shedding is not None else None
    if refusal is None and limit_s is not None:
        predicted_s = predicted_first_token_s(
            num_waiting_tokens=scheduler.prefill_tokens_ahead_of(rank),
            num_running=scheduler.num_running,
            num_prompt_tokens=num_prompt_tokens,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            step_s=step_s,
        )
        refusal = deadline_refusal(predicted_s, limit_s)
    return refusal
