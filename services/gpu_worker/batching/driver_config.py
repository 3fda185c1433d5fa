"""The batching driver's worker-wide settings (per-model ones come from the model repository)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.gpu_worker.batching.failure_streak import FailingConfig


@dataclass(frozen=True)
class DriverConfig:
    """Worker-wide batching settings; per-model ones come from the model repository."""

    #: Part of each model's SLO reserved for gateway, router and the hops both ways. Measured
    #: on the 2-core benchmark machine under load: 30-60 ms between the gateway's answer time
    #: and the worker's.
    upstream_budget_s: float = 0.04
    #: Margin kept between predicted completion and a row's deadline.
    safety_margin_s: float = 0.005
    #: Spreads of the batch times' learned scale each prediction adds (latency_model: the
    #: slow end of a batch's likely times, not its middle); 0 predicts by the scale alone. Not
    #: 4, as Jacobson's timer: that refused a fifth of a cold burst (docs/benchmarks.md, item 4).
    prediction_spreads: float = 2.0
    #: Spreads a row bound by its model's SLO (slo_shedding.py) is predicted with, against that
    #: bound, for admission: its SLO budget is cut to the share that predictions with
    #: `prediction_spreads` may fill (LatencyModel.budget_share); a row bound by its caller's
    #: deadline alone (a cold burst's) keeps `prediction_spreads`. As many by default (no
    #: cut): four lowered a 2x flood's p50 and held its p99 within the SLO more often, but
    #: refused a sixth of the normal traffic right after a flood in one e2e run of three,
    #: while the spread learned in the flood was wide (docs/benchmarks.md, item 4).
    slo_prediction_spreads: float = 2.0
    #: Upper bound on the derived linger.
    max_wait_cap_s: float = 0.05
    #: When the executor is idle, linger only if at least this many more rows are expected
    #: before the linger expires, and the next one soon enough that waiting for it pays (the
    #: batcher's work-conserving trigger, `close_rule.linger_payoff_gap_s`); 0 always lingers.
    min_expected_arrivals: float = 1.0
    #: Deficit-round-robin shares per tenant; tenants not listed get weight 1.0.
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    #: Longest a model call may run before the worker declares itself wedged (seconds). The
    #: bound in force is the larger of this and `WARMUP_MULTIPLE` times the costliest warm-up
    #: batch (see batching.watchdog), so a slow model never trips it on a healthy batch.
    watchdog_s: float = 30.0
    #: torch intra-op threads of a backfill batch (`batch` rows only) held short beside
    #: recent online traffic: on a CPU worker the model's threads take every core, and the
    #: online path (this worker's event loop, the tiers on the same host) then waits for them.
    #: 0 runs it on the model's threads; -1 (the default) is resolved when the worker loads
    #: (execution.resolve_threads): half of torch's threads on a CPU, 0 on a GPU. A
    #: driver given -1 unresolved runs every batch on the model's threads.
    backfill_threads: int = -1
    #: torch intra-op threads a model's batch may run on, at most, on a CPU: each lane
    #: chooses among one, all but one and all of them (execution.batch_threads). 0 (the
    #: default) is resolved when the worker loads (execution.resolve_threads): torch's
    #: threads on a CPU, 0 on a GPU. A driver given 0 unresolved reads torch's as it builds
    #: each lane. The worker's generation engines choose their steps' threads up to the
    #: same resolved count (LoadOptions.host_threads).
    model_threads: int = 0
    #: Batches of a version in a row, over a second or more, each failed in every row, that
    #: mark it failing in the heartbeat, so that routers send its calls to other workers
    #: (batching.failure_streak); 0 never marks one.
    failing_batches_to_mark: int = FailingConfig.batches_to_mark

    def __post_init__(self) -> None:
        if min(self.upstream_budget_s, self.safety_margin_s, self.max_wait_cap_s) < 0:
            raise ValueError("upstream budget, safety margin and max_wait cap must be >= 0")
        if self.min_expected_arrivals < 0:
            raise ValueError("min_expected_arrivals must be >= 0")
        if not 0 <= self.prediction_spreads < float("inf"):
            raise ValueError("prediction_spreads must be finite and >= 0")
        if not 0 <= self.slo_prediction_spreads < float("inf"):
            raise ValueError("slo_prediction_spreads must be finite and >= 0")
        if self.watchdog_s <= 0:
            raise ValueError("watchdog_s must be > 0")
        if self.backfill_threads < -1:
            raise ValueError("backfill_threads must be >= -1")
        if self.model_threads < 0:
            raise ValueError("model_threads must be >= 0")
        if self.failing_batches_to_mark < 0:
            raise ValueError("failing_batches_to_mark must be >= 0")
