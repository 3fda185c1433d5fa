"""`python -m bench.registry`: how fast the fabric notices and heals registry and heartbeat
faults (RELIABILITY.md scenarios 25-28 and 35). tests/e2e/test_registry_scenarios.py checks the
same faults as states (nothing lost, every tier serving, the registry refilled); the figures
live here, since two shared CPU cores make any bound on them a coin toss inside a test suite.

One two-worker local stack (`services.local_stack`, as `make run` starts it), one closed-loop
Predict caller, and each round, in turn:
- hang: Redis paused (SIGSTOP) for `--hang-s`. Predict latency p50 and max before and during,
  the p50 ratio (nothing on the request path touches Redis: about 1), the tiers' health-check
  latency during the pause (milliseconds: no event loop waits on Redis), and the seconds until
  the router's registry health says NOT_SERVING (one socket timeout plus one refresh).
- worker_stopped: a worker SIGSTOPped: seconds until the router drops it (against the
  staleness limit plus a refresh); SIGCONT: seconds until it is back (a heartbeat plus a
  refresh).
- new_replica: a third worker: seconds from its ready file to the router's first call to it
  (a heartbeat plus a refresh).
- restarted_empty: Redis restarted empty on its port: seconds until every worker is registered
  again (one heartbeat period).
- outage: Redis killed for `--outage-s`: seconds from its return until every worker is
  registered and the router is no longer degraded (the backoff caps plus a refresh).

Prints each figure's median and range over `--rounds` and writes bench/results/registry.json.
The stack's Redis and the traffic are in bench/registry_stack.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fabric.observe import scrape, total
from bench.fabric.stack import REPO_ROOT, BenchStack, start_stack, write_minilm_repository
from bench.registry_stack import Redis, Traffic
from services.common import metric_names as names
from services.common.processes import start_and_wait
from services.common.redis_acl import (
    WORKER,
    password_file_name,
)
from services.gpu_worker.config import HeartbeatConfig
from services.router.config import RouterConfig
from services.router.routing_config import RoutingConfig

#: Longest wait for any one reaction; past it the round fails with what did not happen.
REACTION_TIMEOUT_S = 60.0
DEFAULTS = {
    "heartbeat_period_s": HeartbeatConfig.period_s,
    "heartbeat_max_backoff_s": HeartbeatConfig.max_backoff_s,
    "stale_after_s": RoutingConfig.stale_after_s,
    "router_refresh_period_s": RouterConfig.refresh_period_s,
}


async def seconds_until(
    started_s: float, condition: Callable[[], object], what: str, poll_s: float = 0.02
) -> float:
    """Seconds from `started_s` (time.monotonic) until `condition` (sync; run off the event
    loop, so the load's latencies stay clean) holds."""
    deadline = time.monotonic() + REACTION_TIMEOUT_S
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {REACTION_TIMEOUT_S} s: {what}")
        await asyncio.sleep(poll_s)
    return time.monotonic() - started_s


def _ms(values: list[float], rank: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(rank * len(ordered)))] * 1e3, 2)


@dataclass
class Fabric:
    stack: BenchStack
    redis: Redis
    repository: Path
    state_dir: Path

    @property
    def router_port(self) -> int:
        return self.stack.metrics_ports()["router"]

    def router_metric(self, name: str, **labels: str) -> float:
        return total(scrape(self.router_port), name, **labels)

    def live_workers(self) -> float:
        return self.router_metric(names.ROUTER_LIVE_WORKERS)

    def addresses(self) -> list[str]:
        ready = self.stack.ready
        tiers = [ready["gateway"], ready["router"], *ready["workers"]]
        return [f"127.0.0.1:{tier['grpc_port']}" for tier in tiers]


async def hang(fabric: Fabric, hang_s: float) -> dict[str, float]:
    def registry_degraded() -> bool:
        return fabric.router_metric(names.ROUTER_REGISTRY_DEGRADED) == 1

    traffic = Traffic(fabric.stack.gateway_address, fabric.addresses()).start()
    # Warm-up: a fresh stack's first calls run far slower than the rest.
    await seconds_until(time.monotonic(), lambda: len(traffic.calls) >= 20, "20 warm-up calls")
    calm_at = time.monotonic()
    await asyncio.sleep(hang_s)  # the calm window the pause is compared with
    paused_at = time.monotonic()
    fabric.redis.signal(signal.SIGSTOP)
    try:
        noticed_s = await seconds_until(
            paused_at, registry_degraded, "the router found the registry unreachable"
        )
        await asyncio.sleep(max(0.0, paused_at + hang_s - time.monotonic()))  # the hang
    finally:
        resumed_at = time.monotonic()
        fabric.redis.signal(signal.SIGCONT)
    await seconds_until(
        resumed_at, lambda: not registry_degraded(), "the registry back after the pause"
    )
    await traffic.stop()
    before = [lat for sent, lat in traffic.calls if calm_at <= sent and sent + lat < paused_at]
    during = [lat for sent, lat in traffic.calls if paused_at <= sent < resumed_at]
    checks = [lat for sent, lat in traffic.checks if paused_at <= sent < resumed_at]
    return {
        "calls_before": len(before),
        "calls_during": len(during),
        "failed_during": sum(lat == float("inf") for lat in during),
        "p50_before_ms": _ms(before, 0.5),
        "p50_during_ms": _ms(during, 0.5),
        "max_before_ms": _ms(before, 1.0),
        "max_during_ms": _ms(during, 1.0),
        "p50_ratio": round(statistics.median(during) / statistics.median(before), 3),
        "health_p50_during_ms": _ms(checks, 0.5),
        "health_max_during_ms": _ms(checks, 1.0),
        "noticed_s": round(noticed_s, 3),
    }


