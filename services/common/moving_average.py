"""An exponentially weighted moving average that starts at its first value (pure).

The tiers follow several quantities this way: the gap between calls (a stream's write linger,
a batching key's arrivals), a model's time downstream (the gateway's bundle clock), the
retry hints downstream sends (the gateway's throttle).
"""

from __future__ import annotations


class MovingAverage:
    def __init__(self, weight: float) -> None:
        """`weight`: the newest value's share of the average, in (0, 1]."""
        if not 0 < weight <= 1:
            raise ValueError(f"a moving average's weight must be in (0, 1], got {weight}")
        self.weight = weight
        #: The average so far; None before the first value.
        self.mean: float | None = None

    def observe(self, value: float) -> float:
        """Folds `value` in; returns the new average."""
        mean = self.mean
        self.mean = value if mean is None else mean + self.weight * (value - mean)
        return self.mean

    def observe_at_least(self, bound: float) -> float | None:
        """Folds in a value known only to be at least `bound` (a wait cut short before it
        ended): one above the average moves it up, as `observe` would; one below it says
        nothing, and leaves it. Returns the average."""
        if self.mean is None or bound > self.mean:
            return self.observe(bound)
        return self.mean

    def observe_repeated(self, value: float, times: int) -> None:
        """Folds `value` in `times` times, as as many `observe` calls would."""
        weight, mean = self.weight, self.mean
        for _ in range(times):
            mean = value if mean is None else mean + weight * (value - mean)
        self.mean = mean
