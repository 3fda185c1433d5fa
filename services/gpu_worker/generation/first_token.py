"""The generation engine's deadline rule: when a new prompt's first token would come.

A busy engine refuses a request predicted to miss its first-token limit at once (with a retry
hint) rather than letting the caller time out. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Why a request was refused before its first token (`FirstTokenRefusal.reason`): predicted to
#: miss its limit, or behind a standing waiting queue (standing_shedding).
FIRST_TOKEN_DEADLINE, STANDING_QUEUE = "first_token_deadline", "standing_queue"


@dataclass(frozen=True)
class FirstTokenRefusal:
    """A request refused at admission, or dropped unrun: what the caller is told (Overloaded),
    and when to retry."""

    reason: str
    message: str
    retry_after_s: float


def deadline_refusal(predicted_s: float, limit_s: float) -> FirstTokenRefusal | None:
    """The refusal of a request whose first token, predicted in `predicted_s`, would come past
    the `limit_s` it may take (its caller's deadline, or the SLO of a model that sheds)."""
    if predicted_s <= limit_s:
        return None
    return FirstTokenRefusal(
        FIRST_TOKEN_DEADLINE,
        f"generation request refused: first token predicted in {predicted_s:.3f}s,"
        f" past the {limit_s:.3f}s it may take",
        predicted_s - limit_s,
    )


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
