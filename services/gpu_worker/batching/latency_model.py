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
#: A batch gap (LatencyModel.batch_gap_s) halves every this many seconds no batch refreshes it.
GAP_HALF_LIFE_S = 0.5

#: (model, version, fingerprint): keys of one family differ only in bucket and share a curve shape.
_Family = tuple[str, str, str]


def _family(key: BatchKey) -> _Family:
    return (key.model, key.version, key.fingerprint)


def _own_or_family(
    by_key: dict[BatchKey, float], by_family: dict[_Family, float], key: BatchKey, default: float
) -> float:
    """`key`'s own learned value, else its family's, else `default`."""
    value = by_key.get(key)
    return by_family.get(_family(key), default) if value is None else value


class _Curve:
    """Known points of one key, made monotone so that a bigger batch never looks cheaper."""

    def __init__(self, points: dict[int, float]) -> None:
        self.sizes = sorted(points)
        # Running maximum: EWMA noise can make size 16 look cheaper than size 8, which would
        # reward the batcher for waiting; the envelope removes that without losing real data.
        self.seconds: list[float] = []
        for size in self.sizes:
            self.seconds.append(max(points[size], self.seconds[-1] if self.seconds else 0.0))
        # A curve lives until its key gets a new point; scales move with every batch.
        self._at: dict[int, float] = {}

    def at(self, batch_size: int) -> float:
        seconds = self._at.get(batch_size)
        if seconds is None:
            seconds = self._at[batch_size] = self._interpolate(batch_size)
        return seconds

    def _interpolate(self, batch_size: int) -> float:
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


class _Prediction:
    """How one key is predicted until the next observation: the curve it reads (its own, or
    its nearest sibling's times `ratio`), times `scale`, or `default_s` without a curve; and
    the answers given so far."""

    __slots__ = ("_curve", "_default_s", "_ratio", "_scale", "_seconds")

    def __init__(
        self, curve: _Curve | None, ratio: float | None, scale: float, default_s: float
    ) -> None:
        self._curve = curve
        self._ratio = ratio
        self._scale = scale
        self._default_s = default_s
        self._seconds: dict[int, float] = {}

    def at(self, batch_size: int) -> float:
        seconds = self._seconds.get(batch_size)
        if seconds is None:
            if batch_size < 1:
                raise ValueError(f"batch_size must be >= 1, got {batch_size}")
            seconds = self._seconds[batch_size] = self._compute(batch_size)
        return seconds

    def _compute(self, batch_size: int) -> float:
        if self._curve is None:
            return self._default_s
        if self._ratio is None:
            return max(self._curve.at(batch_size) * self._scale, MIN_PREDICTION_S)
        return max(self._curve.at(batch_size) * self._ratio * self._scale, MIN_PREDICTION_S)


