"""Turning logits into tokens: greedy, or temperature / top-k / top-p sampling, seeded per request.

Each row is sampled on its own, with its own request's generator, so a seeded request yields the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from services.common.sampling import SamplingParams

if TYPE_CHECKING:
    from services.gpu_worker.generation.request_stream import RequestStream
    from services.gpu_worker.generation.sequence import ScheduledSequence


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own RNG, created once and advanced by each sample; None when the request is
    greedy or unseeded (then torch's global RNG is used)."""
    if params.is_greedy or params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed)


class Sampler:
    """Picks one token per row of logits."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """logits: float [n, vocab] on CPU (the generators are CPU generators); one params and
        one generator per row. Returns the chosen token ids; raises the first row's error."""
        tokens = self.sample_rows(logits, params, generators)
        if failed := [t for t in tokens if isinstance(t, Exception)]:
            raise failed[0]
        return [t for t in tokens if isinstance(t, int)]

    def sample_step(
        self,
        scheduled: Sequence[ScheduledSequence],
        logits: torch.Tensor,
        request_of: Callable[[int], RequestStream | None],
    ) -> tuple[dict[int, int], list[tuple[int, RuntimeError]]]:
        """A step's tokens, seq_id -> token, for its sequences that sample (the step computed
        logits for those rows only, in order), each with its request's params and generator
        (the defaults for a request gone); and (seq_id, error) for each whose sampling failed,
        that sequence alone."""
        sampling = [s.seq_id for s in scheduled if s.samples]
        if not sampling:
            return {}, []
        requests = [request_of(seq_id) for seq_id in sampling]
        params = [request.params if request else SamplingParams() for request in requests]
        generators = [request.generator if request else None for request in requests]
        sampled: dict[int, int] = {}
        failed: list[tuple[int, RuntimeError]] = []
        tokens = self.sample_rows(logits, params, generators)
        for seq_id, token in zip(sampling, tokens, strict=True):
            if isinstance(token, RuntimeError):
                failed.append((seq_id, token))
            else:
                sampled[seq_id] = token
        return sampled, failed

    def sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int | RuntimeError]:
        """As `sample`, each row's token or its own error (torch's, as for probabilities that
        are not finite): one row's failure is not its step-mates'."""
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(
                f"{logits.shape[0]} rows of logits, {len(params)} params, "
                f"{len(generators)} generators"
            )
        # Greedy rows (the common case) take one argmax over all of them, not one per row.
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        tokens: list[int | RuntimeError] = [0] * len(params)
        if greedy:
            rows = logits if len(greedy) == len(params) else logits[greedy]
            for i, token in zip(greedy, rows.argmax(dim=-1).tolist(), strict=True):
                tokens[i] = token
        for i, (p, g) in enumerate(zip(params, generators, strict=True)):
            if not p.is_greedy:
                try:
                    tokens[i] = self._sample_row(logits[i], p, g)
                except RuntimeError as error:
                    tokens[i] = error
        return tokens

    @staticmethod
    def _sample_row(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> int:
        scaled = logits.float() / params.temperature
        if params.top_k == 0 and params.top_p >= 1.0:
            # Nothing cut (the defaults): drawn from the whole vocabulary as it stands. Sorting
            # it first, as below, cost more than the draw (a step of 16 rows of 128,000 logits,
            # stop 80's note: 202.8 -> 35.2 ms), a row at a time on the engine's event loop.
            probs = torch.softmax(scaled, dim=-1)
            return int(torch.multinomial(probs, num_samples=1, generator=generator))
        # Work in descending order: top-k and top-p then cut a prefix. A stable sort keeps tied
        # tokens in id order, so top_k=1 picks the same token as argmax.
        sorted_logits, order = torch.sort(scaled, descending=True, stable=True)
        if params.top_k > 0:
            sorted_logits[params.top_k :] = -math.inf
        if params.top_p < 1.0:
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the ones before it already reach top_p; the first always stays.
            mass_before = torch.cumsum(probs, dim=-1) - probs
            sorted_logits[mass_before >= params.top_p] = -math.inf
        probs = torch.softmax(sorted_logits, dim=-1)
        choice = torch.multinomial(probs, num_samples=1, generator=generator)
        return int(order[choice])
