"""What the server side says about a measured window: the tiers' own metrics and every
process's CPU seconds, as deltas between two snapshots.

The per-stage breakdown comes from the tiers' Prometheus histograms (sum and count deltas give
the mean per request or per row), so it is what production dashboards would show. CPU seconds
come from /proc: on two shared cores, who burnt the CPU is half of any explanation, and the
machine-wide figure shows when something outside the benchmark was competing.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from services.common import metric_names as names
from services.common.procfs import (
    ThreadStat,
    descendants,
    machine_busy_seconds,
    read_stat,
    read_threads,
)

#: The worker's per-row stage histograms, by the name the breakdown reports them under.
_WORKER_STAGES = {
    "linger": names.WORKER_LINGER_SECONDS,
    "backlog": names.WORKER_BACKLOG_SECONDS,
    "row_compute": names.WORKER_ROW_COMPUTE_SECONDS,
    "row_latency": names.WORKER_ROW_LATENCY_SECONDS,
}
#: A sample: (metric name, sorted label pairs) -> value.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        value
        for (sample_name, pairs), value in samples.items()
        if sample_name == name and all(dict(pairs).get(k) == v for k, v in labels.items())
    )


def by_label(samples: Samples, name: str, label: str, **labels: str) -> dict[str, float]:
    """Sums of `name` per value of `label` (e.g. rejections per reason), zeros left out."""
    found: dict[str, float] = {}
    for (sample_name, pairs), value in samples.items():
        pair_map = dict(pairs)
        if sample_name == name and all(pair_map.get(k) == v for k, v in labels.items()):
            key = pair_map.get(label, "")
            found[key] = found.get(key, 0.0) + value
    return {key: value for key, value in found.items() if value}


def delta(before: Samples, after: Samples) -> Samples:
    """Counter and histogram deltas (gauges come out as differences too; none is used)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


@dataclass
class Snapshot:
    at_s: float
    metrics: dict[str, Samples]
    cpu_s: dict[str, float]
    machine_busy_s: float
    #: The named processes' threads by group (`thread_group`), then thread id.
    threads: dict[str, dict[str, dict[int, ThreadStat]]] = field(default_factory=dict)


@dataclass
class Observer:
    """Takes snapshots of named processes and metrics ports. Processes started under this one
    that have no name (a peer's many processes) are summed under `children_label`."""

    pids: Mapping[str, int]
    metrics_ports: Mapping[str, int] = field(default_factory=dict)
    children_label: str = "other_children"

    def snapshot(self) -> Snapshot:
        own = os.getpid()
        named = {**self.pids, "bench": own}
        cpu = {name: _cpu_seconds(pid) for name, pid in named.items()}
        others = set(descendants(own)) - set(named.values())
        cpu_by_pid = {f"pid:{pid}:{self.children_label}": _cpu_seconds(pid) for pid in others}
        metrics = {name: scrape(port) for name, port in self.metrics_ports.items()}
        threads: dict[str, dict[str, dict[int, ThreadStat]]] = {}
        for name, pid in self.pids.items():
            for thread in read_threads(pid):
                group = threads.setdefault(name, {}).setdefault(thread_group(pid, thread), {})
                group[thread.tid] = thread
        return Snapshot(
            at_s=time.monotonic(),
            metrics=metrics,
            cpu_s={k: v for k, v in {**cpu, **cpu_by_pid}.items() if v is not None},
            machine_busy_s=machine_busy_seconds(),
            threads=threads,
        )


def thread_group(pid: int, thread: ThreadStat) -> str:
    """What a thread of process `pid` is counted under: `main` for its first thread (a tier's
    event loop), else its name: `python` for its other Python threads (grpc.aio's poller,
    which wakes the loop for each completed operation, executor threads, the metrics server),
    `event_engine` for grpc's own I/O threads, and so on."""
    return "main" if thread.tid == pid else thread.name


