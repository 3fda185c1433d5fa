"""Online model of batch compute time per (batch key, batch size).

Warm-up records every (bucket, batch size) the worker may run and every executed batch refines
the estimate. The batcher asks it how long a batch would take (to derive linger and deadline
slack); routers ask for the cost per item. Pure: the caller measures and reports seconds.
"""

from __future__ import annotations

import math
from bisect import bisect_left

from services.gpu_worker.batching.types import BatchKey

#: Floor on every prediction: a batch never costs nothing, and callers divide by predictions.
MIN_PREDICTION_S = 1e-6

#: (model, version, fingerprint): keys of one family differ only in bucket and share a curve shape.
_Family = tuple[str, str, str]


def _family(key: BatchKey) -> _Family:
    return (key.model, key.version, key.fingerprint)


class _Curve:
    """Known points of one key, made monotone so that a bigger batch never looks cheaper."""

    def __init__(self, points: dict[int, float]) -> None:
        self.sizes = sorted(points)
        # Running maximum: EWMA noise can make size 16 look cheaper than size 8, which would
        # reward the batcher for waiting; the envelope removes that without losing real data.
        self.seconds: list[float] = []
        for size in self.sizes:
            self.seconds.append(max(points[size], self.seconds[-1] if self.seconds else 0.0))

    def at(self, batch_size: int) -> float:
        sizes, seconds = self.sizes, self.seconds
        i = bisect_left(sizes, batch_size)
        if i < len(sizes) and sizes[i] == batch_size:
            return seconds[i]
        if 0 < i < len(sizes):
            lo, hi = sizes[i - 1], sizes[i]
            fraction = (batch_size - lo) / (hi - lo)
            return seconds[i - 1] + fraction * (seconds[i] - seconds[i - 1])
        if i == len(sizes):
            if len(sizes) == 1:
                # One point says nothing about the slope: assume cost grows with rows, the
                # pessimistic reading for a batch bigger than any measured.
                return seconds[0] * batch_size / sizes[0]
            slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
            return seconds[-1] + slope * (batch_size - sizes[-1])
        # Below the smallest known size: interpolate from the zero-size intercept (the fixed
        # cost). With one point, assume the fixed cost is all of it: the pessimistic reading for
        # a smaller batch, and the usual truth on an accelerator.
        if len(sizes) == 1:
            intercept = seconds[0]
        else:
            slope = (seconds[1] - seconds[0]) / (sizes[1] - sizes[0])
            intercept = min(max(seconds[0] - slope * sizes[0], 0.0), seconds[0])
        return intercept + (seconds[0] - intercept) * batch_size / sizes[0]


class LatencyModel:
    """EWMA of measured compute seconds per (key, batch size), with interpolation between sizes.

    Predictions are monotone non-decreasing in batch size for every key.
    """

    def __init__(self, *, ewma_alpha: float = 0.2, default_s: float = 0.01) -> None:
        """`ewma_alpha` is the weight of each new observation; `default_s` is the prediction
        for a key whose family (model, version, fingerprint) has never been measured."""
        if not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha}")
        if not (math.isfinite(default_s) and default_s > 0.0):
            raise ValueError(f"default_s must be positive and finite, got {default_s}")
        self._alpha = ewma_alpha
        self._default_s = default_s
        self._points: dict[BatchKey, dict[int, float]] = {}
        self._families: dict[_Family, set[BatchKey]] = {}
        # Rebuilt lazily: observe() runs once per batch, predict() many times per poll.
        self._curves: dict[BatchKey, _Curve] = {}

    def observe(self, key: BatchKey, batch_size: int, seconds: float) -> None:
        """Record that a batch of `batch_size` items of `key` took `seconds` to compute."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds must be non-negative and finite, got {seconds}")
        points = self._points.setdefault(key, {})
        previous = points.get(batch_size)
        if previous is None:
            points[batch_size] = seconds
        else:
            points[batch_size] = previous + self._alpha * (seconds - previous)
        self._families.setdefault(_family(key), set()).add(key)
        self._curves.pop(key, None)

    def predict(self, key: BatchKey, batch_size: int) -> float:
        """Predicted compute seconds for one batch of `batch_size` items of `key`.

        Falls back, in order, to: this key's curve (exact, interpolated or extrapolated); the
        curve of the nearest measured bucket of the same model/version/fingerprint, scaled by
        the bucket ratio; `default_s`.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if key in self._points:
            return max(self._curve(key).at(batch_size), MIN_PREDICTION_S)
        siblings = self._families.get(_family(key))
        if not siblings:
            return self._default_s
        # Nearest bucket; on a tie the larger one, whose scaled curve is the pessimistic one.
        nearest = min(siblings, key=lambda k: (abs(k.bucket - key.bucket), -k.bucket))
        ratio = key.bucket / nearest.bucket if key.bucket > 0 and nearest.bucket > 0 else 1.0
        return max(self._curve(nearest).at(batch_size) * ratio, MIN_PREDICTION_S)

    def per_item_s(self, key: BatchKey, batch_size: int) -> float:
        """Predicted compute seconds per item when running batches of `batch_size`."""
        return self.predict(key, batch_size) / batch_size

    def known_keys(self) -> tuple[BatchKey, ...]:
        """Keys with at least one observation, sorted."""
        return tuple(sorted(self._points))

    def known_sizes(self, key: BatchKey) -> tuple[int, ...]:
        """Batch sizes observed for `key`, ascending (empty if the key was never observed)."""
        return tuple(sorted(self._points.get(key, ())))

    def _curve(self, key: BatchKey) -> _Curve:
        curve = self._curves.get(key)
        if curve is None:
            curve = self._curves[key] = _Curve(self._points[key])
        return curve
