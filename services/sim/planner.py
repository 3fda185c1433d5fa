"""The capacity planner: the fewest workers (and gateways) that meet an SLO, and the HPA target
that holds it.

The closed form it generalises is a utilisation bound with batch amortisation. A worker that
runs batches of b rows in t(b) seconds serves at most b / t(b) rows per second; a row may wait
for the batch running when it arrives and then run in the next, so the SLO allows batches up
to b* = the largest b with 2 t(b) <= SLO - upstream budget - safety margin (the batcher's own
`batch_compute_budget_s`). Offered lambda requests/s with headroom h then need

    c >= lambda (1 + h) t(b*) / b*        (utilisation rho = lambda t(b*) / (c b*) < 1, M/D/c-like)

Several models on one fleet share every worker's executor, so their utilisations add up, each
with its own curve, SLO and batch b*_m:

    c >= sum over models m of lambda_m (1 + h) t_m(b*_m) / b*_m

The simulator searches the worker count with the real policies instead. Where they differ:
Poisson arrivals rarely fill b* (the batcher closes batches early when the executor is idle,
so a lightly loaded worker runs small, expensive batches), admission refuses rows predicted
late before the queue is saturated, and the tail percentile needs slack the mean bound ignores.

The device is not the only thing a fleet runs out of: with the tiers' CPU per request known
(the scenario's [fleet.tier_cpu], tier_costs.py), the plan also counts worker processes per
device, gateway processes and pods, and routers, and names what binds each. Without it,
gateways are sized on `gateway_rps` requests/s each (FleetConfig.gateway_rps, or
--gateway-rps):

    g = ceil(peak lambda (1 + h) / gateway_rps)
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from services.gpu_worker.batching.batch_sizes import shape_limit
from services.sim.curve import LatencyCurve
from services.sim.results import Recorder, percentiles
from services.sim.simulation import Scenario, run
from services.sim.tier_costs import FleetPlan, fleet_plan
from services.sim.traffic import Arrival
from services.sim.worker import ModelSpec


@dataclass(frozen=True)
class ModelLoad:
    """One model's term of the closed form."""

    model: str
    slo_s: float
    #: b*: the largest batch whose compute fits half of the SLO the worker gets, in the
    #: model's most frequent bucket, and t(b*).
    batch_size: int
    batch_s: float
    #: Predicted compute per row in full batches of the model's length mix, seconds.
    per_row_s: float
    #: Mean offered requests/s of the model, with headroom.
    offered_per_s: float
    #: The batches of its offered buckets its curve never measured (LatencyCurve.beyond).
    unmeasured: tuple[str, ...] = ()

    @property
    def workers(self) -> float:
        """Workers' worth of executor time the model's traffic takes (its utilisation)."""
        return self.offered_per_s * self.per_row_s


@dataclass(frozen=True)
class ClosedForm:
    """The formula's inputs and answer."""

    #: The largest batch whose compute fits half of the SLO the worker gets (of the most
    #: offered model, with several).
    batch_size: int
    batch_s: float
    #: Rows per second one worker serves in full batches of the traffic's mix (all models).
    rows_per_s: float
    workers: int
    #: Each model's term, in the scenario's order.
    models: tuple[ModelLoad, ...] = ()


@dataclass(frozen=True)
class GatewayPlan:
    """The gateway count: CPU-bound processes sized on the peak offered rate."""

    #: The highest offered rate over the scenario (diurnal and bursts), before headroom, req/s.
    peak_offered_per_s: float
    #: Requests/s one gateway process serves.
    gateway_rps: float
    gateways: int


@dataclass(frozen=True)
class Trial:
    """One simulated worker count and whether it met the SLO."""

    workers: int
    latency_ms: float
    slo_attainment: float
    meets: bool


