"""How many rows one batch of a key may hold (the Batcher's, kept apart): the shapes warm-up
measures, and the largest batch predicted to run within half of what the SLO leaves the
worker."""

from __future__ import annotations

from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.types import BatcherConfig, BatchKey


def shape_limit(max_batch_size: int, max_batch_tokens: int, bucket: int) -> int:
    """Most rows one batch of a `bucket`-token key may ever hold: `max_batch_size`, and the
    padded-token cap `max_batch_tokens` (0: none) over the bucket, at least one row."""
    if max_batch_tokens > 0 and bucket > 0:
        return min(max_batch_size, max(1, max_batch_tokens // bucket))
    return max_batch_size


def batch_compute_budget_s(config: BatcherConfig) -> float:
    """The longest one batch may be predicted to run (BatchSizes.batch_compute_budget_s)."""
    return (config.slo_s - config.upstream_budget_s - config.safety_margin_s) / 2


class BatchSizes:
    """The batch-size limits of one batcher's keys, from its `config` and `latency` model."""

    def __init__(self, config: BatcherConfig, latency: LatencyModel) -> None:
        self._config = config
        self._latency = latency
        # key -> (latency model revision, max_batch_size_for): recomputed after observations.
        self._limits: dict[BatchKey, tuple[int, int]] = {}

    @property
    def safety_margin_s(self) -> float:
        """The margin every admission forecast keeps below a row's limit."""
        return self._config.safety_margin_s

    def shape_limit(self, key: BatchKey) -> int:
        """Most items one batch of `key` may ever hold: max_batch_size, and the padded-token
        cap. The shapes warm-up measures."""
        config = self._config
        return shape_limit(config.max_batch_size, config.max_batch_tokens, key.bucket)

    @property
    def batch_compute_budget_s(self) -> float:
        """The longest one batch may be predicted to run: half of what the SLO leaves the
        worker. A row that arrives as a batch starts waits for it, then runs in the next: two
        batches must fit the SLO, whatever else is queued (a long bucket's batch must not hold
        short rows past it)."""
        return batch_compute_budget_s(self._config)

    def max_batch_size_for(self, key: BatchKey) -> int:
        """Most items one batch of `key` holds now: the shape limit, and the largest batch
        predicted to run within `batch_compute_budget_s` (at least 1). It shrinks when the
        machine slows down and grows back with it."""
        cached = self._limits.get(key)
        if cached is not None and cached[0] == self._latency.revision:
            return cached[1]
        budget_s = self.batch_compute_budget_s
        limit = self._latency.largest_batch_within(key, self.shape_limit(key), budget_s)
        self._limits[key] = (self._latency.revision, limit)
        return limit
