"""The generation engine's deadline rule: when a new prompt's first token would come.

A busy engine refuses a request predicted to miss its first-token limit at once (with a retry
hint) rather than letting the caller time out. Pure.
"""

from __future__ import annotations

import math


def predicted_first_token_s(
    *,
    num_waiting_tokens: int,
    num_running: int,
    num_prompt_tokens: int,
    max_num_batched_tokens: int,
    step_s: float,
) -> float:
    """Seconds until a new prompt's first token on a busy engine: the prefill backlog ahead of
    it plus its own prompt, at the token budget left per step once every running sequence has
    decoded its one token, at `step_s` a step. An idle engine answers 0: an idle lane is never
    refused on a prediction."""
    if num_waiting_tokens == 0 and num_running == 0:
        return 0.0
    prefill_per_step = max(1, max_num_batched_tokens - num_running)
    steps = math.ceil((num_waiting_tokens + num_prompt_tokens) / prefill_per_step)
    return steps * step_s