@dataclass(frozen=True)
class Plan:
    """The planner's answer."""

    workers: int | None
    closed_form: ClosedForm
    gateways: GatewayPlan
    trials: tuple[Trial, ...]
    #: Mean queue wait per row at the planned count under the scenario's own traffic (no
    #: headroom): the simulated HPA's queue-wait target ([hpa] metric = "queue_wait").
    hpa_queue_wait_target_ms: float | None
    #: Mean backlog per row (queue wait behind other batches, linger excluded), the same way:
    #: the simulated HPA's backlog target, the signal that falls as workers are added.
    hpa_backlog_target_ms: float | None
    #: Mean offered rate with headroom, req/s.
    offered_per_s: float
    #: p90 queue wait at the planned count, the same way, interpolated in the worker
    #: histogram's buckets as prometheus-adapter does: the deployed HPA's target
    #: (inference_worker_queue_wait_seconds_p90, deploy/k8s/overlays/prod/hpa.yaml).
    hpa_p90_queue_wait_target_ms: float | None = None
    #: Every tier's processes and what binds them, where the scenario gives the tiers' CPU.
    fleet: FleetPlan | None = None
    #: The devices the closed form plans with the tiers' CPU counted (worker processes past
    #: what a device takes add devices), where the scenario gives it.
    closed_form_devices: int | None = None


def closed_form(scenario: Scenario, *, headroom: float) -> ClosedForm:
    """The utilisation bound above, from each model's curve and mean offered rate. With several
    length buckets a row's cost is the traffic-weighted mean of t(b*) / b* per bucket; a
    model's `batch_size` and `batch_s` are those of its most frequent bucket."""
    loads = tuple(
        _model_load(scenario, spec, curve, headroom=headroom) for spec, curve in scenario.served()
    )
    busiest = max(loads, key=lambda load: load.offered_per_s)
    busy = sum(load.workers for load in loads)
    if len(loads) == 1:
        rows_per_s = 1.0 / busiest.per_row_s
    else:
        rows_per_s = sum(load.offered_per_s for load in loads) / busy if busy else math.inf
    workers = max(1, math.ceil(busy))
    return ClosedForm(busiest.batch_size, busiest.batch_s, rows_per_s, workers, loads)


def _model_load(
    scenario: Scenario, spec: ModelSpec, curve: LatencyCurve, *, headroom: float
) -> ModelLoad:
    driver = scenario.driver
    budget_s = (spec.slo_s - driver.upstream_budget_s - driver.safety_margin_s) / 2
    truth = curve.truth({b: spec.key(b) for b in spec.length_buckets})
    shares = _bucket_shares(scenario, spec) or {spec.length_buckets[0]: 1.0}
    per_row_s, batch_of, beyond = 0.0, dict[int, tuple[int, float]](), list[str]()
    for bucket, share in shares.items():
        key = spec.key(bucket)
        # As the batcher caps it (max_batch_tokens too: the plan counted 64-row batches of a
        # bucket the batcher ran 8 at a time, and too few workers; a review finding).
        limit = shape_limit(spec.max_batch_size, spec.max_batch_tokens, bucket)
        size = max([n for n in range(1, limit + 1) if truth.predict(key, n) <= budget_s], default=1)
        batch_of[bucket] = (size, truth.predict(key, size))
        if gap := curve.beyond(bucket, limit):
            beyond.append(gap)
        per_row_s += share * batch_of[bucket][1] / size
    size, batch_s = batch_of[max(shares, key=shares.__getitem__)]
    rate = _mean_rate(scenario, spec.name) * (1.0 + headroom)
    return ModelLoad(spec.name, spec.slo_s, size, batch_s, per_row_s, rate, tuple(beyond))


def tiers_plan(
    scenario: Scenario, devices: int, *, headroom: float, least_per_device: int = 1
) -> FleetPlan | None:
    """Every tier's processes for `devices` devices, at least `least_per_device` worker
    processes each (tier_costs.fleet_plan), or None where the scenario gives no tier CPU."""
    cpu = scenario.fleet.tier_cpu
    if not cpu.is_set:
        return None
    scale = 1.0 + headroom
    return fleet_plan(
        cpu,
        device_workers=devices,
        mean_per_s=_mean_rate(scenario) * scale,
        peak_per_s=_peak_rate(scenario) * scale,
        least_per_device=least_per_device,
    )


def gateway_plan(scenario: Scenario, *, headroom: float, gateway_rps: float) -> GatewayPlan:
    """The fewest gateways serving the scenario's peak offered rate with `headroom`."""
    if gateway_rps <= 0:
        raise ValueError("gateway_rps must be > 0")
    peak = _peak_rate(scenario)
    gateways = max(1, math.ceil(peak * (1.0 + headroom) / gateway_rps))
    return GatewayPlan(peak, gateway_rps, gateways)


