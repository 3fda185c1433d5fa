"""One simulated generation worker: the real `GenerationScheduler`, driven as the engine
(services/gpu_worker/generation/engine.py) drives it, on simulated time.

The engine's loop, restated: `schedule()`; nothing scheduled, it sleeps until a request comes;
else the step runs, then `update_from_output(sampled)`, the sequences cancelled during the step
are finished, and each sampled token is emitted, a sequence finishing once it has `max_tokens`.
A request is admitted as the engine's `_admit` does: the length rule, the standing-queue and
first-token deadline rules (`standing_shedding.admission_refusal`, the prediction on the moving
mean step time), then `scheduler.add`. While the waiting queue stands, online sequences that
waited past the SLO are dropped before each plan (`StandingShedding.expired`), and each plan is
observed (`planned`), as the engine's loop does. A stream whose deadline passes is cancelled
(its blocks freed before the next step), as the gRPC cancellation does.

Not real: a step's duration comes from a cost model of its work (`StepCost`), not a forward
pass; tokens are one dummy id and every sequence runs to its drawn output length (ignore_eos:
no stop tokens or strings).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from services.common.priority import PriorityClass
from services.common.registry_schema import ModelRecord, WorkerRecord
from services.gpu_worker.admission import Rejected, RejectReason
from services.gpu_worker.generation.scheduler import GenerationScheduler
from services.gpu_worker.generation.scheduler_config import GenerationSchedulerConfig
from services.gpu_worker.generation.sequence import ScheduledSequence, SchedulerOutput, Sequence
from services.gpu_worker.generation.standing_shedding import StandingShedding, admission_refusal
from services.sim.events import EventLoop
from services.sim.traffic import Arrival

#: Every prompt and sampled token: only lengths matter to the scheduler.
DUMMY_TOKEN_ID = 1

#: The engine's moving mean step time before its first step, and the EWMA weight of each step
#: (engine.py's `mean_step_s`; the engine imports asyncio and torch, the simulator must not).
INITIAL_MEAN_STEP_S = 0.01
MEAN_STEP_ALPHA = 0.1

MODES = ("continuous", "static")


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine step from its work: fixed_s + per_prefill_token_s x prefill
    tokens + per_decode_seq_s x decoding sequences + per_context_token_s x context tokens
    attended (each scheduled sequence's length once the step is done)."""

    fixed_s: float
    per_prefill_token_s: float = 0.0
    per_decode_seq_s: float = 0.0
    per_context_token_s: float = 0.0

    def __post_init__(self) -> None:
        rates = (self.per_prefill_token_s, self.per_decode_seq_s, self.per_context_token_s)
        if not all(math.isfinite(v) and v >= 0 for v in (self.fixed_s, *rates)):
            raise ValueError("step costs must be finite and >= 0")
        if self.fixed_s <= 0:
            raise ValueError("fixed_s must be > 0: every step takes some time")

    def seconds(self, scheduled: Seq[ScheduledSequence]) -> float:
        num_prefill, num_decode, num_context = 0, 0, 0
        for item in scheduled:
            num_new = len(item.token_ids)
            # The model runner's split: one new token after cached context is a decode.
            if num_new == 1 and item.start_position > 0:
                num_decode += 1
            else:
                num_prefill += num_new
            num_context += item.start_position + num_new
        return (
            self.fixed_s
            + self.per_prefill_token_s * num_prefill
            + self.per_decode_seq_s * num_decode
            + self.per_context_token_s * num_context
        )


@dataclass(frozen=True)
class GenerationSpec:
    """A generation model as the simulated worker serves it: its config.toml `[generation]`
    table (same names), the scheduling mode, its first-token SLO and default deadline."""

    name: str = "llm"
    version: str = "1"
    max_model_len: int = 512
    block_size: int = 16
    num_kv_blocks: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    watermark_blocks: int = 0
    #: "continuous" (serving) or "static" (run-to-completion batches, the benchmark baseline).
    mode: str = "continuous"
    #: Time-to-first-token objective (the model's slo_p99_ms), seconds.
    ttft_slo_s: float = 2.0
    #: The engine also refuses what is predicted to miss the SLO, not only the deadline.
    shed_past_slo: bool = False
    #: A stream's deadline when its caller sets none (the gateway always sends one).
    default_timeout_s: float = 300.0
    #: Fair-share weight per tenant (the gateway's tenant weight); absent tenants get 1.
    tenant_weights: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not (math.isfinite(self.ttft_slo_s) and self.ttft_slo_s > 0):
            raise ValueError("ttft_slo_ms must be > 0: the engine's standing queue reads it")

    def scheduler_config(self) -> GenerationSchedulerConfig:
        """As GenerationBackend builds it from the model's [generation] table."""
        return GenerationSchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            watermark_blocks=self.watermark_blocks,
            is_static=self.mode == "static",
        )


