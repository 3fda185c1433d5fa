"""One simulated run: traffic into a fleet on an event loop, the HPA on top, and its summary."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from services.common.metric_names import WORKER_SECONDS_BUCKETS
from services.gpu_worker.batching.driver_config import DriverConfig
from services.sim.autoscaler import HorizontalAutoscaler, HpaConfig
from services.sim.curve import LatencyCurve
from services.sim.events import EventLoop
from services.sim.fleet import Fleet
from services.sim.fleet_config import FleetConfig
from services.sim.results import FleetTotals, Recorder, summarize
from services.sim.traffic import Traffic, schedule_arrivals
from services.sim.worker import ModelSpec

#: After the last arrival, the run goes on this long (at most) so in-flight requests finish.
DRAIN_S = 5.0


@dataclass(frozen=True)
class WorkerLoss:
    """At `at_s`, `num_workers` serving workers die at once (no drain)."""

    at_s: float
    num_workers: int


@dataclass(frozen=True)
class Scenario:
    """Everything one run needs. Every worker serves every model in `models`, one lane each
    (worker.py); `curves[i]` is the batch compute of `models[i]`."""

    name: str
    models: tuple[ModelSpec, ...]
    curves: tuple[LatencyCurve, ...]
    traffic: Traffic
    duration_s: float = 60.0
    #: Arrivals before this are not in the summary (latency models and throttle settle).
    warmup_s: float = 5.0
    seed: int = 1
    driver: DriverConfig = field(default_factory=DriverConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    hpa: HpaConfig | None = None
    losses: tuple[WorkerLoss, ...] = ()

    def __post_init__(self) -> None:
        names = [spec.name for spec in self.models]
        if not names or len(self.curves) != len(names):
            raise ValueError(f"{len(names)} models and {len(self.curves)} curves: one curve each")
        if len(set(names)) != len(names):
            raise ValueError(f"models {names}: each model once")
        if not (math.isfinite(self.duration_s) and 0.0 <= self.warmup_s < self.duration_s):
            raise ValueError(
                f"warmup_s {self.warmup_s} and duration_s {self.duration_s}: a run records "
                "what arrives after its warm-up and before its end"
            )
        for spec, curve in zip(self.models, self.curves, strict=True):
            if not set(curve.buckets) & set(spec.length_buckets):
                raise ValueError(
                    f"model {spec.name!r}: its curve was measured at buckets "
                    f"{list(curve.buckets)}, none of its length_buckets "
                    f"{list(spec.length_buckets)} (every batch would be timed at a default)"
                )
        offered = {s.model for s in self.traffic.streams} | {a.model for a in self.traffic.trace}
        unknown = sorted(offered - set(names))
        if unknown:
            raise ValueError(
                f"traffic of model {unknown[0]!r}, which the scenario does not "
                f"serve (it serves {names})"
            )

    @property
    def model(self) -> ModelSpec:
        """The first model (the only one of a single-model scenario)."""
        return self.models[0]

    @property
    def curve(self) -> LatencyCurve:
        """The first model's curve."""
        return self.curves[0]

    @property
    def slo_s_by_model(self) -> dict[str, float]:
        return {spec.name: spec.slo_s for spec in self.models}

    def served(self) -> tuple[tuple[ModelSpec, LatencyCurve], ...]:
        """Each model with its curve, in lane order."""
        return tuple(zip(self.models, self.curves, strict=True))


@dataclass
class RunResult:
    scenario: Scenario
    summary: dict[str, Any]
    recorder: Recorder
    fleet: Fleet
    totals: FleetTotals
    num_events: int


class _Autoscaling:
    """Samples the HPA's metric from the serving workers each sync period and acts on it."""

    def __init__(self, config: HpaConfig, fleet: Fleet, recorder: Recorder) -> None:
        self._hpa = HorizontalAutoscaler(config)
        self._fleet = fleet
        self._recorder = recorder
        self._last: dict[str, _Totals] = {}
        self._last_s = 0.0

    def sync(self, now_s: float, _: object) -> None:
        fleet = self._fleet
        metric = self.metric(now_s)
        current, ready = fleet.num_replicas, len(fleet.serving)
        desired = self._hpa.desired(now_s, current, ready, metric)
        for _ in range(desired - current):
            fleet.add_worker(now_s)
        for _ in range(current - desired):
            fleet.remove_worker(now_s)
        self._recorder.hpa_metric.append((now_s, metric))

    def metric(self, now_s: float) -> float:
        """Over the last sync period, per serving worker: mean queue wait or mean backlog of
        the rows it dispatched (seconds), CPU utilisation of its process, or its
        executor-busy fraction."""
        fleet, kind = self._fleet, self._hpa.config.metric
        elapsed_s = max(now_s - self._last_s, 1e-9)
        waits, backlogs, rows, shares = 0.0, 0.0, 0, []
        current: dict[str, _Totals] = {}
        for worker_id in fleet.serving:
            worker = fleet.workers[worker_id]
            now = current[worker_id] = _Totals(
                worker.queue_wait_s_total,
                worker.backlog_s_total,
                worker.rows_dispatched,
                worker.busy_s(now_s),
            )
            before = self._last.get(worker_id, _Totals(0.0, 0.0, 0, 0.0))
            waits += now.wait_s - before.wait_s
            backlogs += now.backlog_s - before.backlog_s
            rows += now.rows - before.rows
            if kind == "cpu":
                rows_here = now.rows - before.rows
                shares.append(_cpu_share(fleet.config, rows_here, elapsed_s, fleet.bundle_slices))
            else:
                shares.append((now.busy_s - before.busy_s) / elapsed_s)
        self._last, self._last_s = current, now_s
        if kind in ("queue_wait", "backlog"):
            return (waits if kind == "queue_wait" else backlogs) / rows if rows else 0.0
        return sum(shares) / len(shares) if shares else 0.0


