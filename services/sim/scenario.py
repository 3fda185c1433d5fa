"""Scenario files (TOML or YAML) into a `Scenario`. The layout, every table optional but
[model] and the traffic:

    name = "steady"            duration_s = 120      warmup_s = 10      seed = 1
    latency_curve = "curves/cpu_minilm.json"   # or [curve]: fixed_ms, per_token_us, sizes
    curve_scale = 1.0                           # multiplies every point (0.25: a 4x faster GPU)
    [model]     name, version, slo_ms, max_batch_size, max_queue_size, max_batch_tokens,
                length_buckets, shed_past_slo, default_timeout_ms
    [batching]  upstream_budget_s, safety_margin_s, max_wait_cap_s, min_expected_arrivals,
                tenant_weights = {a = 2.0}
    [fleet]     workers, startup_s, heartbeat_period_s, refresh_period_s, gateways, upstream_s,
                downstream_s, cell_size, max_retries, noise_sigma, cpu_per_row_s, cpu_cores
    [fleet.routing] / [fleet.throttle]   RoutingConfig / ThrottleConfig fields
    [hpa]       metric ("queue_wait" | "backlog" | "cpu" | "gpu"), target, min_replicas,
                max_replicas, sync_period_s, tolerance, scale_down_window_s, ...
    [[traffic.streams]]  model, tenant, priority, rate_per_s, lengths = [[12, 0.85], [100, 0.15]],
                         timeout_ms
    [traffic.diurnal]    amplitude, period_s, peak_at_s
    [[traffic.bursts]]   start_s, duration_s, multiplier, tenant
    traffic.trace = "trace.csv"                 # recorded arrivals instead of streams
    [[worker_loss]]      at_s, num_workers

Relative paths are read from the scenario file's directory, then from the current one.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from services.gateway.throttle import ThrottleConfig
from services.gpu_worker.batching.driver_config import DriverConfig
from services.router.routing import RoutingConfig
from services.sim.autoscaler import HpaConfig
from services.sim.curve import LatencyCurve
from services.sim.fleet import FleetConfig
from services.sim.simulation import Scenario, WorkerLoss
from services.sim.traffic import Burst, Diurnal, LengthMix, Stream, Traffic, load_trace
from services.sim.worker import ModelSpec

T = TypeVar("T")

_TOP_KEYS = {
    "name", "duration_s", "warmup_s", "seed", "latency_curve", "curve", "curve_scale",
    "model", "batching", "fleet", "hpa", "traffic", "worker_loss", "description",
}  # fmt: skip


def load_scenario(path: Path) -> Scenario:
    """Reads a .toml, .yaml or .yml scenario; raises ValueError naming what is wrong."""
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        raw = yaml.safe_load(text)
    else:
        raw = tomllib.loads(text)
    try:
        return parse_scenario(raw, base_dir=path.parent, default_name=path.stem)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error


def parse_scenario(raw: Mapping[str, Any], *, base_dir: Path, default_name: str) -> Scenario:
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    model = _model(raw["model"])
    return Scenario(
        name=str(raw.get("name", default_name)),
        model=model,
        curve=_curve(raw, base_dir),
        traffic=_traffic(raw["traffic"], model.name, base_dir),
        duration_s=float(raw.get("duration_s", 60.0)),
        warmup_s=float(raw.get("warmup_s", 5.0)),
        seed=int(raw.get("seed", 1)),
        driver=_build(DriverConfig, raw.get("batching", {}), "batching"),
        fleet=_fleet(raw.get("fleet", {})),
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


def _model(table: Mapping[str, Any]) -> ModelSpec:
    fields = dict(table)
    if "slo_ms" in fields:
        fields["slo_s"] = fields.pop("slo_ms") / 1000.0
    if "default_timeout_ms" in fields:
        fields["default_timeout_s"] = fields.pop("default_timeout_ms") / 1000.0
    if "length_buckets" in fields:
        fields["length_buckets"] = tuple(sorted(int(b) for b in fields["length_buckets"]))
    return _build(ModelSpec, fields, "model")


def _curve(raw: Mapping[str, Any], base_dir: Path) -> LatencyCurve:
    scale = float(raw.get("curve_scale", 1.0))
    if "latency_curve" in raw:
        return LatencyCurve.load(_resolve(str(raw["latency_curve"]), base_dir), scale=scale)
    table = raw.get("curve")
    if table is None:
        raise ValueError("a scenario needs latency_curve = FILE or a [curve] table")
    curve = LatencyCurve.linear(
        table.get("buckets", raw["model"].get("length_buckets", (16,))),
        table.get("sizes", (1, 2, 4, 8, 16, 32, 64)),
        fixed_s=float(table["fixed_ms"]) / 1000.0,
        per_token_s=float(table["per_token_us"]) / 1e6,
    )
    return dataclasses.replace(curve, scale=scale)


def _fleet(table: Mapping[str, Any]) -> FleetConfig:
    fields = dict(table)
    if "routing" in fields:
        fields["routing"] = _build(RoutingConfig, fields["routing"], "fleet.routing")
    if "throttle" in fields:
        fields["throttle"] = _build(ThrottleConfig, fields["throttle"], "fleet.throttle")
    return _build(FleetConfig, fields, "fleet")


def _traffic(table: Mapping[str, Any], default_model: str, base_dir: Path) -> Traffic:
    if "trace" in table:
        trace = load_trace(_resolve(str(table["trace"]), base_dir), default_model=default_model)
        return Traffic(trace=trace)
    streams = tuple(_stream(s, default_model) for s in table.get("streams", ()))
    if not streams:
        raise ValueError("[traffic] needs streams or a trace")
    return Traffic(
        streams=streams,
        diurnal=_build(Diurnal, table.get("diurnal", {}), "traffic.diurnal"),
        bursts=tuple(_build(Burst, b, "traffic.bursts") for b in table.get("bursts", ())),
    )


def _stream(table: Mapping[str, Any], default_model: str) -> Stream:
    fields = dict(table)
    fields.setdefault("model", default_model)
    if "lengths" in fields:
        pairs = [(int(t), float(w)) for t, w in fields["lengths"]]
        fields["lengths"] = LengthMix(tuple(t for t, _ in pairs), tuple(w for _, w in pairs))
    if "timeout_ms" in fields:
        fields["timeout_s"] = fields.pop("timeout_ms") / 1000.0
    return _build(Stream, fields, "traffic.streams")