class SimStream:
    """One generation request's journey: routed, admitted, its tokens, its end."""

    __slots__ = (
        "arrival",
        "deadline_s",
        "first_token_s",
        "last_token_s",
        "num_emitted",
        "num_output_tokens",
        "num_preemptions",
        "reservation_id",
        "seq_id",
        "worker_id",
    )

    def __init__(self, arrival: Arrival, num_output_tokens: int, deadline_s: float) -> None:
        self.arrival = arrival
        #: The request's max_tokens; it always runs to it (no EOS in the simulation).
        self.num_output_tokens = num_output_tokens
        self.deadline_s = deadline_s
        self.seq_id = 0
        #: The worker it was routed to, and the router's reservation of its prompt tokens.
        self.worker_id = ""
        self.reservation_id = 0
        #: Worker-side instants of its first and latest token (seconds); None before.
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.num_emitted = 0
        self.num_preemptions = 0


class StreamSink(Protocol):
    """What a worker tells its fleet: tokens emitted by a step, and streams that ended."""

    def tokens(self, now_s: float, num_tokens: int) -> None: ...

    def done(self, now_s: float, stream: SimStream, outcome: str) -> None:
        """`outcome`: "ok" (ran to max_tokens), "expired" (cancelled at its deadline) or
        first_token.STANDING_QUEUE (dropped unrun behind a standing queue)."""


@dataclass(frozen=True)
class StepRecord:
    """One step as the worker ran it (kept with `keep_steps`, for parity tests)."""

    start_s: float
    end_s: float
    #: (seq_id, tokens computed) in the scheduler's order.
    work: tuple[tuple[int, int], ...]
    preempted: tuple[int, ...]


