"""A fixed fleet split into independent shards, one process each, for large runs.

A fleet whose routers are split into cells (`cell_size`) is a set of independent fleets: each
request goes to one cell and stays there. `run_sharded` runs `num_shards` such parts in
parallel processes, each with 1/num_shards of the workers and of every stream's rate (own
seed), and merges what they measured: latency percentiles over all answers, counts summed.
Only fixed fleets shard: an HPA or a worker loss acts on the whole deployment.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from itertools import zip_longest
from typing import Any

from services.gateway.tenants import TenantPolicy
from services.sim.results import FleetTotals, Recorder, summarize
from services.sim.simulation import Scenario, run


def shard_of(scenario: Scenario, index: int, num_shards: int) -> Scenario:
    """The `index`-th of `num_shards` equal parts of a fixed fleet and its traffic."""
    if scenario.hpa is not None or scenario.losses:
        raise ValueError("only a fixed fleet shards: no [hpa], no [[worker_loss]]")
    if scenario.traffic.trace:
        raise ValueError("a recorded trace does not shard")
    if scenario.fleet.workers % num_shards:
        raise ValueError(f"{scenario.fleet.workers} workers do not split in {num_shards} shards")
    tenants = {name: _part_of(p, num_shards) for name, p in scenario.fleet.tenants.items()}
    fleet = dataclasses.replace(
        scenario.fleet, workers=scenario.fleet.workers // num_shards, tenants=tenants
    )
    if fleet.tier_cpu.is_set:
        # Each shard's gateways and routers queue its part of the traffic (tier_queues.py):
        # all of them in every shard would do num_shards times the work.
        gateways, routers = scenario.fleet.gateways, scenario.fleet.routers
        if gateways % num_shards or routers % num_shards:
            raise ValueError(
                f"with tier costs, {gateways} gateways and {routers} routers must each split"
                f" in {num_shards} shards"
            )
        fleet = dataclasses.replace(
            fleet, gateways=gateways // num_shards, routers=routers // num_shards
        )
    return dataclasses.replace(
        scenario,
        fleet=fleet,
        traffic=scenario.traffic.scaled(1.0 / num_shards),
        seed=scenario.seed * 1000 + index,
    )


def _part_of(policy: TenantPolicy, num_shards: int) -> TenantPolicy:
    """A shard's part of a tenant's fleet-wide limits, as a gateway enforces its share."""
    requests, rows, calls = policy.requests_per_s, policy.rows_per_s, policy.max_concurrency
    return dataclasses.replace(
        policy,
        requests_per_s=None if requests is None else requests / num_shards,
        rows_per_s=None if rows is None else rows / num_shards,
        max_concurrency=None if calls is None else max(1, math.ceil(calls / num_shards)),
    )


def _run_shard(scenario: Scenario) -> tuple[Recorder, FleetTotals, int]:
    result = run(scenario)
    return result.recorder, result.totals, result.num_events


def run_sharded(scenario: Scenario, num_shards: int) -> dict[str, Any]:
    """The merged summary of `num_shards` parallel shards of `scenario`."""
    started = time.perf_counter()
    shards = [shard_of(scenario, i, num_shards) for i in range(num_shards)]
    with ProcessPoolExecutor(max_workers=num_shards) as pool:
        parts = list(pool.map(_run_shard, shards))
    recorder = Recorder(slo_s_by_model=scenario.slo_s_by_model, warmup_s=scenario.warmup_s)
    sizes: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    worker_s, wait_s, backlog_s, rows = 0.0, 0.0, 0.0, 0
    wait_counts: list[int] = []
    for part, totals, _ in parts:
        wait_counts = [
            a + b for a, b in zip_longest(wait_counts, totals.queue_wait_counts, fillvalue=0)
        ]
        recorder.merge(part)
        sizes.update(totals.batch_sizes)
        reasons.update(totals.close_reasons)
        worker_s += totals.worker_seconds
        part_rows = sum(n * count for n, count in totals.batch_sizes.items())
        wait_s += totals.mean_queue_wait_s * part_rows
        backlog_s += totals.mean_backlog_s * part_rows
        rows += part_rows
    merged = FleetTotals(
        worker_seconds=worker_s,
        batch_sizes=sizes,
        close_reasons=reasons,
        max_replicas=sum(t.max_replicas for _, t, _ in parts),
        final_replicas=sum(t.final_replicas for _, t, _ in parts),
        mean_queue_wait_s=wait_s / rows if rows else 0.0,
        mean_backlog_s=backlog_s / rows if rows else 0.0,
        queue_wait_counts=tuple(wait_counts),
        compute_s=sum(t.compute_s for _, t, _ in parts),
    )
    summary = summarize(
        recorder,
        merged,
        duration_s=scenario.duration_s,
        wall_s=time.perf_counter() - started,
        num_events=sum(n for _, _, n in parts),
    )
    summary["scenario"] = scenario.name
    summary["shards"] = num_shards
    return summary
