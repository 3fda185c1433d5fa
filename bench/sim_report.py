"""The simulator validation's report (bench/sim_validation.py): each side's figures for a load,
the table that sets them side by side with their ratios, and the verdict against the issue's
bound."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The issue's bound on |simulated / real - 1|.
TOLERANCE = 0.15


@dataclass(frozen=True)
class Side:
    goodput_per_s: float
    p50_ms: float
    p99_ms: float
    ok_share: float
    #: Share refused for load (RESOURCE_EXHAUSTED): past capacity, or a queue standing because
    #: the machine slowed (the worker's standing-queue rule, services/gpu_worker/batching/
    #: slo_shedding.py, on both sides).
    refused_share: float


def percentile(values: Sequence[float], rank: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(rank / 100 * len(ordered)) - 1))]


def median_side(sides: Sequence[Side]) -> Side:
    return Side(
        *(statistics.median(getattr(side, name) for side in sides) for name in Side.__annotations__)
    )


@dataclass(frozen=True)
class Run:
    """One seeded run of a load on both sides."""

    real: Side
    sim: Side
    #: Mean rows and compute milliseconds per batch the simulator ran.
    sim_batch_size: float
    sim_compute_ms: float
    #: What the real worker ran (`batches_of`): mean rows and compute milliseconds per batch.
    real_batches: dict[str, float]
    #: Mean milliseconds of the hops (client to worker and back) per answer, each side.
    real_hops_ms: float
    sim_hops_ms: float
    #: Each tier's CPU milliseconds per request sent over the real run (with an observer).
    real_cpu_ms: dict[str, float] | None = None


def table_row(load: float, rate: float, runs: Sequence[Run]) -> dict[str, Any]:
    """One load's runs: the medians of each side (the same seeds on both; a run the machine's
    other work disturbed moves no median of three), their ratios, and the real stack's own
    spread of p99 over the runs."""
    real = median_side([run.real for run in runs])
    sim = median_side([run.sim for run in runs])
    real_p99s = [run.real.p99_ms for run in runs]
    return {
        "load": load,
        "rate_per_s": rate,
        "runs": len(runs),
        "real": real.__dict__,
        "sim": sim.__dict__,
        "real_p99_ms_range": [min(real_p99s), max(real_p99s)],
        "sim_batches": statistics.fmean(run.sim_batch_size for run in runs),
        # What the worker ran over the whole real run (warm-up included): a batch size or
        # compute far from the simulator's says which part of the model is off.
        "real_batches": statistics.fmean(run.real_batches["mean_size"] for run in runs),
        "real_compute_ms": statistics.fmean(run.real_batches["mean_compute_ms"] for run in runs),
        "sim_compute_ms": statistics.fmean(run.sim_compute_ms for run in runs),
        # The hops under traffic: the simulated ones stretch only once the tiers outgrow the
        # cores (host.py), and the real ones say whether that holds.
        "real_hops_ms": statistics.fmean(run.real_hops_ms for run in runs),
        "sim_hops_ms": statistics.fmean(run.sim_hops_ms for run in runs),
        "goodput_ratio": ratio(sim.goodput_per_s, real.goodput_per_s),
        "p50_ratio": ratio(sim.p50_ms, real.p50_ms),
        "p99_ratio": ratio(sim.p99_ms, real.p99_ms),
        "per_run": [{"real": run.real.__dict__, "sim": run.sim.__dict__} for run in runs],
        "real_cpu_ms_per_request": _mean_cpu_ms([r.real_cpu_ms for r in runs]),
    }


def _mean_cpu_ms(runs: Sequence[dict[str, float] | None]) -> dict[str, float] | None:
    measured = [r for r in runs if r is not None]
    if not measured:
        return None
    return {tier: round(statistics.fmean(r[tier] for r in measured), 3) for tier in measured[0]}


def ratio(sim: float, real: float) -> float:
    return sim / real if real else math.nan


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'rate/s':>7} {'load':>5} | {'goodput real':>12} {'sim':>7} {'ratio':>6} | "
        f"{'p50 real':>8} {'sim':>7} {'ratio':>6} | {'p99 real':>8} {'sim':>7} {'ratio':>6} "
        f"{'real range':>13} | {'batch real':>10} {'sim':>5} | {'compute real':>12} {'sim':>5} | "
        f"{'hops real':>9} {'sim':>5}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        real, sim = row["real"], row["sim"]
        low, high = row["real_p99_ms_range"]
        lines.append(
            f"{row['rate_per_s']:7.0f} {row['load']:5.2f} | "
            f"{real['goodput_per_s']:12.1f} {sim['goodput_per_s']:7.1f} "
            f"{row['goodput_ratio']:6.3f} | "
            f"{real['p50_ms']:8.1f} {sim['p50_ms']:7.1f} {row['p50_ratio']:6.3f} | "
            f"{real['p99_ms']:8.1f} {sim['p99_ms']:7.1f} {row['p99_ratio']:6.3f} "
            f"{low:6.1f}-{high:<6.1f} | "
            f"{row['real_batches']:10.2f} {row['sim_batches']:5.2f} | "
            f"{row['real_compute_ms']:12.1f} {row['sim_compute_ms']:5.1f} | "
            f"{row['real_hops_ms']:9.1f} {row['sim_hops_ms']:5.1f}"
        )
    return "\n".join(lines)


def conclude(report: dict[str, Any], ratios: Sequence[str], out: Path | None) -> None:
    """Prints the table and whether every one of `ratios` is within TOLERANCE at every load;
    writes the report with that verdict to `out` when given."""
    print(format_rows(report["rows"]))
    within = all(abs(row[key] - 1.0) <= TOLERANCE for row in report["rows"] for key in ratios)
    print(f"{', '.join(ratios)} within {TOLERANCE:.0%} at every load: {'yes' if within else 'no'}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**report, "within_tolerance": within}, indent=2))
