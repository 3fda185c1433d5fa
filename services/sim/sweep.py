"""A sweep: one scenario run once per combination of `--set table.key=V1,V2,...` values, one
row each, the best marked (highest goodput, then lowest p99).

    python -m services.sim sweep scenarios/linger_fixed.toml \
        --set batching.max_wait_cap_s=0.002,0.005,0.01,0.02 --duration-s 20
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.sim.scenario import load_raw, parse_scenario
from services.sim.scenario_overrides import with_overrides
from services.sim.simulation import run

#: Goodputs within this fraction of the highest tie: the same seed offers every run the same
#: arrivals, so such differences are a few requests, and the lower p99 decides.
GOODPUT_TIE = 0.005


@dataclass(frozen=True)
class SweepRow:
    """One run of the sweep."""

    #: The dotted paths set for this run and their values.
    settings: tuple[tuple[str, Any], ...]
    goodput_per_s: float
    slo_attainment: float
    p50_ms: float
    p99_ms: float
    mean_batch_size: float


def sweep(
    path: Path,
    settings: Mapping[str, Sequence[Any]],
    *,
    duration_s: float | None = None,
) -> list[SweepRow]:
    """Runs the scenario at `path` once per combination of `settings` (dotted path -> values),
    in the order given; raises ValueError naming a setting the scenario cannot take."""
    raw = load_raw(path)
    if "generation" in raw:
        raise ValueError(f"{path}: sweep runs fixed-cost scenarios, not [generation] ones")
    if duration_s is not None:
        raw = with_overrides(raw, {"duration_s": duration_s})
    paths = list(settings)
    rows = []
    for values in itertools.product(*(settings[p] for p in paths)):
        chosen = tuple(zip(paths, values, strict=True))
        try:
            scenario = parse_scenario(
                with_overrides(raw, dict(chosen)), base_dir=path.parent, default_name=path.stem
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path} with {_label(chosen)}: {error}") from error
        summary = run(scenario).summary
        latency = summary["latency_ms"]
        rows.append(
            SweepRow(
                chosen,
                summary["goodput_per_s"],
                summary["slo_attainment"],
                latency["p50"],
                latency["p99"],
                summary["mean_batch_size"],
            )
        )
    return rows


def best(rows: Sequence[SweepRow]) -> SweepRow | None:
    """The highest goodput, ties (GOODPUT_TIE) to the lowest p99; a NaN p99 loses."""
    if not rows:
        return None
    top = max(row.goodput_per_s for row in rows)
    close = [row for row in rows if row.goodput_per_s >= top * (1.0 - GOODPUT_TIE)]
    return min(close, key=lambda row: math.inf if math.isnan(row.p99_ms) else row.p99_ms)


def format_sweep(rows: Sequence[SweepRow]) -> str:
    """One line per run, `*` on the best."""
    chosen = best(rows)
    labels = [_label(row.settings) for row in rows]
    width = max([len("setting"), *(len(label) for label in labels)])
    lines = [
        f"  {'setting':<{width}}  {'goodput/s':>10}  {'SLO att.':>8}  {'p50 ms':>8}  "
        f"{'p99 ms':>8}  {'batch':>6}"
    ]
    for row, label in zip(rows, labels, strict=True):
        mark = "*" if row is chosen else " "
        lines.append(
            f"{mark} {label:<{width}}  {row.goodput_per_s:>10.1f}  {row.slo_attainment:>8.4f}  "
            f"{row.p50_ms:>8.1f}  {row.p99_ms:>8.1f}  {row.mean_batch_size:>6.2f}"
        )
    if chosen is not None:
        lines.append(
            f"* best: {_label(chosen.settings)} (highest goodput, within "
            f"{GOODPUT_TIE:.1%} a tie, then lowest p99)"
        )
    return "\n".join(lines)


def _label(settings: Sequence[tuple[str, Any]]) -> str:
    return ", ".join(f"{path}={value}" for path, value in settings) or "(as written)"