def _peak_rate(scenario: Scenario) -> float:
    """The highest offered requests/s: a trace's busiest second, else the streams' total rate
    sampled every 0.1 s (the diurnal curve is smooth at that scale) and at each burst's start
    (a burst may be shorter)."""
    traffic, duration_s = scenario.traffic, scenario.duration_s
    if traffic.trace:
        per_second = Counter(int(a.at_s) for a in traffic.trace if a.at_s < duration_s)
        return float(max(per_second.values(), default=0))
    times = [i * 0.1 for i in range(math.ceil(duration_s / 0.1))]
    times += [b.start_s for b in traffic.bursts if 0.0 <= b.start_s < duration_s]
    return max((traffic.total_rate_per_s(t) for t in times), default=0.0)


def _bucket_shares(scenario: Scenario, spec: ModelSpec) -> dict[int, float]:
    """Share of the model's rows per length bucket, from the length mixes of its streams (or
    the trace); empty if none offers it."""
    shares = defaultdict[int, float](float)
    traffic = scenario.traffic
    if traffic.trace:
        for arrival in _in_window(scenario):
            if arrival.model == spec.name:
                shares[spec.bucket_for(arrival.num_tokens)] += 1.0
    for stream in traffic.streams:
        if stream.model != spec.name:
            continue
        total = sum(stream.lengths.weights)
        for tokens, weight in zip(stream.lengths.tokens, stream.lengths.weights, strict=True):
            shares[spec.bucket_for(tokens)] += stream.rate_per_s * weight / total
    grand = sum(shares.values())
    return {bucket: value / grand for bucket, value in shares.items() if value > 0}


def _in_window(scenario: Scenario) -> Iterator[Arrival]:
    """The trace's arrivals the scenario replays: those before its end."""
    return (a for a in scenario.traffic.trace if a.at_s < scenario.duration_s)


def _mean_rate(scenario: Scenario, model: str | None = None) -> float:
    """Offered requests/s averaged over the scenario's duration (diurnal and bursts included),
    of `model` only if given."""
    traffic = scenario.traffic
    if traffic.trace:
        count = sum(1 for a in _in_window(scenario) if model is None or a.model == model)
        return count / scenario.duration_s
    streams = [s for s in traffic.streams if model is None or s.model == model]
    return sum(traffic.mean_rate_per_s(s, scenario.duration_s) for s in streams)


def _trial(scenario: Scenario, workers: int, percentile: float) -> tuple[Trial, dict[str, Any]]:
    fleet = dataclasses.replace(scenario.fleet, workers=workers)
    result = run(dataclasses.replace(scenario, fleet=fleet, hpa=None, losses=()))
    summary = result.summary
    latencies = summary["latency_ms"]
    latency_ms = latencies.get(f"p{percentile:g}", latencies["p99"])
    attainment = summary["slo_attainment"]
    meets = bool(result.recorder.by_model) and all(
        _model_meets(result.recorder, spec, percentile) for spec in scenario.models
    )
    return Trial(workers, latency_ms, attainment, meets), summary


def _model_meets(recorder: Recorder, spec: ModelSpec, percentile: float) -> bool:
    """The model's `percentile` latency is within its SLO, and as large a share of its
    requests was answered within it: refused requests count against the percentile (an SLO at
    p99 allows 1% bad answers). A model nobody offered meets it."""
    counts = recorder.by_model.get(spec.name)
    if counts is None:
        return True
    arrived, good = counts
    (latency_s,) = percentiles(recorder.latencies_s_by_model.get(spec.name, ()), (percentile,))
    return latency_s * 1e3 <= spec.slo_s * 1e3 and good / arrived >= percentile / 100.0


