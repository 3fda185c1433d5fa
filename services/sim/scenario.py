"""Scenario files (TOML or YAML) into a `Scenario`. The layout, every table optional but
[model] (or [[models]]) and the traffic:

    name = "steady"            duration_s = 120      warmup_s = 10      seed = 1
    latency_curve = "curves/cpu_minilm.json"   # or [curve]: fixed_ms, per_token_us, sizes
    curve_scale = 1.0                           # multiplies every point (0.25: a 4x faster GPU)
    [model]     name, version, slo_ms, max_batch_size, max_queue_size, max_batch_tokens,
                length_buckets, shed_past_slo, default_timeout_ms
    [[models]]  several models on every worker (a lane each, one executor; worker.py): each
                table the [model] keys and its own curve = {fixed_ms = 2, per_token_us = 5}
                or latency_curve = FILE, and curve_scale; no [model] or top-level curve then
    [batching]  upstream_budget_s, safety_margin_s, prediction_spreads, slo_prediction_spreads,
                max_wait_cap_s, min_expected_arrivals, tenant_weights = {a = 2.0}
    [fleet]     workers, startup_s, heartbeat_period_s, refresh_period_s, gateways, upstream_s,
                downstream_s, cell_size, max_retries, noise_sigma, cpu_per_row_s, cpu_cores,
                quota_sync_period_s, gateway_rps, routers, worker_processes
    [fleet.routing] / [fleet.throttle]   RoutingConfig / ThrottleConfig fields
    [fleet.host]  cores, tier_cpu_s, model_threads, window_s: the cores a worker shares with its
                  tiers on a CPU-only machine (host.py; absent: none shared)
    [fleet.tier_cpu]  gateway_s_per_request, router_s_per_request, worker_s_per_request,
                  worker_s_per_row, gateway_s_per_bundle, router_s_per_bundle,
                  worker_s_per_bundle, bundle_window_s, min_bundling_per_s,
                  max_slices_per_bundle, gateway_refusal_share, cores_per_process,
                  utilization, gateway_processes_per_pod, max_worker_processes_per_device,
                  provenance: every tier's CPU per caller and per bundle, for the planner
                  (tier_costs.py) and as queues on a request's path (tier_queues.py)
    [hpa]       metric ("queue_wait" | "backlog" | "cpu" | "gpu"), target, min_replicas,
                max_replicas, sync_period_s, tolerance, scale_down_window_s, ...
    [[traffic.streams]]  model, tenant, priority, rate_per_s, lengths = [[12, 0.85], [100, 0.15]],
                         timeout_ms; `model` may be left out with one model, and must name
                         a model of the scenario (else ValueError)
    [traffic.diurnal]    amplitude, period_s, peak_at_s
    [[traffic.bursts]]   start_s, duration_s, multiplier, tenant
    traffic.trace = "trace.csv"                 # recorded arrivals instead of streams
    [[worker_loss]]      at_s, num_workers
    [tenants.NAME]       the gateway's tenant table (services/gateway/tenants.py): weight,
                         requests_per_s, rows_per_s, burst_s, max_concurrency, models,
                         default_priority, priorities; a weight also feeds the batcher's
                         tenant_weights (setting both differently is an error)

A generation scenario has a [generation] table instead of [model] and the curve, and no
[batching], [hpa], [[worker_loss]] or [tenants] (generation_run.py says what it models):

    [generation]  the model's config.toml [generation] table (max_model_len, block_size,
                  num_kv_blocks, max_num_seqs, max_num_batched_tokens, watermark_blocks), and
                  name, version, mode ("continuous" | "static"), ttft_slo_ms, shed_past_slo,
                  default_timeout_ms, tenant_weights, drain_s,
                  output_lengths = [[64, 0.5], [256, 0.5]]   # streams without their own
    [generation.step_cost]  fixed_ms, per_prefill_token_us, per_decode_seq_us,
                            per_context_token_us
    [fleet]       workers, upstream_s, downstream_s, heartbeat_period_s, refresh_period_s,
                  [fleet.routing]
    [[traffic.streams]]  as above (lengths are prompt tokens), plus output_lengths

Relative paths are read from the scenario file's directory, then from the current one.
`load_scenario(path, overrides)` sets dotted `table.key` paths of the file's mapping first
(scenario_overrides.py: `parse_setting("batching.max_wait_cap_s=0.005")`), for the CLI's --set
and sweeps.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from services.gateway.tenants import TenantPolicy, parse_tenants
from services.gateway.throttle import ThrottleConfig
from services.gpu_worker.batching.driver_config import DriverConfig
from services.router.routing_config import RoutingConfig
from services.sim.autoscaler import HpaConfig
from services.sim.curve import LatencyCurve
from services.sim.fleet_config import FleetConfig
from services.sim.generation import GenerationSpec, StepCost
from services.sim.generation_run import GenerationScenario, StreamKey
from services.sim.host import HostConfig
from services.sim.scenario_overrides import with_overrides
from services.sim.simulation import Scenario, WorkerLoss
from services.sim.tier_costs import TierCpu
from services.sim.traffic import Burst, Diurnal, LengthMix, Stream, Traffic, load_trace
from services.sim.worker import ModelSpec

T = TypeVar("T")

_TOP_KEYS = {
    "name", "duration_s", "warmup_s", "seed", "latency_curve", "curve", "curve_scale",
    "model", "models", "batching", "fleet", "hpa", "traffic", "worker_loss", "description",
    "tenants",
}  # fmt: skip
#: Keys of a [[models]] table besides the ModelSpec fields: the model's own curve.
_CURVE_KEYS = {"latency_curve", "curve", "curve_scale"}


def load_scenario(
    path: Path, overrides: Mapping[str, Any] | None = None
) -> Scenario | GenerationScenario:
    """Reads a .toml, .yaml or .yml scenario, with `overrides` (dotted path -> value) set
    first; raises ValueError naming what is wrong."""
    raw = load_raw(path)
    try:
        if overrides:
            raw = with_overrides(raw, overrides)
        if "generation" in raw:
            return parse_generation_scenario(raw, base_dir=path.parent, default_name=path.stem)
        return parse_scenario(raw, base_dir=path.parent, default_name=path.stem)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error


def load_raw(path: Path) -> dict[str, Any]:
    """A scenario file's mapping as written, before any parsing."""
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        loaded = yaml.safe_load(text)
    else:
        loaded = tomllib.loads(text)
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: a scenario is a mapping of tables")
    return loaded