def _cpu_share(config: FleetConfig, rows: int, elapsed_s: float, slices: float) -> float:
    """A worker's CPU utilisation over `elapsed_s` in which it dispatched `rows` (one row per
    simulated request): its processes' cost per request from [fleet.tier_cpu] when that gives
    the worker's (at `slices` callers a bundle, as the tier queues price them now), over all
    its processes' cores; else `cpu_per_row_s` over `cpu_cores`."""
    tiers = config.tier_cpu
    if tiers.worker_s(1.0) > 0:
        cores = config.worker_processes * tiers.cores_per_process
        return rows * tiers.worker_s(1.0, slices) / (elapsed_s * cores)
    return rows * config.cpu_per_row_s / (elapsed_s * config.cpu_cores)


class _Totals(NamedTuple):
    """One worker's cumulative counters at an HPA sync."""

    wait_s: float
    backlog_s: float
    rows: int
    busy_s: float


def run(scenario: Scenario) -> RunResult:
    """Runs `scenario` to its end (plus up to DRAIN_S for requests in flight)."""
    started = time.perf_counter()
    loop = EventLoop()
    recorder = Recorder(slo_s_by_model=scenario.slo_s_by_model, warmup_s=scenario.warmup_s)
    hpa = scenario.hpa
    initial = (
        scenario.fleet.workers if hpa is None else max(hpa.min_replicas, scenario.fleet.workers)
    )
    max_workers = initial if hpa is None else max(hpa.max_replicas, initial)
    fleet = Fleet(
        scenario.fleet,
        scenario.served(),
        scenario.driver,
        loop,
        recorder,
        seed=scenario.seed,
        max_workers=max_workers,
    )
    for _ in range(initial):
        fleet.add_worker(0.0, startup_s=0.0)
    schedule_arrivals(
        loop, fleet.arrive, scenario.traffic.arrivals(scenario.seed, scenario.duration_s)
    )
    for loss in scenario.losses:
        loop.at(loss.at_s, lambda now_s, n: fleet.kill_workers(now_s, n), loss.num_workers)
    if hpa is not None:
        loop.every(hpa.sync_period_s, _Autoscaling(hpa, fleet, recorder).sync, start_s=0.0)
    replicas = Counter[int]()

    def sample(now_s: float, _: object) -> None:
        count = fleet.num_replicas
        replicas[count] += 1
        recorder.replica_count(now_s, count, len(fleet.serving))

    loop.every(1.0, sample)
    loop.run(scenario.duration_s)
    loop.run(scenario.duration_s + DRAIN_S)
    totals = _totals(fleet, scenario.duration_s, replicas)
    summary = summarize(
        recorder,
        totals,
        duration_s=scenario.duration_s,
        wall_s=time.perf_counter() - started,
        num_events=loop.num_events,
    )
    summary["scenario"] = scenario.name
    return RunResult(scenario, summary, recorder, fleet, totals, loop.num_events)


def _totals(fleet: Fleet, duration_s: float, replicas: Counter[int]) -> FleetTotals:
    sizes: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    wait_s, backlog_s, compute_s, rows = 0.0, 0.0, 0.0, 0
    wait_counts = [0] * (len(WORKER_SECONDS_BUCKETS) + 1)
    for worker in fleet.all_workers:
        wait_counts = [a + b for a, b in zip(wait_counts, worker.queue_wait_counts, strict=True)]
        sizes.update(worker.batch_sizes)
        reasons.update(worker.close_reasons)
        wait_s += worker.queue_wait_s_total
        backlog_s += worker.backlog_s_total
        rows += worker.rows_dispatched
        compute_s += worker.busy_s_total
    return FleetTotals(
        worker_seconds=fleet.worker_seconds(duration_s),
        batch_sizes=sizes,
        close_reasons=reasons,
        max_replicas=max(replicas, default=0),
        final_replicas=fleet.num_replicas,
        mean_queue_wait_s=wait_s / rows if rows else 0.0,
        mean_backlog_s=backlog_s / rows if rows else 0.0,
        queue_wait_counts=tuple(wait_counts),
        compute_s=compute_s,
    )
