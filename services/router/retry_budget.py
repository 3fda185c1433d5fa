"""Finagle-style retry budget: retries bounded to a fraction of traffic. Pure: time comes in
as `now_s`."""

from __future__ import annotations

import math

#: Slices of the retry budget's window: deposits and withdrawals expire one slice at a time.
_NUM_SLICES = 10


class RetryBudget:
    """Finagle-style retry budget: retries <= ratio x requests + a floor, over a sliding window.

    Each request deposits `ratio` tokens and each retry withdraws one. Both expire after
    `window_s`, and a constant reserve of `min_per_s * window_s` tokens sits on top, so:
    - under traffic, retries stay near `ratio` of requests;
    - at zero traffic, about `min_per_s` retries per second still get through;
    - after a quiet period the balance is back to the reserve (deposits expired), so an idle
      router cannot bank unlimited retries: the cap is ratio x requests in the last window +
      the reserve.
    """

    def __init__(self, ratio: float = 0.2, min_per_s: float = 5.0, window_s: float = 10.0) -> None:
        """Raises ValueError on a negative ratio or floor, or a non-positive window."""
        if ratio < 0 or min_per_s < 0 or window_s <= 0:
            raise ValueError("ratio and min_per_s must be >= 0, window_s > 0")
        self._ratio = ratio
        self._reserve = min_per_s * window_s
        self._slice_s = window_s / _NUM_SLICES
        # Ring of slices: net tokens (deposits - withdrawals) and the absolute slice number
        # each entry currently holds, so an entry from an old window reads as empty.
        self._net = [0.0] * _NUM_SLICES
        self._slice_number = [-1] * _NUM_SLICES

    def record_request(self, now_s: float) -> None:
        """Count one request (first attempts only, not retries)."""
        self._net[self._slot(now_s)] += self._ratio

    @property
    def batch_keep(self) -> float:
        """Tokens a `batch` call's retry leaves to the other classes: half the floor's. A
        worker lost with many batch calls on it spent the budget on them, and the critical
        or interactive call failing next found none (review finding); batch callers (the job
        runner) retry on their own."""
        return self._reserve / 2

    def try_spend(self, now_s: float, *, keep: float = 0.0) -> bool:
        """Withdraw one token for a retry, leaving at least `keep`; False (and nothing
        withdrawn) if none is left.
        Deposits pay first, the oldest first, and the reserve only for what they cannot: a
        retry paid by deposits expires with them, instead of outliving them as a debt on the
        reserve (then the balance would stay below zero for up to a window after traffic
        stops, and not even the reserve's retries would get through)."""
        if not self.has_token(now_s, keep=keep):
            return False
        current = math.floor(now_s / self._slice_s)
        owed = 1.0
        for number in range(current - _NUM_SLICES + 1, current + 1):
            index = number % _NUM_SLICES
            if self._slice_number[index] != number or self._net[index] <= 0.0:
                continue
            paid = min(owed, self._net[index])
            self._net[index] -= paid
            owed -= paid
            if owed <= 0.0:
                return True
        self._net[self._slot(now_s)] -= owed  # from the reserve, for a window
        return True

    def has_token(self, now_s: float, *, keep: float = 0.0) -> bool:
        """Whether `try_spend` would grant a retry now (nothing withdrawn)."""
        # The epsilon absorbs float error from summing fractional deposits (5 x 0.2 < 1.0).
        return self.balance(now_s) >= 1.0 + keep - 1e-9

    def balance(self, now_s: float) -> float:
        """Tokens available for retries now."""
        current = math.floor(now_s / self._slice_s)
        in_window = (
            net
            for net, number in zip(self._net, self._slice_number, strict=True)
            if current - _NUM_SLICES < number <= current
        )
        return self._reserve + sum(in_window)

    def _slot(self, now_s: float) -> int:
        number = math.floor(now_s / self._slice_s)
        index = number % _NUM_SLICES
        if self._slice_number[index] != number:
            self._slice_number[index] = number
            self._net[index] = 0.0
        return index