async def worker_stopped(fabric: Fabric) -> dict[str, float]:
    pid = fabric.stack.ready["workers"][1]["pid"]
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        removed_s = await seconds_until(
            stopped_at, lambda: fabric.live_workers() == 1, "the stopped worker left routing"
        )
    finally:
        continued_at = time.monotonic()
        os.kill(pid, signal.SIGCONT)
    back_s = await seconds_until(
        continued_at, lambda: fabric.live_workers() == 2, "the continued worker came back"
    )
    return {"removed_s": round(removed_s, 3), "back_s": round(back_s, 3)}


async def new_replica(fabric: Fabric) -> dict[str, float]:
    acl_dir = fabric.redis.acl_dir
    ready_file = fabric.state_dir / f"worker-new-{time.monotonic_ns()}.ready.json"
    argv = [
        sys.executable, "-m", "services.gpu_worker", "--model-repository", str(fabric.repository),
        "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1",
        "--redis-url", f"redis://127.0.0.1:{fabric.redis.port}/0",
        "--redis-password-file", str(acl_dir / password_file_name(WORKER)),
        "--worker-id", "worker-new",
    ]  # fmt: skip
    child, _ = await asyncio.to_thread(
        start_and_wait, "worker-new", argv, log_path=ready_file.with_suffix(".log"),
        ready_file=ready_file, timeout_s=300.0, cwd=REPO_ROOT,
    )  # fmt: skip
    ready_at = time.monotonic()
    # Concurrent callers: the router spreads load to a new worker once the others are busy.
    traffic = [Traffic(fabric.stack.gateway_address, []).start() for _ in range(8)]
    try:
        routed_s = await seconds_until(
            ready_at,
            lambda: fabric.router_metric(names.ROUTER_ROUTED_TOTAL, worker="worker-new") > 0,
            "the new worker was routed a call",
        )
    finally:
        await asyncio.gather(*(t.stop() for t in traffic))
        child.terminate(30)
    await seconds_until(time.monotonic(), lambda: fabric.live_workers() == 2, "two workers")
    return {"first_routed_s": round(routed_s, 3)}


async def restarted_empty(fabric: Fabric) -> dict[str, float]:
    worker_ids = {w["worker_id"] for w in fabric.stack.ready["workers"]}
    fabric.redis.kill()
    fabric.redis.start(fabric.state_dir)
    restarted_at = time.monotonic()
    healed_s = await seconds_until(
        restarted_at,
        lambda: fabric.redis.registered_workers() == worker_ids,
        "every worker registered again",
    )
    await seconds_until(
        restarted_at,
        lambda: fabric.router_metric(names.ROUTER_REGISTRY_DEGRADED) == 0,
        "the router no longer degraded",
    )
    return {"healed_s": round(healed_s, 3)}


async def outage(fabric: Fabric, outage_s: float) -> dict[str, float]:
    worker_ids = {w["worker_id"] for w in fabric.stack.ready["workers"]}
    fabric.redis.kill()
    await asyncio.sleep(outage_s)  # the outage
    fabric.redis.start(fabric.state_dir)
    back_at = time.monotonic()
    registered_s = await seconds_until(
        back_at, lambda: fabric.redis.registered_workers() == worker_ids, "workers registered"
    )
    undegraded_s = await seconds_until(
        back_at,
        lambda: fabric.router_metric(names.ROUTER_REGISTRY_DEGRADED) == 0,
        "the router no longer degraded",
    )
    await seconds_until(back_at, lambda: fabric.live_workers() == 2, "two live workers")
    return {"registered_s": round(registered_s, 3), "undegraded_s": round(undegraded_s, 3)}


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Each figure's median and range over the rounds."""
    summary: dict[str, dict[str, Any]] = {}
    for scenario, figures in rounds[0].items():
        summary[scenario] = {}
        for name in figures:
            values = [r[scenario][name] for r in rounds]
            summary[scenario][name] = {
                "median": statistics.median(values),
                "range": [min(values), max(values)],
            }
    return summary


async def measure(args: argparse.Namespace, state_dir: Path) -> dict[str, Any]:
    repository = write_minilm_repository(
        state_dir / "repo", max_batch_size=8, length_buckets=(16, 32)
    ).parent.parent
    stack = start_stack(
        repository,
        state_dir / "stack",
        launcher_args=("--num-workers", "2", "--tolerate-exits"),
    )
    ready = stack.ready["redis"]
    fabric = Fabric(
        stack,
        Redis(port=ready["port"], acl_dir=Path(ready["acl_dir"]), pid=ready["pid"]),
        repository,
        state_dir,
    )
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for index in range(args.rounds):
            print(f"round {index + 1} of {args.rounds}", flush=True)
            figures = {
                "hang": await hang(fabric, args.hang_s),
                "worker_stopped": await worker_stopped(fabric),
                "new_replica": await new_replica(fabric),
                "restarted_empty": await restarted_empty(fabric),
                "outage": await outage(fabric, args.outage_s),
            }
            for scenario, values in figures.items():
                print(f"  {scenario}: {json.dumps(values)}", flush=True)
            rounds.append(figures)
    finally:
        stack.stop()
        fabric.redis.close()
    return {
        "defaults": DEFAULTS,
        "hang_s": args.hang_s,
        "outage_s": args.outage_s,
        "cpus": os.cpu_count(),
        "summary": summarize(rounds),
        "rounds": rounds,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.registry", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--hang-s",
        type=float,
        default=RoutingConfig.stale_after_s + 1,
        help="how long Redis stays paused (and the calm window before it)",
    )
    parser.add_argument("--outage-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/registry.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="registry-bench-") as tmp:
        report = asyncio.run(measure(args, Path(tmp)))
    print(json.dumps({"defaults": DEFAULTS, "summary": report["summary"]}, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