def parse_scenario(raw: Mapping[str, Any], *, base_dir: Path, default_name: str) -> Scenario:
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    models, curves = _models(raw, base_dir)
    tenants = parse_tenants(raw.get("tenants"), "[tenants]")
    return Scenario(
        name=str(raw.get("name", default_name)),
        models=models,
        curves=curves,
        traffic=_traffic(raw["traffic"], models[0].name if len(models) == 1 else None, base_dir),
        duration_s=float(raw.get("duration_s", 60.0)),
        warmup_s=float(raw.get("warmup_s", 5.0)),
        seed=int(raw.get("seed", 1)),
        driver=_driver(raw.get("batching", {}), raw.get("tenants") or {}, tenants),
        fleet=_fleet(raw.get("fleet", {}), tenants),
        hpa=_build(HpaConfig, raw["hpa"], "hpa") if "hpa" in raw else None,
        losses=tuple(_build(WorkerLoss, t, "worker_loss") for t in raw.get("worker_loss", ())),
    )


def _build(cls: type[T], table: Mapping[str, Any], where: str) -> T:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(table) - names
    if unknown:
        raise ValueError(f"[{where}]: unknown keys {sorted(unknown)}; known: {sorted(names)}")
    return cls(**table)


def _resolve(name: str, base_dir: Path) -> Path:
    candidate = base_dir / name
    return candidate if candidate.exists() else Path(name)