class SimGenerationWorker:
    """A worker process serving one generation model: its scheduler and its step loop."""

    def __init__(
        self,
        worker_id: str,
        spec: GenerationSpec,
        cost: StepCost,
        loop: EventLoop,
        sink: StreamSink,
        *,
        keep_steps: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.spec = spec
        self.scheduler = GenerationScheduler(spec.scheduler_config())
        self.shedding = StandingShedding(spec.ttft_slo_s)
        self._cost = cost
        self._loop = loop
        self._sink = sink
        self._seq_ids = itertools.count(1)
        #: Live streams by seq_id (the engine's `_requests`).
        self._streams: dict[int, SimStream] = {}
        self._step: SchedulerOutput | None = None
        self._step_started_s = 0.0
        self._cancelled: set[int] = set()
        #: Prompt tokens of live streams without a first token (what the engine reports).
        self.num_waiting_tokens = 0
        self.mean_step_s = INITIAL_MEAN_STEP_S
        self.num_steps = 0
        #: Over the whole run: sequences scheduled, tokens computed, seconds stepping.
        self.num_scheduled_total = 0
        self.num_batched_tokens_total = 0
        self.busy_s_total = 0.0
        self.num_preemptions = 0
        self.steps: list[StepRecord] = []
        self._keep_steps = keep_steps

    @property
    def num_streams(self) -> int:
        """Streams admitted and not ended."""
        return len(self._streams)

    def submit(self, stream: SimStream, now_s: float) -> str | None:
        """Admits the stream as the engine's `_admit` does and wakes an idle loop; returns why
        it was refused (a RejectReason value, or a `FirstTokenRefusal.reason`), or
        None."""
        spec = self.spec
        arrival = stream.arrival
        num_prompt = arrival.num_tokens
        # SamplingParams.validate's rule, which the engine applies before the first-token rule
        # (sampling.py imports grpc, which the simulator must not).
        if num_prompt + stream.num_output_tokens > spec.max_model_len:
            return RejectReason.TOO_LONG.value
        limit_s = stream.deadline_s - now_s
        if spec.shed_past_slo:
            limit_s = min(limit_s, spec.ttft_slo_s)
        refusal = admission_refusal(
            self.shedding,
            self.scheduler,
            now_s=now_s,
            rank=_rank_of(arrival.priority),
            tenant=arrival.tenant,
            limit_s=limit_s,
            num_prompt_tokens=num_prompt,
            step_s=self.mean_step_s,
        )
        if refusal is not None:
            return refusal.reason
        seq_id = next(self._seq_ids)
        decision = self.scheduler.add(
            Sequence(
                seq_id=seq_id,
                prompt_token_ids=(DUMMY_TOKEN_ID,) * num_prompt,
                max_tokens=stream.num_output_tokens,
                priority=_rank_of(arrival.priority),
                tenant=arrival.tenant,
                weight=spec.tenant_weights.get(arrival.tenant, 1.0),
                arrival_s=now_s,
            )
        )
        if isinstance(decision, Rejected):
            return decision.reason.value
        stream.seq_id = seq_id
        self._streams[seq_id] = stream
        self.num_waiting_tokens += num_prompt
        self._loop.at(stream.deadline_s, self._expire, stream)
        if self._step is None:
            self._start_step(now_s)
        return None

    # -- the engine's loop -----------------------------------------------------------------

    def _start_step(self, now_s: float) -> None:
        for seq_id, late in self.shedding.expired(now_s, self.scheduler).items():
            stream = self._streams.get(seq_id)
            assert stream is not None  # every sequence queued has its stream until it ends
            self._end(now_s, stream, late.reason)
        output = self.scheduler.schedule()
        self.shedding.planned(now_s, self.scheduler)
        if not output.scheduled:
            return  # idle: the next submit wakes the loop
        self.num_preemptions += len(output.preempted)
        self._step = output
        self._step_started_s = now_s
        self._loop.at(now_s + self._cost.seconds(output.scheduled), self._end_step, output)

    def _end_step(self, now_s: float, output: SchedulerOutput) -> None:
        step_s = now_s - self._step_started_s
        self._step = None
        self.num_steps += 1
        self.num_scheduled_total += len(output.scheduled)
        self.num_batched_tokens_total += output.num_batched_tokens
        self.busy_s_total += step_s
        self.mean_step_s += MEAN_STEP_ALPHA * (step_s - self.mean_step_s)
        if self._keep_steps:
            work = tuple((s.seq_id, len(s.token_ids)) for s in output.scheduled)
            self.steps.append(StepRecord(self._step_started_s, now_s, work, output.preempted))
        sampled = {s.seq_id: DUMMY_TOKEN_ID for s in output.scheduled if s.samples}
        self.scheduler.update_from_output(sampled)
        for seq_id in self._cancelled:
            self.scheduler.finish(seq_id)
        self._cancelled.clear()
        num_emitted = 0
        for seq_id in sampled:
            stream = self._streams.get(seq_id)
            if stream is not None:
                self._emit(stream, now_s)
                num_emitted += 1
        self._sink.tokens(now_s, num_emitted)
        self._start_step(now_s)

    def _emit(self, stream: SimStream, now_s: float) -> None:
        sequence = self.scheduler.get(stream.seq_id)
        assert sequence is not None  # a live stream's sequence is unfinished
        if stream.first_token_s is None:
            stream.first_token_s = now_s
            self.num_waiting_tokens -= stream.arrival.num_tokens
        stream.last_token_s = now_s
        stream.num_emitted += 1
        if len(sequence.output_token_ids) >= stream.num_output_tokens:
            stream.num_preemptions = sequence.num_preemptions
            del self._streams[stream.seq_id]
            self.scheduler.finish(stream.seq_id)
            self._sink.done(now_s, stream, "ok")

    def _expire(self, now_s: float, stream: SimStream) -> None:
        """The stream's deadline: the call is cancelled, as the engine's `_cancel` handles."""
        if self._streams.get(stream.seq_id) is not stream:
            return  # it ended already
        self._end(now_s, stream, "expired")
        if self._step is None:
            self._start_step(now_s)

    def _end(self, now_s: float, stream: SimStream, outcome: str) -> None:
        """The live `stream` ends unfinished (`outcome`: StreamSink.done's)."""
        del self._streams[stream.seq_id]
        if stream.first_token_s is None:
            self.num_waiting_tokens -= stream.arrival.num_tokens
        sequence = self.scheduler.get(stream.seq_id)
        if sequence is not None:
            stream.num_preemptions = sequence.num_preemptions
        if self._step is not None:
            self._cancelled.add(stream.seq_id)  # finished once the step in flight is done
        else:
            self.scheduler.finish(stream.seq_id)
        self._sink.done(now_s, stream, outcome)

    # -- reports ---------------------------------------------------------------------------

    def record(self, now_s: float) -> WorkerRecord:
        """The heartbeat, as GenerationBackend.model_record builds it."""
        spec = self.spec
        step_s = self.mean_step_s
        model = ModelRecord(
            name=spec.name,
            version=spec.version,
            fingerprint="sim",
            tokenizer_fingerprint="sim",
            kind="generation",
            max_batch_size=spec.max_num_seqs,
            slo_p99_ms=round(spec.ttft_slo_s * 1000),
            # Prefill cost per prompt token, and one step as the floor of time to first token.
            per_row_s=step_s / spec.max_num_batched_tokens,
            min_batch_s=step_s,
            queued_rows=self.num_waiting_tokens,
            is_ready=True,
            kv_blocks_free=self.scheduler.num_free_blocks,
            kv_block_size=spec.block_size,
            max_model_len=spec.max_model_len,
            shed_past_slo=spec.shed_past_slo,
        )
        return WorkerRecord(
            worker_id=self.worker_id,
            address=self.worker_id,
            is_draining=False,
            sent_at_ms=int(now_s * 1000),
            models=(model,),
        )


@functools.cache
def _rank_of(priority: str) -> int:
    """The scheduler's rank of a priority class name (ValueError for an unknown name)."""
    return PriorityClass.parse(priority).rank
