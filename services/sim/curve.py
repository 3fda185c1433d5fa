"""Measured batch compute times: the simulated executor's truth, and the worker's warm-up.

A curve is seconds per (length bucket, batch size). It is read from either
- `make bench-model`'s output (bench/results/raw_model.json: `points` of `num_tokens`,
  `batch_size`, `sequences_per_s`; seconds = batch_size / sequences_per_s), or
- a curve file given for a GPU: `{"points": [{"bucket": 16, "batch_size": 8, "seconds": 0.004}]}`.

Between and beyond measured points the real `LatencyModel` interpolates (a model that never
learns: `slowdown_alpha=0`), so the simulated executor and the simulated worker's predictions
read one curve the same way, as warm-up leaves them on a real worker.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.types import BatchKey


@dataclass(frozen=True)
class LatencyCurve:
    """Compute seconds of one batch per (bucket, batch size), as measured."""

    #: ((bucket, batch_size), seconds), sorted.
    points: tuple[tuple[tuple[int, int], float], ...]
    #: Multiplier on every point: a GPU `speedup` of 4 divides by 4 (scenario files set it).
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a latency curve needs at least one point")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"a latency curve's scale must be finite and > 0, got {self.scale}")
        for (bucket, size), seconds in self.points:
            if bucket < 0 or size < 1 or not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"bad curve point: bucket {bucket}, batch {size}, {seconds}s")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, scale: float = 1.0) -> LatencyCurve:
        points: dict[tuple[int, int], float] = {}
        for point in raw.get("points", ()):
            if "seconds" in point:
                bucket, seconds = int(point["bucket"]), float(point["seconds"])
            else:
                bucket = int(point["num_tokens"])
                seconds = int(point["batch_size"]) / float(point["sequences_per_s"])
            points[(bucket, int(point["batch_size"]))] = seconds
        return cls(tuple(sorted(points.items())), scale)

    @classmethod
    def load(cls, path: Path, *, scale: float = 1.0) -> LatencyCurve:
        return cls.from_mapping(json.loads(path.read_text()), scale=scale)

    @classmethod
    def linear(
        cls, buckets: Iterable[int], sizes: Iterable[int], *, fixed_s: float, per_token_s: float
    ) -> LatencyCurve:
        """fixed_s + per_token_s x bucket x batch_size: a synthetic accelerator-like curve."""
        points = [
            ((b, n), fixed_s + per_token_s * b * n) for b in sorted(buckets) for n in sorted(sizes)
        ]
        return cls(tuple(points))

    def to_mapping(self) -> dict[str, Any]:
        return {
            "points": [
                {"bucket": b, "batch_size": n, "seconds": s * self.scale}
                for (b, n), s in self.points
            ]
        }

    def seed(self, model: LatencyModel, key_for_bucket: Mapping[int, BatchKey]) -> None:
        """Observes every point of the buckets in `key_for_bucket` into `model`, as warm-up
        does; a bucket the curve lacks is left to the model's nearest-bucket fallback."""
        for (bucket, size), seconds in self.points:
            key = key_for_bucket.get(bucket)
            if key is not None:
                model.observe(key, size, seconds * self.scale)

    def truth(self, key_for_bucket: Mapping[int, BatchKey]) -> LatencyModel:
        """A latency model that never learns, seeded with this curve: the executor's truth."""
        model = LatencyModel(slowdown_alpha=0.0)
        self.seed(model, key_for_bucket)
        return model

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted({bucket for (bucket, _), _ in self.points}))

    def beyond(self, bucket: int, rows: int) -> str | None:
        """What batches of up to `rows` of `bucket` take that was never measured (None: all
        measured): another bucket's times, or sizes past the largest measured, extrapolated
        (flat where the measured curve ends flat)."""
        sizes = [size for (b, size), _ in self.points if b == bucket]
        if not sizes:
            return f"bucket {bucket} not measured: timed from another bucket"
        if rows > max(sizes):
            return f"bucket {bucket}: batches of up to {rows} rows, measured up to {max(sizes)}"
        return None


class ServiceTime:
    """Compute seconds of a dispatched batch: the curve, times lognormal noise (median 1)
    of `noise_sigma` (0: exactly the curve)."""

    def __init__(self, truth: LatencyModel, noise_sigma: float, rng: random.Random) -> None:
        if noise_sigma < 0:
            raise ValueError("noise_sigma must be >= 0")
        self._truth = truth
        self._sigma = noise_sigma
        self._rng = rng
        self._cache: dict[tuple[BatchKey, int], float] = {}

    def seconds(self, key: BatchKey, batch_size: int) -> float:
        cached = self._cache.get((key, batch_size))
        if cached is None:
            cached = self._cache[(key, batch_size)] = self._truth.predict(key, batch_size)
        if self._sigma == 0:
            return cached
        return cached * self._rng.lognormvariate(0.0, self._sigma)