def _models(
    raw: Mapping[str, Any], base_dir: Path
) -> tuple[tuple[ModelSpec, ...], tuple[LatencyCurve, ...]]:
    """[model] with the top-level curve, or each [[models]] table with its own curve."""
    if "models" not in raw:
        if "model" not in raw:
            raise ValueError("a scenario needs a [model] table or [[models]] tables")
        return (_model(raw["model"]),), (_curve(raw, raw["model"], base_dir),)
    if "model" in raw or _CURVE_KEYS & set(raw):
        raise ValueError(
            "[[models]] tables hold each model and its curve: no [model], [curve], "
            "latency_curve or curve_scale beside them"
        )
    tables = raw["models"]
    if not isinstance(tables, list) or not tables:
        raise ValueError("models: expected [[models]] tables")
    specs, curves = [], []
    for table in tables:
        specs.append(_model({k: v for k, v in table.items() if k not in _CURVE_KEYS}))
        where = f"[[models]] {specs[-1].name!r}"
        try:
            curves.append(_curve(table, table, base_dir))
        except (KeyError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from error
    return tuple(specs), tuple(curves)


def _model(table: Mapping[str, Any]) -> ModelSpec:
    fields = dict(table)
    if "slo_ms" in fields:
        fields["slo_s"] = fields.pop("slo_ms") / 1000.0
    if "default_timeout_ms" in fields:
        fields["default_timeout_s"] = fields.pop("default_timeout_ms") / 1000.0
    if "length_buckets" in fields:
        fields["length_buckets"] = tuple(sorted(int(b) for b in fields["length_buckets"]))
    return _build(ModelSpec, fields, "model")


def _curve(raw: Mapping[str, Any], model: Mapping[str, Any], base_dir: Path) -> LatencyCurve:
    """The curve that `raw` (the scenario, or a [[models]] table) sets for `model` (its table)."""
    scale = float(raw.get("curve_scale", 1.0))
    if "latency_curve" in raw:
        return LatencyCurve.load(_resolve(str(raw["latency_curve"]), base_dir), scale=scale)
    table = raw.get("curve")
    if table is None:
        raise ValueError("a model needs latency_curve = FILE or a curve table")
    curve = LatencyCurve.linear(
        table.get("buckets", model.get("length_buckets", (16,))),
        table.get("sizes", (1, 2, 4, 8, 16, 32, 64)),
        fixed_s=float(table["fixed_ms"]) / 1000.0,
        per_token_s=float(table["per_token_us"]) / 1e6,
    )
    return dataclasses.replace(curve, scale=scale)


def _driver(
    table: Mapping[str, Any],
    tenant_tables: Mapping[str, Any],
    tenants: Mapping[str, TenantPolicy],
) -> DriverConfig:
    """[batching], with the weights of [tenants.NAME] tables in its tenant_weights: the
    gateway sends a tenant's weight with each request, and the worker's batcher uses it."""
    fields = dict(table)
    weights = dict(fields.get("tenant_weights", {}))
    for name, policy in tenants.items():
        if "weight" not in tenant_tables[name]:
            continue
        if weights.get(name, policy.weight) != policy.weight:
            raise ValueError(
                f"tenant {name!r}: weight {policy.weight:g} in [tenants.{name}] and "
                f"{weights[name]:g} in [batching] tenant_weights; set it in one place"
            )
        weights[name] = policy.weight
    if weights:
        fields["tenant_weights"] = weights
    return _build(DriverConfig, fields, "batching")


def _fleet(table: Mapping[str, Any], tenants: Mapping[str, TenantPolicy]) -> FleetConfig:
    fields = dict(table)
    if "tenants" in fields:
        raise ValueError("[fleet]: tenants go in [tenants.NAME] tables")
    fields["tenants"] = tenants
    if "routing" in fields:
        fields["routing"] = _build(RoutingConfig, fields["routing"], "fleet.routing")
    if "throttle" in fields:
        fields["throttle"] = _build(ThrottleConfig, fields["throttle"], "fleet.throttle")
    if "host" in fields:
        fields["host"] = _build(HostConfig, fields["host"], "fleet.host")
    if "tier_cpu" in fields:
        fields["tier_cpu"] = _build(TierCpu, fields["tier_cpu"], "fleet.tier_cpu")
        if "host" in fields:  # two models of the tiers' CPU: one at a time
            raise ValueError("[fleet]: tier_cpu (tiers on their own CPUs) or host, not both")
    return _build(FleetConfig, fields, "fleet")


def _traffic(table: Mapping[str, Any], default_model: str | None, base_dir: Path) -> Traffic:
    """[traffic]; a stream or trace row without a model offers `default_model` (None: the
    scenario serves several, each stream must name one)."""
    if "trace" in table:
        path = _resolve(str(table["trace"]), base_dir)
        trace = load_trace(path, default_model=default_model or "")
        return Traffic(trace=trace)
    streams = tuple(_stream(s, default_model) for s in table.get("streams", ()))
    if not streams:
        raise ValueError("[traffic] needs streams or a trace")
    return Traffic(
        streams=streams,
        diurnal=_build(Diurnal, table.get("diurnal", {}), "traffic.diurnal"),
        bursts=tuple(_build(Burst, b, "traffic.bursts") for b in table.get("bursts", ())),
    )


def _stream(table: Mapping[str, Any], default_model: str | None) -> Stream:
    fields = dict(table)
    if "model" not in fields:
        if default_model is None:
            raise ValueError("[[traffic.streams]]: with several models, each stream names one")
        fields["model"] = default_model
    if "lengths" in fields:
        pairs = [(int(t), float(w)) for t, w in fields["lengths"]]
        fields["lengths"] = LengthMix(tuple(t for t, _ in pairs), tuple(w for _, w in pairs))
    if "timeout_ms" in fields:
        fields["timeout_s"] = fields.pop("timeout_ms") / 1000.0
    return _build(Stream, fields, "traffic.streams")


# -- generation scenarios -------------------------------------------------------------------

_GENERATION_TOP_KEYS = {
    "name", "duration_s", "warmup_s", "seed", "generation", "fleet", "traffic", "description",
}  # fmt: skip
_GENERATION_FLEET_KEYS = {
    "workers", "upstream_s", "downstream_s", "heartbeat_period_s", "refresh_period_s", "routing",
}  # fmt: skip


def parse_generation_scenario(
    raw: Mapping[str, Any], *, base_dir: Path, default_name: str
) -> GenerationScenario:
    """A scenario with a [generation] table (see the module docstring)."""
    unknown = set(raw) - _GENERATION_TOP_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (not modelled for generation)")
    table = dict(raw["generation"])
    if "step_cost" not in table:
        raise ValueError("[generation] needs a [generation.step_cost] table")
    cost = _step_cost(table.pop("step_cost"))
    default_lengths = _length_mix(table.pop("output_lengths", [[64, 1.0]]))
    drain_s = float(table.pop("drain_s", 60.0))
    spec = _generation_spec(table)
    fleet = dict(raw.get("fleet", {}))
    unknown = set(fleet) - _GENERATION_FLEET_KEYS
    if unknown:
        raise ValueError(f"[fleet]: {sorted(unknown)} not modelled for generation")
    if "routing" in fleet:
        fleet["routing"] = _build(RoutingConfig, fleet["routing"], "fleet.routing")
    traffic, output_lengths = _generation_traffic(raw["traffic"], spec.name, base_dir)
    return GenerationScenario(
        name=str(raw.get("name", default_name)),
        spec=spec,
        cost=cost,
        traffic=traffic,
        output_lengths=output_lengths,
        default_output_lengths=default_lengths,
        duration_s=float(raw.get("duration_s", 60.0)),
        warmup_s=float(raw.get("warmup_s", 5.0)),
        seed=int(raw.get("seed", 1)),
        fleet=_build(FleetConfig, fleet, "fleet"),
        drain_s=drain_s,
    )


def _generation_spec(table: Mapping[str, Any]) -> GenerationSpec:
    fields = dict(table)
    if "ttft_slo_ms" in fields:
        fields["ttft_slo_s"] = fields.pop("ttft_slo_ms") / 1000.0
    if "default_timeout_ms" in fields:
        fields["default_timeout_s"] = fields.pop("default_timeout_ms") / 1000.0
    return _build(GenerationSpec, fields, "generation")


def _step_cost(table: Mapping[str, Any]) -> StepCost:
    units = {
        "fixed_ms": ("fixed_s", 1e-3),
        "per_prefill_token_us": ("per_prefill_token_s", 1e-6),
        "per_decode_seq_us": ("per_decode_seq_s", 1e-6),
        "per_context_token_us": ("per_context_token_s", 1e-6),
    }
    unknown = set(table) - set(units)
    if unknown:
        raise ValueError(f"[generation.step_cost]: unknown keys {sorted(unknown)}")
    return StepCost(**{units[k][0]: float(v) * units[k][1] for k, v in table.items()})


def _length_mix(pairs: Any) -> LengthMix:
    parsed = [(int(t), float(w)) for t, w in pairs]
    return LengthMix(tuple(t for t, _ in parsed), tuple(w for _, w in parsed))


def _generation_traffic(
    table: Mapping[str, Any], model: str, base_dir: Path
) -> tuple[Traffic, dict[StreamKey, LengthMix]]:
    """The traffic, and each stream's output lengths by its (model, tenant, priority)."""
    fields = dict(table)
    streams = [dict(s) for s in fields.get("streams", ())]
    mixes = [s.pop("output_lengths", None) for s in streams]
    if streams:
        fields["streams"] = streams
    traffic = _traffic(fields, model, base_dir)
    lengths: dict[StreamKey, LengthMix] = {}
    for stream, mix in zip(traffic.streams, mixes, strict=True):
        if stream.model != model:
            raise ValueError(f"stream of {stream.model!r}: the scenario serves {model!r}")
        key = (stream.model, stream.tenant, stream.priority)
        if mix is None:
            continue
        if key in lengths:
            raise ValueError(f"two streams {key} with output_lengths: one per stream key")
        lengths[key] = _length_mix(mix)
    return traffic, lengths
