"""Retrying refused calls, within a budget.

A call refused for load (RESOURCE_EXHAUSTED with a `retry-after-ms` hint) ran nothing, so it
is safe to send again, after the hint and while its deadline leaves time. So is a call the
gateway's gRPC library dropped before any of the gateway's code saw it (CANCELLED, which this
client causes only by closing, and then sends nothing again: the calls waiting to be picked up
were past the gateway's `--max-pending-calls`); it carries no hint, and is sent again after
`dropped_retry_s`, jittered. Retries are also load: a client that retried every refusal would
multiply a flood by its retry count. So, as Finagle's and gRPC's retry budgets do, retries are
bounded to a share of the calls this client made recently (`ratio`), plus a few at any time
(`refill_per_s`, up to `min_tokens`) so that a quiet client is not left without one.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """When a refused call is sent again."""

    #: Most attempts after the first, per call.
    max_retries: int = 2
    #: Retries may be at most this share of calls (each call earns `ratio` of a retry).
    ratio: float = 0.1
    #: Retries the budget holds at most, and starts with.
    min_tokens: float = 10.0
    #: Retries the budget earns back a second, calls or not (a flood that emptied it does not
    #: leave a quiet client without a retry until it has made calls enough to earn one).
    refill_per_s: float = 1.0
    #: A retry is sent only if at least this long (for a job's submit, and as long as the
    #: refused attempt took) is left of the deadline after the hint: one with less would only
    #: turn an informative refusal into DEADLINE_EXCEEDED (for a submit without an
    #: idempotency key, one that leaves the caller unsure whether the job was stored).
    min_attempt_s: float = 0.05
    #: A call dropped unseen (CANCELLED) is sent again after this long, times 0.5 to 1.5 at
    #: random, so that the callers of one drop do not come back together.
    dropped_retry_s: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int):
            # 2.0 passed every check below, then every call raised TypeError in range().
            raise ValueError(f"max_retries must be an int, got {self.max_retries!r}")
        settings = (self.max_retries, self.ratio, self.min_tokens, self.refill_per_s)
        if not all(math.isfinite(x) for x in (*settings, self.min_attempt_s, self.dropped_retry_s)):
            # min() skips NaN, and a NaN ratio or refill pinned the budget full: no bound.
            raise ValueError("a retry policy's settings must be finite numbers")
        if min(*settings, self.min_attempt_s, self.dropped_retry_s) < 0:
            raise ValueError(
                "max_retries, ratio, min_tokens, refill_per_s, min_attempt_s and "
                "dropped_retry_s must be >= 0"
            )
        if self.max_retries > 0 and self.min_tokens < 1:
            raise ValueError(
                f"min_tokens must be >= 1 for retries (a retry takes a token, and the budget "
                f"holds at most min_tokens), got {self.min_tokens}; max_retries=0 turns "
                f"retries off"
            )


def retry_after_s(policy: RetryPolicy, code: str, hint_s: float | None) -> float | None:
    """How long to wait before sending a failed call again; None: not again. Refusals for load
    wait their hint (none without one); a call dropped unseen waits `dropped_retry_s`,
    jittered."""
    if code == "RESOURCE_EXHAUSTED":
        return hint_s
    if code == "CANCELLED":
        return hint_s if hint_s is not None else policy.dropped_retry_s * random.uniform(0.5, 1.5)
    return None


class RetryBudget:
    """A token bucket of retries: each call adds `ratio` of a token, each second
    `refill_per_s`, each retry takes one. Thread-safe (the client is)."""

    def __init__(self, policy: RetryPolicy, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._policy = policy
        self._clock = clock
        self._tokens = policy.min_tokens
        self._updated_s = clock()
        self._lock = threading.Lock()

    def on_call(self) -> None:
        with self._lock:
            self._add(self._policy.ratio)

    def try_spend(self) -> bool:
        """Takes a retry if the budget has one."""
        with self._lock:
            self._add(0.0)
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

    def _add(self, tokens: float) -> None:
        now_s = self._clock()
        earned = max(0.0, now_s - self._updated_s) * self._policy.refill_per_s
        self._updated_s = now_s
        self._tokens = min(self._policy.min_tokens, self._tokens + tokens + earned)