def plan(
    scenario: Scenario,
    *,
    percentile: float = 99.0,
    headroom: float = 0.2,
    max_workers: int = 512,
    gateway_rps: float | None = None,
) -> Plan:
    """The fewest workers (no autoscaler, no losses) whose run of the scenario's traffic, scaled
    by 1 + `headroom`, answers `percentile`% of requests within the SLO. Searches by doubling
    from the closed form's half, then bisects. Gateways: see `gateway_plan` (`gateway_rps`
    defaults to the scenario's fleet.gateway_rps).

    The HPA targets are measured at the planned count under the scenario's own traffic, not
    the headroom's: an HPA holding a target taken at the edge of the SLO would shrink the fleet
    until every worker ran at that edge, spending the headroom the plan keeps for surges the
    HPA has not yet answered."""
    if percentile not in (50, 90, 99):
        raise ValueError("percentile must be 50, 90 or 99 (the percentiles a run reports)")
    if not (math.isfinite(headroom) and headroom >= 0):
        raise ValueError(f"headroom must be finite and >= 0, got {headroom}")
    if _mean_rate(scenario) <= 0:
        raise ValueError(
            f"the scenario offers no requests in its {scenario.duration_s:g} s: nothing to plan"
        )
    formula = closed_form(scenario, headroom=headroom)
    tiers = tiers_plan(scenario, formula.workers, headroom=headroom)
    if tiers is not None:  # every trial runs the tiers' processes the closed form plans
        scenario = dataclasses.replace(
            scenario,
            fleet=dataclasses.replace(
                scenario.fleet,
                gateways=tiers.gateways.processes,
                routers=tiers.routers.processes,
                worker_processes=tiers.worker_processes_per_device,
            ),
        )
    rps = scenario.fleet.gateway_rps if gateway_rps is None else gateway_rps
    gateways = gateway_plan(scenario, headroom=headroom, gateway_rps=rps)
    traffic = scenario.traffic.scaled(1.0 + headroom, seed=scenario.seed)
    loaded = dataclasses.replace(scenario, traffic=traffic)
    trials: dict[int, tuple[Trial, dict[str, Any]]] = {}

    def meets(workers: int) -> bool:
        if workers not in trials:
            trial, summary = _trial(loaded, workers, percentile)
            if not _cpu_keeps_up(loaded, workers):
                trial = dataclasses.replace(trial, meets=False)
            trials[workers] = (trial, summary)
        return trials[workers][0].meets

    low, high = 0, max(1, formula.workers // 2)
    while not meets(high):
        low = high
        if high >= max_workers:
            return Plan(
                None, formula, gateways, _ordered(trials), None, None, _mean_rate(loaded),
                fleet=tiers, closed_form_devices=None if tiers is None else tiers.devices,
            )  # fmt: skip
        high = min(max_workers, high * 2)
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    chosen = trials[high][1] if headroom == 0 else _trial(scenario, high, percentile)[1]
    # At least the processes a device the trials simulated: the mean's spread over the devices
    # the search added are fewer a device, a fleet no trial ran (review finding: it missed the
    # SLO where its trial had met it).
    per_device = scenario.fleet.worker_processes
    fleet = tiers_plan(scenario, high, headroom=headroom, least_per_device=per_device)
    return Plan(
        high,
        formula,
        gateways,
        _ordered(trials),
        chosen["mean_queue_wait_ms"],
        chosen["mean_backlog_ms"],
        _mean_rate(loaded),
        chosen["p90_queue_wait_ms"],
        fleet,
        None if tiers is None else tiers.devices,
    )


#: The most of a tier's CPU a trial may use and count as meeting the SLO: at full load a
#: queue of CPU work grows without bound, however short a run shows it small.
STABLE_LOAD = 0.95


def _cpu_keeps_up(scenario: Scenario, workers: int) -> bool:
    """Whether `workers` devices' worker processes have the CPU for the scenario's mean
    offered rate at STABLE_LOAD at most (True without tier costs). Gateways and routers are
    the closed form's, whatever the devices: their load is its utilization."""
    cpu = scenario.fleet.tier_cpu
    if not cpu.is_set or cpu.worker_s(1.0) <= 0:
        return True
    processes = workers * scenario.fleet.worker_processes
    rate_per_s = _mean_rate(scenario)
    slices = cpu.slices_per_bundle(rate_per_s / scenario.fleet.gateways)
    capacity_per_s = processes * cpu.cores_per_process / cpu.worker_s(1.0, slices)
    return rate_per_s <= STABLE_LOAD * capacity_per_s


def _ordered(trials: dict[int, tuple[Trial, dict[str, Any]]]) -> tuple[Trial, ...]:
    return tuple(trials[w][0] for w in sorted(trials))


__all__ = [
    "ClosedForm",
    "GatewayPlan",
    "ModelLoad",
    "Plan",
    "Trial",
    "closed_form",
    "gateway_plan",
    "plan",
]
