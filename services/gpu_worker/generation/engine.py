"""The generation engine: the async driver around the pure iteration scheduler.

Each step reads `schedule -> execute -> update_from_output`: the scheduler picks this step's
sequences (decodes, prefill chunks, admissions by free KV blocks, preemptions), the model runner
computes them in one forward on the executor thread, the sampler picks a token for each sequence
that reached the end of its known tokens, and the engine streams new text to each request's
collector and finishes sequences that stopped. Where a device runs the steps, the tokens whose
end their id and count tell are streamed while the next step runs on it (`_finish_step`).
Consumers never block the loop: what a reader has not taken yet waits in its collector, read
as one delta (request_stream.DeltaCollector).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence

import torch
from tokenizers import Tokenizer

from services.common.errors import ExecutionFailed, InvalidInput, Overloaded, Unavailable
from services.common.priority import PriorityClass
from services.common.sampling import SamplingParams
from services.gpu_worker.admission import Admitted, Rejected
from services.gpu_worker.batching.failure_streak import FailingConfig, FailureStreak
from services.gpu_worker.generation.live_requests import LiveRequests
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.generation.model_runner import ModelRunner
from services.gpu_worker.generation.prefill_hold import PrefillHold
from services.gpu_worker.generation.request_stream import Delta, RequestStream
from services.gpu_worker.generation.sampler import Sampler
from services.gpu_worker.generation.scheduler import GenerationScheduler
from services.gpu_worker.generation.sequence import ScheduledSequence
from services.gpu_worker.generation.sequence import Sequence as SchedSequence
from services.gpu_worker.generation.standing_shedding import StandingShedding, admission_refusal
from services.gpu_worker.generation.step_executor import DEFAULT_WATCHDOG_S, StepExecutor
from services.gpu_worker.generation.step_inputs import is_decode
from services.gpu_worker.thread_choice import StepCycles, ThreadChoice

log = logging.getLogger(__name__)


class GenerationEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        scheduler: GenerationScheduler,
        metrics: GenerationMetrics,
        *,
        labels: tuple[str, str],
        eos_token_ids: frozenset[int],
        max_model_len: int,
        is_cache_per_tenant: bool = False,
        thread_choice: ThreadChoice | None = None,
        shedding: StandingShedding | None = None,
        failures: FailureStreak | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`is_cache_per_tenant`: prefix-cached blocks are shared only among one tenant's
        sequences (the scheduler's config says whether there is a prefix cache at all).
        `thread_choice`: picks each step's torch threads on a CPU (None: as set; StepCycles).
        `shedding`: refuses online requests while the waiting queue stands (None: never).
        `failures`: marks the version failing once its steps all fail (None: the defaults)."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self._bound = metrics.bind(labels)
        self._labels = labels
        self._eos_token_ids = eos_token_ids
        self.clock = clock
        self.failures = failures or FailureStreak(FailingConfig())  # in the heartbeat
        self._is_cache_per_tenant = is_cache_per_tenant
        self._cycles = StepCycles(thread_choice)
        self._sampler = Sampler()
        self.steps = StepExecutor(runner, metrics, labels, has_sent=scheduler.has_sent)
        self._requests = LiveRequests()
        self._seq_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._cancelled: set[int] = set()
        #: Tokens sampled, streamed during the next step's device time (`_finish_step`).
        self._unsent: list[tuple[RequestStream, int, int, float, bool]] = []
        self.streams_during_steps = True  # False: after each step (benchmarks' side by side)
        self._is_stepping = False
        self._is_draining = False
        self._loop_task: asyncio.Task[None] | None = None
        #: Why the loop died, once it has: every later request is refused with it.
        self._fatal: Exception | None = None
        self.num_steps = 0
        self.mean_step_s = 0.01  # moving average of one step's duration (read-only outside)
        self._prefill_hold = PrefillHold()
        self._shedding = shedding

    # -- lifecycle -------------------------------------------------------------------------
    def start(
        self,
        on_fatal: Callable[[Exception], None] | None = None,
        *,
        watchdog_s: float = DEFAULT_WATCHDOG_S,
    ) -> None:
        """Runs the step loop, each forward bounded by `watchdog_s`. If the loop dies (a bug, a
        step past the watchdog), streams end UNAVAILABLE, new ones are refused, `on_fatal` told."""
        self.steps.set_watchdog(watchdog_s)
        loop = asyncio.get_running_loop()
        self._loop_task = loop.create_task(self._supervised(on_fatal), name="generation")

    async def _supervised(self, on_fatal: Callable[[Exception], None] | None) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            # The drain's grace ran out: the streams still running end now, with a status.
            self._fatal = Unavailable("the worker is shutting down (drain grace over)")
            self._fail_all()
            raise
        except Exception as error:
            log.critical("generation loop of %s/%s died", *self._labels, exc_info=True)
            self._fatal = error
            self._fail_all()
            if on_fatal is not None:
                on_fatal(error)

    def _fail_all(self) -> None:
        with contextlib.suppress(Exception):  # a scheduler as broken as the loop: end streams
            self._send_unsent()  # what was sampled before the failure is its streams' own
        for request in self._requests.values():
            request.output.put_nowait(self._stopped_error())
        self._requests.clear()

    def _stopped_error(self) -> Unavailable:
        name, fatal = "/".join(self._labels), self._fatal
        return Unavailable(f"generation engine of {name} stopped: {fatal}; retry on another worker")

    async def drain(self) -> None:
        """Stop admitting; running streams get tokens until they finish (cancelled: see above)."""
        self._is_draining = True
        self._wake.set()
        try:
            if self._loop_task is not None:
                await self._loop_task
        finally:  # also when cancelled: a step left on the daemon thread aborts the exit
            self.steps.shutdown()

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens whose first token is not sampled yet (the prefill backlog routers see)."""
        return self._requests.num_waiting_tokens

    # -- requests --------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        first_token_limit_s: float | None = None,
        tenant: str = "",
        weight: float = 1.0,
    ) -> AsyncGenerator[Delta, None]:
        """Streams deltas until the sequence finishes; closing the iterator (cancel) frees its
        KV blocks before the next step. A busy engine predicted to miss `first_token_limit_s`
        (the caller's deadline, or the SLO of a model that sheds) refuses at once."""
        request = self._admit(
            prompt_ids, params, priority, first_token_limit_s, tenant=tenant, weight=weight
        )
        seq_id = request.seq_id
        self._wake.set()
        try:
            while True:
                item = await request.output.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if seq_id in self._requests:
                # The consumer went away mid-stream: free the blocks before the next step.
                self._cancel(seq_id)

    def _admit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        priority: int,
        first_token_limit_s: float | None,
        *,
        tenant: str,
        weight: float,
    ) -> RequestStream:
        """Checks a new request and queues its sequence; raises what the caller gets."""
        if self._is_draining:  # nothing ran: the router may send it to another worker
            raise Unavailable("worker is draining", is_not_started=True)
        if self._fatal is not None:
            raise self._stopped_error()
        try:
            params.validate(self.max_model_len, len(prompt_ids))
        except ValueError as error:  # never runs as asked (past the context, bad sampling)
            self._bound.rejected_total.inc()
            raise InvalidInput(str(error)) from error
        seq_id = next(self._seq_ids)
        now = self.clock()
        sequence = SchedSequence(
            seq_id=seq_id, prompt_token_ids=tuple(prompt_ids), max_tokens=params.max_tokens,
            priority=priority, arrival_s=now, tenant=tenant, weight=weight,
            cache_salt=tenant if self._is_cache_per_tenant else "",
        )  # fmt: skip
        request: RequestStream | None = None
        decision: Admitted | Rejected | None = self.scheduler.refusal(sequence)
        if decision is None:
            refusal = admission_refusal(
                self._shedding, self.scheduler, now_s=now, rank=priority, tenant=tenant,
                limit_s=first_token_limit_s, num_prompt_tokens=len(prompt_ids),
                step_s=self.mean_step_s,
            )  # fmt: skip
            if refusal is not None:
                self._bound.rejected_total.inc()
                raise Overloaded(refusal.message, retry_after_s=refusal.retry_after_s)
            # Opened before its sequence is queued (a sequence queued with no request would run
            # unread, never stopped by its max_tokens), after what may refuse it.
            request = RequestStream.open(seq_id, params, self.tokenizer, prompt_ids, arrival_s=now,
                tenant=tenant, is_online=priority < PriorityClass.BATCH.rank)  # fmt: skip
            decision = self.scheduler.add(sequence)
        if isinstance(decision, Rejected):
            # Never runs with this configuration (empty, past max_model_len or the KV cache),
            # busy or not: no retry can succeed, no overload (refused before the first token's).
            self._bound.rejected_total.inc()
            raise InvalidInput(f"generation request refused: {decision.detail}")
        assert request is not None  # admitted: opened above
        self._requests.add(request)
        return request

    def _cancel(self, seq_id: int) -> None:
        self._requests.pop(seq_id)
        self._bound.cancelled_total.inc()
        self._finish_sequence(seq_id)
        self._wake.set()

    def _finish_sequence(self, seq_id: int) -> None:  # now, or once the step in flight is over
        if self._is_stepping:
            self._cancelled.add(seq_id)
        else:
            self.scheduler.finish(seq_id)

    # -- the loop --------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            # Decode steps replayed from CUDA graphs cost a fraction of a step with a prompt:
            # prompts then wait (a few milliseconds at most) to share one (prefill_hold),
            # unless the step carries a prompt chunk anyway.
            admit = (
                self.runner.graphs is None
                or self._prefill_hold.admits(self.clock(), num_running=self.scheduler.num_running)
                or self.scheduler.is_prefilling  # a scan of the running sequences: last
            )
            if shedding := self._shedding:  # online sequences late already go unrun
                for seq_id, late in shedding.expired(self.clock(), self.scheduler).items():
                    self._bound.dropped_total.inc()
                    error = Overloaded(late.message, retry_after_s=late.retry_after_s)
                    self._end_sequence(seq_id, error)
            output = self.scheduler.schedule(admit=admit)
            if shedding:  # what the plan left waiting
                shedding.planned(self.clock(), self.scheduler)
            self._bound.scheduled(output, self.scheduler, self.runner.num_blocks)
            if not output.scheduled:
                self._send_unsent()
                if self._is_draining and not self.scheduler.has_unfinished():
                    return
                self._cycles.break_off()  # the cycle would include the idle wait
                await self._wake.wait()
                continue
            items: Sequence[ScheduledSequence] = output.scheduled
            self._is_stepping = True
            started = self.clock()
            threads = self._cycles.launch(output.num_batched_tokens, started)
            runner = self.runner  # a device's step (a GPU's, the stand-in's) runs while the
            overlaps = self.streams_during_steps and (  # last step's tokens stream
                runner.device.type == "cuda" or runner.graphs is not None
            )
            try:
                sends = self._send_unsent if overlaps else None
                logits = await self.steps.execute(items, threads=threads, while_running=sends)
            except Exception as error:
                self._send_unsent()
                self._cycles.break_off()
                if self.steps.is_wedged:
                    raise  # its thread is held for good: the supervisor stops the engine
                log.exception("generation step failed")
                # A rerun's own time is the step's (the failed one's would count as decodes').
                started, fail = self.clock(), functools.partial(self._fail, error=error, now=True)
                rerun = await self.steps.decodes_again(items, threads, fail)
                if rerun is None:  # every sequence of the step failed
                    self.failures.note(self._labels, self.clock(), all_failed=True)
                    self._fail(items, error)
                    continue
                items, logits = rerun
            finally:
                self._is_stepping = False
            self.num_steps += 1
            ended = self.clock()  # with the streaming of the last step, if it took longer
            step_s = ended - started
            self._prefill_hold.record(
                has_prompt=not all(map(is_decode, items)), seconds=step_s, end_s=ended
            )
            self.mean_step_s += 0.1 * (step_s - self.mean_step_s)
            self._bound.stepped(step_s, output, self._requests)
            try:
                none_sampled = self._finish_step(items, logits, defer=overlaps)
            except Exception as error:
                # Sampling or streaming failed: its sequences end with an error, others go on.
                log.exception("generation step could not be finished")
                self._send_unsent()  # the tokens sampled before it, then the error
                self._fail(items, error)
                # Bad weights show as NaN logits that no sampling takes, as often as a raise.
                self.failures.note(self._labels, ended, all_failed=True)
            else:
                self.failures.note(self._labels, ended, all_failed=none_sampled)

    def _finish_step(
        self, scheduled: Sequence[ScheduledSequence], logits: torch.Tensor, *, defer: bool
    ) -> bool:
        """Samples the step's tokens and accounts them. Streams them now, or (`defer`) where id
        and count tell their end (`RequestStream.ends_at`) while the next step runs on the
        device (`_send_unsent`), timed as sampled now; ends finish now (no step runs past one).
        Returns whether rows were to sample and none could (the logits NaN: bad weights)."""
        sampled, failed = self._sampler.sample_step(scheduled, logits, self._requests.get)
        for seq_id, error in failed:  # this sequence alone ends with the error
            log.warning("sampling failed for one sequence: %s", error)
            self._fail_sequence(seq_id, error)
        self.scheduler.update_from_output(sampled)
        self._finish_cancelled()
        none_sampled = bool(failed) and not sampled
        now = self.clock()
        for seq_id, token in sampled.items():
            if (request := self._requests.sampled(seq_id)) is None:
                continue
            sequence = self.scheduler.get(seq_id)
            assert sequence is not None  # cancelling drops the request before its sequence
            num_generated = len(sequence.output_token_ids)
            ends = request.ends_at(token, num_generated, self._eos_token_ids) if defer else None
            if ends is None:
                ends = self._send(request, token, num_generated, now)
            else:
                self._unsent.append((request, token, num_generated, now, ends))
            if ends:
                self._requests.pop(seq_id)
                self.scheduler.finish(seq_id)
        return none_sampled

    def _send_unsent(self) -> None:  # never raises: a failure ends that sequence alone
        """Streams the tokens `_finish_step` deferred."""
        unsent, self._unsent = self._unsent, []
        for request, token, num_generated, now, ends in unsent:
            # A stream cancelled meanwhile is read by no one (nor counted, as before a step).
            if ends or self._requests.get(request.seq_id) is request:
                self._send(request, token, num_generated, now)
        self._bound.flush_tokens()

    def _send(self, request: RequestStream, token: int, num_generated: int, now: float) -> bool:
        """Streams `token`; True when it ends the stream. A failure to ends its sequence."""
        try:
            return request.push_token(token, num_generated, now, self._eos_token_ids, self._bound)
        except Exception as error:
            log.exception("streaming a token failed for one sequence")
            if self._requests.get(request.seq_id) is request:
                self._fail_sequence(request.seq_id, error)
            else:  # finished already (its end deferred with it): its stream alone
                request.output.put_nowait(ExecutionFailed(f"generation failed: {error}"))
            return False

    def _fail(
        self, scheduled: Sequence[ScheduledSequence], error: Exception, *, now: bool = False
    ) -> None:
        """A failed step fails its sequences (their streams end with an error); others go on.
        `now`: mid-step, finished at once (a rerun of the others leaves their blocks alone)."""
        for item in scheduled:
            self._fail_sequence(item.seq_id, error)
            if now:
                self.scheduler.finish(item.seq_id)
        if not now:
            self._finish_cancelled()

    def _finish_cancelled(self) -> None:  # those cancelled while a step ran, once it is over
        for seq_id in self._cancelled:
            self.scheduler.finish(seq_id)
        self._cancelled.clear()

    def _fail_sequence(self, seq_id: int, error: Exception) -> None:  # its stream with `error`
        self._end_sequence(seq_id, ExecutionFailed(f"generation failed: {error}"))

    def _end_sequence(self, seq_id: int, outcome: Exception) -> None:  # its stream raises it
        self._finish_sequence(seq_id)
        if (request := self._requests.pop(seq_id)) is not None:
            request.output.put_nowait(outcome)
