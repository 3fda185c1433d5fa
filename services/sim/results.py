"""What a simulated run measured: per-request outcomes, time series and the summary.

Only arrivals after the warm-up count in the summary (the latency models and the throttle have
settled by then); the time series keep everything, for the plots. Goodput counts answers
within the SLO (the latency objective the fleet is provisioned for; each model's own) per
second.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.metric_names import WORKER_SECONDS_BUCKETS


@dataclass
class _Bin:
    arrivals: int = 0
    good: int = 0
    latencies_s: list[float] = field(default_factory=list)


class Recorder:
    """Collects outcomes as the run produces them."""

    def __init__(
        self, *, slo_s_by_model: Mapping[str, float], warmup_s: float, bin_s: float = 1.0
    ) -> None:
        #: Each model's latency objective, seconds: an answer within it is good.
        self.slo_s_by_model = dict(slo_s_by_model)
        self.warmup_s = warmup_s
        self.bin_s = bin_s
        self._bins: dict[int, _Bin] = {}
        #: Latencies (seconds) of answers to requests that arrived after the warm-up.
        self.latencies_s: list[float] = []
        self.refusals: Counter[str] = Counter()
        self.num_arrivals = 0
        self.num_good = 0
        #: tenant -> [arrivals, answered within the SLO] after the warm-up.
        self.by_tenant: dict[str, list[int]] = {}
        #: tenant -> latencies (seconds) of its answers after the warm-up.
        self.latencies_s_by_tenant: dict[str, list[float]] = {}
        #: model -> [arrivals, answered within its SLO] after the warm-up, and its latencies.
        self.by_model: dict[str, list[int]] = {}
        self.latencies_s_by_model: dict[str, list[float]] = {}
        #: Seconds the answers after the warm-up spent in the hops (router to worker and back).
        self.hops_s = 0.0
        #: (time, replicas, ready replicas), on every change and every autoscaler sync.
        self.replicas: list[tuple[float, int, int]] = []
        #: (time, the autoscaler's metric value).
        self.hpa_metric: list[tuple[float, float]] = []

    def _bin(self, time_s: float) -> _Bin:
        index = int(time_s // self.bin_s)
        found = self._bins.get(index)
        if found is None:
            found = self._bins[index] = _Bin()
        return found

    def arrived(self, arrival_s: float, tenant: str, model: str) -> None:
        self._bin(arrival_s).arrivals += 1
        if arrival_s >= self.warmup_s:
            self.num_arrivals += 1
            self.by_tenant.setdefault(tenant, [0, 0])[0] += 1
            self.by_model.setdefault(model, [0, 0])[0] += 1

    def answered(
        self, arrival_s: float, latency_s: float, tenant: str, model: str, hops_s: float = 0.0
    ) -> None:
        """An answer `latency_s` after arrival, `hops_s` of it in the hops."""
        is_good = latency_s <= self.slo_s_by_model[model]
        slot = self._bin(arrival_s)
        slot.latencies_s.append(latency_s)
        slot.good += is_good
        if arrival_s >= self.warmup_s:
            self.latencies_s.append(latency_s)
            self.hops_s += hops_s
            self.num_good += is_good
            self.by_tenant.setdefault(tenant, [0, 0])[1] += is_good
            self.latencies_s_by_tenant.setdefault(tenant, []).append(latency_s)
            self.by_model.setdefault(model, [0, 0])[1] += is_good
            self.latencies_s_by_model.setdefault(model, []).append(latency_s)

    def merge(self, other: Recorder) -> None:
        """Adds the summary counts and latencies of `other` (a shard of the same run) to
        these; the time series are not merged."""
        self.latencies_s.extend(other.latencies_s)
        self.hops_s += other.hops_s
        self.refusals.update(other.refusals)
        self.num_arrivals += other.num_arrivals
        self.num_good += other.num_good
        for mine, theirs in ((self.by_tenant, other.by_tenant), (self.by_model, other.by_model)):
            for name, (arrived, good) in theirs.items():
                counts = mine.setdefault(name, [0, 0])
                counts[0] += arrived
                counts[1] += good
        for mine_s, theirs_s in (
            (self.latencies_s_by_tenant, other.latencies_s_by_tenant),
            (self.latencies_s_by_model, other.latencies_s_by_model),
        ):
            for name, latencies_s in theirs_s.items():
                mine_s.setdefault(name, []).extend(latencies_s)

    def refused(self, arrival_s: float, reason: str) -> None:
        if arrival_s >= self.warmup_s:
            self.refusals[reason] += 1

    def replica_count(self, time_s: float, replicas: int, ready: int) -> None:
        if not self.replicas or self.replicas[-1][1:] != (replicas, ready):
            self.replicas.append((time_s, replicas, ready))

    def series(self) -> dict[str, list[float]]:
        """Per bin: time, offered rate, goodput, p50 and p99 latency (answered requests)."""
        out: dict[str, list[float]] = {k: [] for k in ("t_s", "rate", "goodput", "p50", "p99")}
        for index in sorted(self._bins):
            slot = self._bins[index]
            p50, p99 = percentiles(slot.latencies_s, (50, 99))
            out["t_s"].append(index * self.bin_s)
            out["rate"].append(slot.arrivals / self.bin_s)
            out["goodput"].append(slot.good / self.bin_s)
            out["p50"].append(p50)
            out["p99"].append(p99)
        return out


def percentiles(values: Sequence[float], ranks: Iterable[float]) -> list[float]:
    if not values:
        return [math.nan for _ in ranks]
    return [float(v) for v in np.percentile(np.asarray(values), list(ranks))]


@dataclass(frozen=True)
class FleetTotals:
    """What the fleet did over the run, for the summary."""

    worker_seconds: float
    batch_sizes: Counter[int]
    close_reasons: Counter[str]
    max_replicas: int
    final_replicas: int
    #: Mean seconds a row waited in a worker's queue before its batch ran (the HPA signal).
    mean_queue_wait_s: float = 0.0
    #: The part of it spent behind other batches (linger excluded), seconds.
    mean_backlog_s: float = 0.0
    #: Rows by queue wait in WORKER_SECONDS_BUCKETS (+Inf last), summed over workers.
    queue_wait_counts: tuple[int, ...] = ()
    #: Seconds the workers' batches ran, summed (stretched by a shared host where there is one).
    compute_s: float = 0.0


def histogram_quantile(quantile: float, counts: Sequence[int]) -> float:
    """Prometheus' histogram_quantile over WORKER_SECONDS_BUCKETS: linear within the bucket
    the rank falls in, the highest finite bound for the +Inf bucket; NaN without samples."""
    total = sum(counts)
    if not total:
        return math.nan
    rank, seen = quantile * total, 0
    for index, count in enumerate(counts):
        if seen + count >= rank and count:
            if index == len(WORKER_SECONDS_BUCKETS):
                return WORKER_SECONDS_BUCKETS[-1]
            lower = WORKER_SECONDS_BUCKETS[index - 1] if index else 0.0
            upper = WORKER_SECONDS_BUCKETS[index]
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
    return WORKER_SECONDS_BUCKETS[-1]


def summarize(
    recorder: Recorder, totals: FleetTotals, *, duration_s: float, wall_s: float, num_events: int
) -> dict[str, Any]:
    """The JSON summary of one run."""
    window_s = max(duration_s - recorder.warmup_s, 1e-9)
    p50, p90, p99 = percentiles(recorder.latencies_s, (50, 90, 99))
    arrivals = recorder.num_arrivals
    num_batches = sum(totals.batch_sizes.values())
    rows = sum(size * count for size, count in totals.batch_sizes.items())
    return {
        "simulated_s": duration_s,
        "measured_s": window_s,
        "wall_s": round(wall_s, 3),
        "events": num_events,
        "offered_per_s": arrivals / window_s,
        "goodput_per_s": recorder.num_good / window_s,
        "slo_attainment": recorder.num_good / arrivals if arrivals else math.nan,
        "answered": len(recorder.latencies_s),
        "latency_ms": {"p50": p50 * 1e3, "p90": p90 * 1e3, "p99": p99 * 1e3},
        "refusals": dict(sorted(recorder.refusals.items())),
        "slo_attainment_by_tenant": {
            tenant: good / arrived if arrived else math.nan
            for tenant, (arrived, good) in sorted(recorder.by_tenant.items())
        },
        "goodput_per_s_by_tenant": {
            tenant: good / window_s for tenant, (_, good) in sorted(recorder.by_tenant.items())
        },
        "p99_ms_by_tenant": _p99_ms(recorder.by_tenant, recorder.latencies_s_by_tenant),
        "slo_attainment_by_model": {
            model: good / arrived if arrived else math.nan
            for model, (arrived, good) in sorted(recorder.by_model.items())
        },
        "goodput_per_s_by_model": {
            model: good / window_s for model, (_, good) in sorted(recorder.by_model.items())
        },
        "p99_ms_by_model": _p99_ms(recorder.by_model, recorder.latencies_s_by_model),
        "batches": num_batches,
        "mean_batch_size": rows / num_batches if num_batches else 0.0,
        "mean_compute_ms": totals.compute_s / num_batches * 1e3 if num_batches else 0.0,
        "batch_sizes": {str(k): v for k, v in sorted(totals.batch_sizes.items())},
        "close_reasons": dict(sorted(totals.close_reasons.items())),
        "mean_queue_wait_ms": totals.mean_queue_wait_s * 1e3,
        "mean_hops_ms": recorder.hops_s / len(recorder.latencies_s) * 1e3
        if recorder.latencies_s
        else math.nan,
        "mean_backlog_ms": totals.mean_backlog_s * 1e3,
        "p90_queue_wait_ms": histogram_quantile(0.9, totals.queue_wait_counts) * 1e3,
        "worker_hours": totals.worker_seconds / 3600.0,
        "max_replicas": totals.max_replicas,
        "final_replicas": totals.final_replicas,
    }


def _p99_ms(
    counts: Mapping[str, object], latencies_s: Mapping[str, list[float]]
) -> dict[str, float]:
    """p99 latency (ms) of each name in `counts`, sorted by name; NaN for one never answered."""
    return {name: percentiles(latencies_s.get(name, ()), (99,))[0] * 1e3 for name in sorted(counts)}
