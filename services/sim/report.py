"""A run's outputs on disk and on the terminal: summary JSON, CSV time series, a text table.

Plots (latency.png, replicas.png) are drawn with matplotlib when it is installed: it is an
optional extra (`pip install -e '.[bench]'`; `make install-test` has it), not a dependency of the
tiers, whose images stay small. The CSV series are written either way.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from services.sim.generation_run import GenerationRunResult
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
    return paths + plot(result, out_dir)


def plot(result: RunResult, out_dir: Path) -> list[Path]:
    """latency.png (offered rate, goodput, p50/p99 against the SLO, per second) and
    replicas.png (replicas and ready ones, and the HPA's metric) in `out_dir`; none without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    series = result.recorder.series()
    name = result.scenario.name
    figure, (rates, latency) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    rates.plot(series["t_s"], series["rate"], label="offered /s")
    rates.plot(series["t_s"], series["goodput"], label="goodput /s")
    rates.set_ylabel("requests/s")
    rates.legend(loc="upper left")
    latency.plot(series["t_s"], [v * 1e3 for v in series["p50"]], label="p50")
    latency.plot(series["t_s"], [v * 1e3 for v in series["p99"]], label="p99")
    for slo_s in sorted({spec.slo_s for spec in result.scenario.models}):
        latency.axhline(slo_s * 1e3, color="red", linestyle="--", label=f"SLO {slo_s * 1e3:g} ms")
    latency.set_ylabel("latency (ms)")
    latency.set_xlabel("simulated time (s)")
    latency.legend(loc="upper left")
    figure.suptitle(f"{name}: traffic and latency")
    paths = [_save(figure, out_dir / "latency.png")]
    figure, replicas = plt.subplots(figsize=(9, 4))
    times = [t for t, _, _ in result.recorder.replicas]
    replicas.step(
        times, [n for _, n, _ in result.recorder.replicas], where="post", label="replicas"
    )
    replicas.step(times, [r for _, _, r in result.recorder.replicas], where="post", label="ready")
    replicas.set_ylabel("workers")
    replicas.set_xlabel("simulated time (s)")
    replicas.legend(loc="upper left")
    if result.recorder.hpa_metric:
        metric = replicas.twinx()
        metric.plot(*zip(*result.recorder.hpa_metric, strict=True), color="grey", alpha=0.6)
        metric.set_ylabel("HPA metric")
    figure.suptitle(f"{name}: replicas")
    paths.append(_save(figure, out_dir / "replicas.png"))
    return paths


def _save(figure: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


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
        ("SLO attainment by tenant", _by_name(summary["slo_attainment_by_tenant"])),
        ("goodput by tenant (req/s)", _by_name(summary["goodput_per_s_by_tenant"], ".1f")),
        ("p99 by tenant (ms)", _by_name(summary["p99_ms_by_tenant"], ".1f")),
    ]
    if len(summary.get("slo_attainment_by_model", {})) > 1:
        rows += [
            ("SLO attainment by model", _by_name(summary["slo_attainment_by_model"])),
            ("goodput by model (req/s)", _by_name(summary["goodput_per_s_by_model"], ".1f")),
            ("p99 by model (ms)", _by_name(summary["p99_ms_by_model"], ".1f")),
        ]
    rows += [
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


def _by_name(values: dict[str, float], spec: str = ".4f") -> str:
    """`name=value, ...` of a per-tenant (or per-model) summary field."""
    return ", ".join(f"{name}={value:{spec}}" for name, value in values.items())


def write_generation_outputs(result: GenerationRunResult, out_dir: Path) -> list[Path]:
    """Writes summary.json and streams.csv (one row per stream that ran to its end after the
    warm-up: arrival, prompt and output tokens, TTFT, TPOT, e2e in ms, preemptions)."""
    summary_path = write_summary(result.summary, out_dir)
    header = ("arrival_s", "prompt_tokens", "output_tokens", "ttft_ms", "tpot_ms", "e2e_ms",
              "preemptions")  # fmt: skip
    rows = (
        (o.arrival_s, o.num_prompt_tokens, o.num_output_tokens, o.ttft_s * 1e3,
         "" if o.tpot_s is None else o.tpot_s * 1e3, o.e2e_s * 1e3, o.num_preemptions)
        for o in result.recorder.outcomes
    )  # fmt: skip
    return [summary_path, _write_csv(out_dir / "streams.csv", header, rows)]


def format_generation_table(summary: dict[str, Any]) -> str:
    """A generation run's headline figures, one per line."""
    refusals = summary["refusals"] or {"none": 0}
    rows = [
        ("scenario", f"{summary['scenario']} ({summary['mode']}, workers={summary['workers']})"),
        ("offered (req/s)", f"{summary['offered_per_s']:.1f}"),
        ("goodput (req/s, TTFT within SLO)", f"{summary['goodput_per_s']:.1f}"),
        ("TTFT SLO attainment", f"{summary['ttft_slo_attainment']:.4f}"),
        ("TTFT p50 / p99 (ms)", _p50_p99(summary["ttft_ms"])),
        ("TPOT p50 / p99 (ms)", _p50_p99(summary["tpot_ms"])),
        ("e2e p50 / p99 (ms)", _p50_p99(summary["e2e_ms"])),
        ("output tokens/s", f"{summary['output_tokens_per_s']:.0f}"),
        ("answered, unfinished", f"{summary['answered']}, {summary['unfinished']}"),
        ("refusals", ", ".join(f"{k}={v}" for k, v in refusals.items())),
        ("preemptions (streams preempted)",
         f"{summary['preemptions']} ({summary['streams_preempted']})"),
        ("steps, mean running seqs", f"{summary['steps']}, {summary['mean_running_seqs']:.1f}"),
        ("mean step (ms), batched tokens",
         f"{summary['mean_step_ms']:.2f}, {summary['mean_batched_tokens']:.1f}"),
        ("simulated / wall (s)", f"{summary['simulated_s']:g} / {summary['wall_s']:.2f}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _p50_p99(latency: dict[str, float]) -> str:
    return " / ".join(f"{latency[p]:.1f}" for p in ("p50", "p99"))