def threads_delta(before: Snapshot, after: Snapshot) -> dict[str, dict[str, dict[str, float]]]:
    """Per process and thread group, between two snapshots: threads, CPU seconds and context
    switches, voluntary (it waited: for I/O, a lock, a wake-up) and involuntary (preempted).
    A thread started in between (its id new, or reused) counts whole; one that ended in
    between is not counted."""
    result: dict[str, dict[str, dict[str, float]]] = {}
    for process, groups in after.threads.items():
        earlier = before.threads.get(process, {})
        for group, threads in groups.items():
            was = earlier.get(group, {})
            cpu_s, voluntary, involuntary = 0.0, 0, 0
            for tid, thread in threads.items():
                start = was.get(tid)
                if start is not None and start.start_ticks == thread.start_ticks:  # the same
                    cpu_s -= start.cpu_s
                    voluntary -= start.voluntary_switches
                    involuntary -= start.involuntary_switches
                cpu_s += thread.cpu_s
                voluntary += thread.voluntary_switches
                involuntary += thread.involuntary_switches
            result.setdefault(process, {})[group] = {
                "threads": len(threads), "cpu_s": round(cpu_s, 3),
                "voluntary_switches": voluntary, "involuntary_switches": involuntary,
            }  # fmt: skip
    return result


def _cpu_seconds(pid: int) -> float | None:
    stat = read_stat(pid)
    return None if stat is None else stat.cpu_s


def cpu_delta(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds per process between two snapshots; unnamed children summed, and what
    the rest of the machine used (`outside_bench`: other users' work competing for cores)."""
    named: dict[str, float] = {}
    for name, value in after.cpu_s.items():
        if name not in before.cpu_s:
            continue  # started in between: its CPU cannot be split, and is small
        # Unnamed children are keyed "pid:<pid>:<label>"; they are summed per label.
        label = name.rsplit(":", 1)[1] if name.startswith("pid:") else name
        named[label] = named.get(label, 0.0) + value - before.cpu_s[name]
    busy = after.machine_busy_s - before.machine_busy_s
    named["outside_bench"] = max(0.0, busy - sum(named.values()))
    return {name: round(value, 3) for name, value in named.items()}


def _mean(samples: Samples, name: str, **labels: str) -> float | None:
    """The mean of histogram `name`'s observations (None without any)."""
    count = total(samples, f"{name}_count", **labels)
    return total(samples, f"{name}_sum", **labels) / count if count else None


def _mean_ms(samples: Samples, name: str, **labels: str) -> float | None:
    mean = _mean(samples, name, **labels)
    return None if mean is None else 1000.0 * mean


def breakdown(before: Snapshot, after: Snapshot, model: str) -> dict[str, Any]:
    """Per-stage means (ms) and counts for `model` between two snapshots. Gateway and router
    times are per request, worker times per row; linger + backlog + compute = row latency."""
    d = {tier: delta(before.metrics[tier], after.metrics[tier]) for tier in after.metrics}
    result: dict[str, Any] = {}
    if "gateway" in d:
        gateway = d["gateway"]
        result["gateway"] = {
            "request_ms": _mean_ms(gateway, names.GATEWAY_REQUEST_SECONDS, model=model),
            "validate_ms": _mean_ms(gateway, names.GATEWAY_VALIDATE_SECONDS),
            "tokenize_ms": _mean_ms(gateway, names.GATEWAY_TOKENIZE_SECONDS, model=model),
            "by_code": by_label(gateway, names.GATEWAY_REQUESTS_TOTAL, "code", model=model),
            "callers_per_bundle": _mean(gateway, names.GATEWAY_BUNDLE_SLICES, model=model),
        }
    if "router" in d:
        router = d["router"]
        result["router"] = {
            "request_ms": _mean_ms(router, names.ROUTER_REQUEST_SECONDS, model=model),
            "predicted_wait_ms": _mean_ms(router, names.ROUTER_PREDICTED_WAIT_SECONDS, model=model),
            "rejected": by_label(router, names.ROUTER_REJECTED_TOTAL, "reason", model=model),
            "by_code": by_label(router, names.ROUTER_RESPONSES_TOTAL, "code", model=model),
        }
    for tier, worker in d.items():
        if not tier.startswith("worker"):
            continue
        rows = total(worker, names.WORKER_ROWS_TOTAL, model=model)
        batches = total(worker, names.WORKER_BATCHES_TOTAL, model=model)
        result[tier] = {
            **{
                f"{part}_ms": _mean_ms(worker, name, model=model)
                for part, name in _WORKER_STAGES.items()
            },
            "rows": rows,
            "batches": batches,
            "mean_batch_size": rows / batches if batches else None,
            "close_reasons": by_label(worker, names.WORKER_BATCHES_TOTAL, "reason", model=model),
            "rejected": by_label(worker, names.WORKER_REJECTED_TOTAL, "reason", model=model),
            "dropped": by_label(worker, names.WORKER_DROPPED_TOTAL, "reason", model=model),
        }
    return result
