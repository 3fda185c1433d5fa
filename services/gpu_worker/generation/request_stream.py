"""A generation request's stream, as the engine (engine.py) feeds it: the `Delta`s its caller
reads from its collector, and its state between steps (`RequestStream`): sampling settings,
detokenizer, token timing. `RequestStream.push_token` extends it by one sampled token: stop
tokens and strings, max_tokens, and the per-token metrics (TTFT, TPOT, tokens)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from tokenizers import Tokenizer

from services.common.pb_conversions import finish_reason_to_pb
from services.common.sampling import SamplingParams
from services.gpu_worker.generation.detokenizer import IncrementalDetokenizer
from services.gpu_worker.generation.metrics import BoundGenerationMetrics
from services.gpu_worker.generation.sampler import make_generator
from services.pb.inference.v1 import worker_pb2 as pb


class Delta(NamedTuple):
    """Tokens produced for one request since its previous delta (a named tuple: one is made
    for every token streamed, at a third of a frozen dataclass's cost)."""

    token_ids: tuple[int, ...]
    text: str
    #: "length" or "stop" on the last delta, else None.
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def delta_to_pb(delta: Delta) -> pb.GenerateResponse:
    """A delta as the worker's Generate streams it."""
    return pb.GenerateResponse(
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=finish_reason_to_pb(delta.finish_reason),
        prompt_tokens=delta.prompt_tokens,
        completion_tokens=delta.completion_tokens,
    )


def merged(deltas: list[Delta]) -> Delta:
    """One delta for consecutive ones: their tokens and text in order, the last one's end."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return Delta(
        tuple(token for delta in deltas for token in delta.token_ids),
        "".join(delta.text for delta in deltas),
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
    )


class DeltaCollector:
    """What the engine produced for one request and its reader has not taken yet. Deltas that
    arrive while the reader is busy (a gRPC stream's writes falling behind the steps) are read
    as one, as vLLM's RequestOutputCollector does: a lagging reader sends one message for
    several tokens instead of falling further behind, one message a token. An error is read
    after the deltas before it. One reader: a second waiting at once is a bug (it raises)."""

    __slots__ = ("_error", "_pending", "_waiter")

    def __init__(self) -> None:
        self._pending: list[Delta] = []
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Delta | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._pending.append(item)  # merged once, when read: linear in what piles up
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Delta | BaseException:
        """Everything produced since the last read, merged; or the error once that is read."""
        while not self._pending and self._error is None:
            if self._waiter is not None:
                raise RuntimeError("a generation stream has one reader")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._pending:
            deltas, self._pending = self._pending, []
            return merged(deltas)
        assert self._error is not None
        return self._error


@dataclass
class RequestStream:
    """One live generation request: what samples and detokenizes its tokens, the collector
    its deltas go to, and when its tokens came."""

    seq_id: int
    params: SamplingParams
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    arrival_s: float
    tenant: str
    #: Not of the batch class: its time to first token is observed (batch-class streams wait
    #: on purpose, and the histogram scales GPU pools up: deploy/k8s/prometheus-adapter).
    is_online: bool = True
    output: DeltaCollector = field(default_factory=DeltaCollector)
    first_token_s: float | None = None
    last_token_s: float | None = None

    @classmethod
    def open(
        cls,
        seq_id: int,
        params: SamplingParams,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        arrival_s: float,
        tenant: str,
        is_online: bool = True,
    ) -> RequestStream:
        """The stream of a request for `prompt_ids` admitted at `arrival_s`, with its own
        sampling generator and detokenizer (the prompt's last tokens its first context)."""
        return cls(
            seq_id=seq_id,
            params=params,
            generator=make_generator(params),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            arrival_s=arrival_s,
            tenant=tenant,
            is_online=is_online,
        )

    def ends_at(self, token: int, num_generated: int, eos_token_ids: frozenset[int]) -> bool | None:
        """Whether `token`, sampled as the sequence's `num_generated`-th, ends the stream (as
        `push_token` would return), where the token and the count alone say it: None for a
        request with stop strings, whose text may end it."""
        params = self.params
        if any(params.stop):
            return None
        return self._is_stop_token(token, eos_token_ids) or num_generated >= params.max_tokens

    def _is_stop_token(self, token: int, eos_token_ids: frozenset[int]) -> bool:
        params = self.params
        return token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos)

    def push_token(
        self,
        token: int,
        num_generated: int,
        now: float,
        eos_token_ids: frozenset[int],
        bound: BoundGenerationMetrics,
    ) -> bool:
        """Streams `token`, sampled at `now` as the sequence's `num_generated`-th, and counts
        its metrics (its time to first token recorded now, the rest at `bound.flush_tokens`).
        True once it finishes the stream: its last delta is queued then, and the engine
        finishes the sequence."""
        params = self.params
        is_stop_token = self._is_stop_token(token, eos_token_ids)
        finish_reason = "stop" if is_stop_token else None
        text = ""
        token_ids: tuple[int, ...] = ()
        hit_stop = False
        if not is_stop_token:
            token_ids = (token,)
            text, hit_stop = self.detokenizer.push(token, params.stop)
            if hit_stop:
                finish_reason = "stop"
        if finish_reason is None and num_generated >= params.max_tokens:
            finish_reason = "length"
        if finish_reason is not None and not hit_stop:
            # Text held back as the possible start of a stop string is the reply's own: it
            # ends here without one (at a stop or EOS token, or its length).
            held, hit_stop = self.detokenizer.flush(params.stop)
            text += held
            if hit_stop:  # the last tokens completed a stop string: the reply ends at it
                finish_reason = "stop"
        tpot_s = None if self.last_token_s is None else now - self.last_token_s
        if self.first_token_s is None:
            self.first_token_s = now
            if self.is_online:
                bound.ttft_seconds.observe(now - self.arrival_s)
        bound.streamed(len(token_ids), tpot_s)
        self.last_token_s = now
        if finish_reason is None:
            if token_ids:
                self.output.put_nowait(Delta(token_ids, text))
            return False
        bound.finished(finish_reason).inc()
        self.output.put_nowait(
            Delta(
                token_ids,
                text,
                finish_reason=finish_reason,
                prompt_tokens=self.num_prompt_tokens,
                # Every token sampled, a stop or EOS token too (not streamed: it has no text),
                # as OpenAI and vLLM count usage, and as `max_tokens` counts them.
                completion_tokens=num_generated,
            )
        )
        return True
