"""A run's outputs on disk and on the terminal: summary JSON, CSV time series, a text table.

Plots are not drawn: matplotlib is not a dependency of the project (the worker image must stay
small), so the time series are written as CSV for any plotting tool to read.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from services.sim.simulation import RunResult


def write_outputs(result: RunResult, out_dir: Path) -> list[Path]:
    """Writes summary.json, latency.csv (per second: offered rate, goodput, p50, p99),
    replicas.csv and, with an HPA, hpa_metric.csv into `out_dir`; returns the paths."""
    recorder = result.recorder
    summary_path = write_summary(result.summary, out_dir)
    series = recorder.series()
    columns = ("t_s", "rate", "goodput", "p50", "p99")
    latency_rows = zip(*(series[c] for c in columns), strict=True)
    paths = [summary_path]
    paths.append(_write_csv(out_dir / "latency.csv", columns, latency_rows))
    replicas = [(t, n, ready) for t, n, ready in recorder.replicas]
    paths.append(_write_csv(out_dir / "replicas.csv", ("t_s", "replicas", "ready"), replicas))
    if recorder.hpa_metric:
        paths.append(_write_csv(out_dir / "hpa_metric.csv", ("t_s", "metric"), recorder.hpa_metric))
    return paths


def write_summary(summary: dict[str, Any], out_dir: Path) -> Path:
    """Writes `summary` as out_dir/summary.json; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    path.write_text(json.dumps(_finite(summary), indent=2, sort_keys=True) + "\n")
    return path


def _write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _finite(value: Any) -> Any:
    """NaN (no answers in a window) becomes null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def format_table(summary: dict[str, Any]) -> str:
    """The run's headline figures, one per line."""
    latency = summary["latency_ms"]
    refusals = summary["refusals"] or {"none": 0}
    rows = [
        ("scenario", str(summary["scenario"])),
        ("offered (req/s)", f"{summary['offered_per_s']:.1f}"),
        ("goodput (req/s, within SLO)", f"{summary['goodput_per_s']:.1f}"),
        ("SLO attainment", f"{summary['slo_attainment']:.4f}"),
        ("latency p50 / p90 / p99 (ms)", _latencies(latency)),
        ("refusals", ", ".join(f"{k}={v}" for k, v in refusals.items())),
        ("SLO attainment by tenant", _by_tenant(summary["slo_attainment_by_tenant"])),
        ("batches, mean size", f"{summary['batches']}, {summary['mean_batch_size']:.2f}"),
        ("close reasons", ", ".join(f"{k}={v}" for k, v in summary["close_reasons"].items())),
        ("replicas max / final", f"{summary['max_replicas']} / {summary['final_replicas']}"),
        ("worker-hours", f"{summary['worker_hours']:.4f}"),
        ("simulated / wall (s)", f"{summary['simulated_s']:g} / {summary['wall_s']:.2f}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _latencies(latency: dict[str, float]) -> str:
    return " / ".join(f"{latency[p]:.1f}" for p in ("p50", "p90", "p99"))


def _by_tenant(attainment: dict[str, float]) -> str:
    return ", ".join(f"{tenant}={value:.4f}" for tenant, value in attainment.items())
