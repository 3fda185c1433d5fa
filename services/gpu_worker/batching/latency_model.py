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
    """EWMA of measured compute seconds per (key, batch size), with interpolation between sizes,
    times a per-family slowdown factor.

    Predictions are monotone non-decreasing in batch size for every key.

    Two speeds of learning. Each point moves slowly (`ewma_alpha`), and one slow observation
    (a busy core, a page fault) moves it by at most `ewma_alpha x (max_jump - 1)` of itself, so
    a stray outlier fades within a few batches. The slowdown factor is the EWMA
    (`slowdown_alpha`) of observed / predicted over every batch of the family, whatever its
    shape: when the machine gets slower for everyone (other processes taking the cores under
    overload), batches of every size are predicted slower within a few batches, not only the
    shapes that happened to run. As the points catch up, observed / predicted returns to 1 and
    so does the factor. Fast observations are never clipped: an over-estimate refuses work,
    and recovering from it must not wait.
    """

    def __init__(
        self,
        *,
        ewma_alpha: float = 0.2,
        slowdown_alpha: float = 0.2,
        default_s: float = 0.01,
        max_jump: float = 2.0,
        max_ratio: float = 2.0,
    ) -> None:
        """`ewma_alpha` is the weight of each new observation in its point, `slowdown_alpha`
        its weight in the family's slowdown factor (0: no factor); `default_s` is the
        prediction for a key whose family (model, version, fingerprint) has never been
        measured; `max_jump` caps an observation at that multiple of its point's estimate,
        and `max_ratio` one batch's observed / predicted in the slowdown factor (both ways)."""
        if not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha}")
        if not 0.0 <= slowdown_alpha <= 1.0:
            raise ValueError(f"slowdown_alpha must be in [0, 1], got {slowdown_alpha}")
        if not (math.isfinite(default_s) and default_s > 0.0):
            raise ValueError(f"default_s must be positive and finite, got {default_s}")
        for name, bound in (("max_jump", max_jump), ("max_ratio", max_ratio)):
            if not (math.isfinite(bound) and bound >= 1.0):
                raise ValueError(f"{name} must be >= 1 and finite, got {bound}")
        self._alpha = ewma_alpha
        self._slowdown_alpha = slowdown_alpha
        self._default_s = default_s
        self._max_jump = max_jump
        self._max_ratio = max_ratio
        self._slowdown: dict[_Family, float] = {}
        #: Incremented by every observation: callers cache what they derive from predictions.
        self.revision = 0
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
        family = _family(key)
        known = self._points.get(key)
        if known and min(known) <= batch_size <= max(known):
            # How far off the curve was before this observation corrects it. Only within the
            # measured sizes: beyond them the curve is a guess, and seeding a new size (as
            # warm-up does) is not evidence that the machine got slower.
            ratio = seconds / max(self._curve(key).at(batch_size), MIN_PREDICTION_S)
            ratio = min(max(ratio, 1.0 / self._max_ratio), self._max_ratio)
            factor = self._slowdown.get(family, 1.0)
            self._slowdown[family] = factor + self._slowdown_alpha * (ratio - factor)
        points = self._points.setdefault(key, {})
        previous = points.get(batch_size)
        if previous is None:
            points[batch_size] = seconds
        else:
            seconds = min(seconds, previous * self._max_jump)
            points[batch_size] = previous + self._alpha * (seconds - previous)
        self._families.setdefault(family, set()).add(key)
        self._curves.pop(key, None)
        self.revision += 1

    def slowdown(self, key: BatchKey) -> float:
        """The family's current observed / predicted factor (1.0 before any re-observation)."""
        return self._slowdown.get(_family(key), 1.0)

    def predict(self, key: BatchKey, batch_size: int) -> float:
        """Predicted compute seconds for one batch of `batch_size` items of `key`.

        Falls back, in order, to: this key's curve (exact, interpolated or extrapolated); the
        curve of the nearest measured bucket of the same model/version/fingerprint, scaled by
        the bucket ratio; `default_s`.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if key in self._points:
            return max(self._curve(key).at(batch_size) * self.slowdown(key), MIN_PREDICTION_S)
        siblings = self._families.get(_family(key))
        if not siblings:
            return self._default_s
        # Nearest bucket; on a tie the larger one, whose scaled curve is the pessimistic one.
        nearest = min(siblings, key=lambda k: (abs(k.bucket - key.bucket), -k.bucket))
        ratio = key.bucket / nearest.bucket if key.bucket > 0 and nearest.bucket > 0 else 1.0
        seconds = self._curve(nearest).at(batch_size) * ratio * self.slowdown(key)
        return max(seconds, MIN_PREDICTION_S)

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
