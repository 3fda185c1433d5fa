"""A lane of the simulated worker: one model's batcher, latency model and service-time curve,
as a lane of the real driver (services/gpu_worker/batching/lane.py) holds one model version's.
The lanes of a worker share its executor and its fair-share ledger (worker.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.latency_model import LatencyModel, folded_row_cost
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.slo_shedding import SloShedding
from services.gpu_worker.batching.types import BatcherConfig, BatchKey
from services.sim.curve import LatencyCurve, ServiceTime


@dataclass(frozen=True)
class ModelSpec:
    """The slice of a model's configuration the simulated worker serves it with."""

    name: str
    version: str = "1"
    fingerprint: str = "sim"
    slo_s: float = 0.25
    max_batch_size: int = 64
    max_queue_size: int = 2048
    max_batch_tokens: int = 0
    length_buckets: tuple[int, ...] = (16,)
    shed_past_slo: bool = False
    default_timeout_s: float = 30.0

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest bucket holding `num_tokens` (longer inputs run in the last one: the
        real gateway refuses them, traffic files should not contain them)."""
        return next((b for b in self.length_buckets if b >= num_tokens), self.length_buckets[-1])

    def key(self, bucket: int) -> BatchKey:
        return BatchKey(self.name, self.version, self.fingerprint, bucket)


class SimLane:
    """One model on a simulated worker: its batcher and latency model (seeded with the curve,
    as warm-up leaves them), and the executor's truth for its batches."""

    def __init__(
        self,
        spec: ModelSpec,
        curve: LatencyCurve,
        driver: DriverConfig,
        ledger: ComputeLedger,
        *,
        noise_sigma: float,
        rng: random.Random,
    ) -> None:
        self.spec = spec
        # One BatchKey object per bucket, so the policy's dicts find it by identity.
        self.keys = {bucket: spec.key(bucket) for bucket in spec.length_buckets}
        self.latency = LatencyModel(spread_weight=driver.prediction_spreads)
        curve.seed(self.latency, self.keys)
        self.batcher = Batcher(_batcher_config(spec, driver), self.latency, ledger)
        self.service = ServiceTime(curve.truth(self.keys), noise_sigma, rng)
        #: When new rows must finish within the SLO, as the real lane's (slo_shedding.py).
        self.shedding = SloShedding.for_model(spec.slo_s, spec.shed_past_slo, driver)
        #: EWMA over dispatched rows of the predicted per-row cost of their key at full
        #: batches (the real lane's `row_cost_s`); None until the first batch.
        self.row_cost_s: float | None = None
        self._key_of_tokens: dict[int, BatchKey] = {}

    def key_for(self, num_tokens: int) -> BatchKey:
        """The batch key of an input of `num_tokens` (cached: one lookup per request)."""
        key = self._key_of_tokens.get(num_tokens)
        if key is None:
            key = self._key_of_tokens[num_tokens] = self.keys[self.spec.bucket_for(num_tokens)]
        return key

    def record_row_cost(self, per_row_s: float, num_rows: int) -> None:
        """Folds a dispatched batch into `row_cost_s`, as the real lane does."""
        self.row_cost_s = folded_row_cost(self.row_cost_s, per_row_s, num_rows)


def _batcher_config(spec: ModelSpec, driver: DriverConfig) -> BatcherConfig:
    """The batcher's settings, as the driver's `_lane_for` builds them."""
    return BatcherConfig(
        max_batch_size=spec.max_batch_size,
        max_queue_size=spec.max_queue_size,
        slo_s=spec.slo_s,
        upstream_budget_s=driver.upstream_budget_s,
        safety_margin_s=driver.safety_margin_s,
        max_wait_cap_s=driver.max_wait_cap_s,
        max_batch_tokens=spec.max_batch_tokens,
        min_expected_arrivals=driver.min_expected_arrivals,
        tenant_weights=driver.tenant_weights,
    )
