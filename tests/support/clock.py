"""A clock a test moves by hand."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FakeClock:
    """Called as time.monotonic is; returns `now_s`, which the test sets or advances."""

    now_s: float = 1000.0

    def __call__(self) -> float:
        return self.now_s