class LatencyModel:
    """Compute seconds per (key, batch size): a measured curve times a learned scale, plus a
    margin of the scale's spread.

    The curve is the shape: each batch size's first measurement (warm-up measures every shape
    the worker may run), interpolated between sizes and extrapolated beyond them, made
    monotone. It is never rewritten by serving traffic: a shape seen once under a stall, or
    only under overload, must not stay inflated for good. Serving batches teach the *scale*
    instead: the EWMA (`slowdown_alpha`) of observed / curve over every batch, per key, with
    each batch's ratio bounded to within a factor `max_ratio` of the scale. Any batch of a key
    moves its scale, whatever its size, so the estimate cannot get stuck on a shape that no
    longer runs:

    - one outlier moves the scale by at most `slowdown_alpha x (max_ratio - 1)` of itself, and
      the next normal batches take it back;
    - when the machine slows down for everyone (other processes taking the cores under
      overload), every size of the key is predicted slower within a few batches, however
      much slower it is (a small CPU model beside a flooded gateway runs 2-3x its warm-up);
    - keys without batches of their own yet use their family's scale (same model, version and
      fingerprint), learned from all its keys.

    A batch size beyond the measured ones (bigger than warm-up ran) becomes a new point of the
    curve, divided by the key's scale so that it records shape, not the moment's contention.

    A worker's predictions (`--prediction-spreads`, 2 by default; the class's default is the
    scale alone) carry the scale plus `spread_weight` times its *spread*, the moving mean of
    each batch's distance from the scale (its ratio bounded as for the scale's step, smoothed
    by `spread_alpha`): Jacobson's retransmission timer, which waits for the smoothed round
    trip plus four times its mean deviation. A row admitted by the middle of its batch's likely
    times is late whenever the batch runs slow; by the slow end, only when the batch runs
    slower than usual. On a GPU, or a CPU to itself, the spread is near 0 and so is the margin.
    On a CPU shared with a flooded gateway, batches spread widely: minilm beside a 2x flood on
    this 2-core machine ran a median batch in under 75 ms and its p99 in 200-300 ms. There
    (`python -m bench.flood_tail`, 0 spreads against 2, alternating twice; docs/benchmarks.md)
    answers within the SLO went from 99.6 and 92.4 to 132.6 and 129.6 a second, and the
    accepted calls' p99 from 365 and 354 ms to 329 and 263 ms. The spread is per key, and per
    family for keys without batches of their own, as the scale is.
    """

    def __init__(
        self,
        *,
        slowdown_alpha: float = 0.2,
        default_s: float = 0.01,
        max_ratio: float = 2.0,
        spread_weight: float = 0.0,
        spread_alpha: float = 0.25,
    ) -> None:
        """`slowdown_alpha` is the weight of each batch in its key's and family's scale (0:
        no learning, the curve alone); `default_s` is the prediction for a key whose family
        (model, version, fingerprint) has never been measured; `max_ratio` bounds one batch's
        observed / curve ratio both ways, relative to the scale learned so far;
        `spread_weight` is how many spreads of the scale predictions add to it (0: the scale
        alone), `spread_alpha` the weight of each batch in the spread."""
        if not 0.0 <= slowdown_alpha <= 1.0:
            raise ValueError(f"slowdown_alpha must be in [0, 1], got {slowdown_alpha}")
        if not (0.0 <= spread_alpha <= 1.0 and math.isfinite(spread_weight)
                and spread_weight >= 0.0):  # fmt: skip
            raise ValueError(
                f"spread_alpha must be in [0, 1] and spread_weight finite and >= 0, got "
                f"{spread_alpha} and {spread_weight}"
            )
        if not (math.isfinite(default_s) and default_s > 0.0):
            raise ValueError(f"default_s must be positive and finite, got {default_s}")
        if not (math.isfinite(max_ratio) and max_ratio >= 1.0):
            raise ValueError(f"max_ratio must be >= 1 and finite, got {max_ratio}")
        self._slowdown_alpha = slowdown_alpha
        self._default_s = default_s
        self._max_ratio = max_ratio
        self._spread_weight = spread_weight
        self._spread_alpha = spread_alpha
        self._key_scale: dict[BatchKey, float] = {}
        self._family_scale: dict[_Family, float] = {}
        #: Each scale's spread: the moving mean of |bounded ratio - scale|.
        self._key_spread: dict[BatchKey, float] = {}
        self._family_spread: dict[_Family, float] = {}
        #: Incremented by every observation: callers cache what they derive from predictions.
        self.revision = 0
        #: Seconds the executor stands idle between batches while rows wait (the event loop's
        #: turn to see a batch end and dispatch the next), as of `batch_gap_as_of_s`
        #: (batch_gap.BatchGap sets both): a queue's forecast counts it once a batch
        #: (`batch_gap_at`, key_queue.drain_s), not the curve.
        self.batch_gap_s = 0.0
        self.batch_gap_as_of_s = 0.0
        self._points: dict[BatchKey, dict[int, float]] = {}
        self._families: dict[_Family, set[BatchKey]] = {}
        # Rebuilt lazily: observe() runs once per batch, predict() many times per poll.
        self._curves: dict[BatchKey, _Curve] = {}
        # How each key is predicted, until the next observation (which may move any key's
        # curve or scale): a poll asks for the same few predictions again and again.
        self._predictions: dict[BatchKey, _Prediction] = {}

    def batch_gap_at(self, now_s: float) -> float:
        """`batch_gap_s` at `now_s`, halved every GAP_HALF_LIFE_S since the batch that set it:
        batches under a flood refresh it every few ms, and a gap a flood taught does not
        price the next burst of a worker idle since."""
        if not self.batch_gap_s:
            return 0.0
        since_s = max(0.0, now_s - self.batch_gap_as_of_s)
        return self.batch_gap_s * math.exp(-math.log(2.0) * since_s / GAP_HALF_LIFE_S)

    def observe(self, key: BatchKey, batch_size: int, seconds: float) -> None:
        """Record that a batch of `batch_size` items of `key` took `seconds` to compute."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds must be non-negative and finite, got {seconds}")
        family = _family(key)
        points = self._points.setdefault(key, {})
        self._families.setdefault(family, set()).add(key)
        self.revision += 1
        self._predictions.clear()
        if points and min(points) <= batch_size <= max(points):
            ratio = seconds / max(self._curve(key).at(batch_size), MIN_PREDICTION_S)
            scale = self.slowdown(key)
            spread = self.spread(key)
            self._key_scale[key], self._key_spread[key] = self._learned(scale, spread, ratio)
            family_scale = self._family_scale.get(family, 1.0)
            family_spread = self._family_spread.get(family, 0.0)
            self._family_scale[family], self._family_spread[family] = self._learned(
                family_scale, family_spread, ratio
            )
            return
        points[batch_size] = seconds / self.slowdown(key)
        self._curves.pop(key, None)

    def _learned(self, scale: float, spread: float, ratio: float) -> tuple[float, float]:
        """`scale` and its `spread` after one batch's observed / curve `ratio`, bounded to
        within `max_ratio` of the scale itself: one outlier moves either by a bounded step,
        and a lasting slowdown of any size is learned, geometrically (bounded to within
        `max_ratio` of 1 instead, a machine three times slower would be predicted at most
        twice as slow, for good)."""
        ratio = min(max(ratio, scale / self._max_ratio), scale * self._max_ratio)
        spread += self._spread_alpha * (abs(ratio - scale) - spread)
        return scale + self._slowdown_alpha * (ratio - scale), spread

    def spread(self, key: BatchKey) -> float:
        """How far `key`'s batches fall from its scale, on average (its family's while it has
        no batches of its own; 0.0 before any)."""
        return _own_or_family(self._key_spread, self._family_spread, key, 0.0)

    def _margined(self, key: BatchKey) -> float:
        """The scale predictions of `key` carry: its slowdown plus `spread_weight` spreads."""
        return self.slowdown(key) + self._spread_weight * self.spread(key)

    def budget_share(self, key: BatchKey, spread_weight: float) -> float:
        """The share of a time budget that predictions of `key` (its scale plus this model's
        `spread_weight` spreads) may fill for what they predict to end within it by
        `spread_weight` spreads instead: (scale + own weight x spread) / (scale + weight x
        spread). A forecast's finish that fits the budget times this share fits the whole
        budget at the other margin, wherever the forecast is batch compute. It errs strict: the
        lingers and safety margin a forecast also counts are cut too, and so is a row predicted
        on its floor (`predict_bounded`), whose margin the floor already bounds. It is never
        below own weight / weight: however wide the spread, four spreads against two cut at
        most half of a budget. 1.0 with no spread (a GPU, or a CPU to itself) or the same
        weight."""
        if spread_weight == self._spread_weight:
            return 1.0  # the default (--slo-prediction-spreads as --prediction-spreads): no lookup
        spread = self.spread(key)
        if spread == 0.0:
            return 1.0
        return self._margined(key) / (self.slowdown(key) + spread_weight * spread)

    def slowdown(self, key: BatchKey) -> float:
        """The learned scale of `key`, without its spread's margin: observed / curve, smoothed
        (its family's while it has no batches of its own; 1.0 before any)."""
        return _own_or_family(self._key_scale, self._family_scale, key, 1.0)

    def family_slowdown(self, key: BatchKey) -> float:
        """The scale of `key`'s family: observed / curve over all its keys' batches."""
        return self._family_scale.get(_family(key), 1.0)

    def predict(self, key: BatchKey, batch_size: int) -> float:
        """Predicted compute seconds for one batch of `batch_size` items of `key`.

        Falls back, in order, to: this key's curve (exact, interpolated or extrapolated); the
        curve of the nearest measured bucket of the same model/version/fingerprint, scaled by
        the bucket ratio; `default_s`.
        """
        prediction = self._predictions.get(key)
        if prediction is None:
            prediction = self._prediction(key)
        return prediction.at(batch_size)

    def _prediction(self, key: BatchKey) -> _Prediction:
        prediction = self._predictions.get(key)
        if prediction is not None:
            return prediction
        if self._points.get(key):
            prediction = _Prediction(self._curve(key), None, self._margined(key), self._default_s)
        else:
            siblings = [k for k in self._families.get(_family(key), ()) if self._points.get(k)]
            if siblings:
                # Nearest bucket; on a tie the larger one, whose scaled curve is the
                # pessimistic one.
                nearest = min(siblings, key=lambda k: (abs(k.bucket - key.bucket), -k.bucket))
                ratio = (
                    key.bucket / nearest.bucket if key.bucket > 0 and nearest.bucket > 0 else 1.0
                )
                curve = self._curve(nearest)
                prediction = _Prediction(curve, ratio, self._margined(key), self._default_s)
            else:
                prediction = _Prediction(None, None, 1.0, self._default_s)
        self._predictions[key] = prediction
        return prediction

    def predict_bounded(self, key: BatchKey, batch_size: int) -> float:
        """`predict`, its scale bounded to `max_ratio`: the floor rows are refused or dropped
        unrun by when nothing else of their lane is queued (a lane's admission with an empty
        queue, a queued row's expiry, a router's idle worker). A refusal there leaves no batch
        to correct the scale, so a slowdown learned in a stall, however large, must not turn
        every such row away for good (nor may its spread)."""
        seconds = self.predict(key, batch_size)
        scale = self._margined(key)
        if scale <= self._max_ratio:
            return seconds
        return max(seconds * self._max_ratio / scale, MIN_PREDICTION_S)

    def predict_alone(self, key: BatchKey) -> float:
        """One row of `key` alone, by the floor (`predict_bounded`)."""
        return self.predict_bounded(key, 1)

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

    def largest_batch_within(self, key: BatchKey, max_size: int, budget_s: float) -> int:
        """The largest batch of `key`, at most `max_size`, predicted to run within `budget_s`
        (at least 1): predictions grow with the batch size, so a bisection finds it."""
        prediction = self._prediction(key)
        low, high = 1, max_size
        while low < high:
            middle = (low + high + 1) // 2
            if prediction.at(middle) <= budget_s:
                low = middle
            else:
                high = middle - 1
        return low


#: Weight of one row in a lane's per-row cost EWMA (a batch of n rows weighs about n rows).
ROW_COST_ALPHA = 0.02


def folded_row_cost(row_cost_s: float | None, per_row_s: float, num_rows: int) -> float:
    """The per-row cost a load report carries, after a batch of `num_rows` rows whose predicted
    cost per row is `per_row_s` (the first batch sets it)."""
    if row_cost_s is None:
        return per_row_s
    weight = 1.0 - (1.0 - ROW_COST_ALPHA) ** num_rows
    return row_cost_s + weight * (per_row_s - row_cost_s)
