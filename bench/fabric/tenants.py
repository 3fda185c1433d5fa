"""A flooding tenant: the victim's goodput and p99 with and without the flood, in one run.

    python -m bench.fabric.tenants [--smoke] [--pin] [--output bench/results/tenants.json]

One stack serves minilm (its own SLO, shedding past it) with API keys for three tenants. First
an unlimited `probe` tenant measures closed-loop capacity C. The keys file is then rewritten
(the gateway reloads it within a second) so that `victim` gets a quota of QUOTA_SHARE x C
requests/s and `flood` one of FLOOD_QUOTA_SHARE x C (quotas an operator sized to the fleet:
what the flood is admitted barely loads it). Then, at VICTIM_SHARE x C (open loop, Poisson):
1. the victim alone;
2. the victim while `flood` sends as fast as FLOOD_CONCURRENCY callers can, ignoring retry
   hints (an abusive client), refused by its quota at the gateway;
3. the same with the flood's quota lifted, so only the workers' admission and cost-weighted
   fair share stand between the two tenants.
The flood's offered rate is reported as a multiple of C. Prints a table; writes JSON.

`--pin` keeps the worker on one CPU (one torch thread) and the CPU tiers, this client and the
flood on another (`services.local_stack --cpus`): a deployment's separate nodes on one machine.
Without it every process shares every core, and the flood's client and refusals take CPU the
model needs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from bench.fabric.measure import Progress, Settings, Target, closed_loop, measure_rate
from bench.fabric.observe import Observer
from bench.fabric.stack import REPO_ROOT, start_stack, write_minilm_repository
from bench.fabric.targets import make_texts
from services.common.model_repository import load_repository
from services.gateway.auth import hash_key
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc

MODEL = "minilm"
KEYS = {"probe": "key-probe", "victim": "key-victim", "flood": "key-flood"}
QUOTA_SHARE = 0.4
FLOOD_QUOTA_SHARE = 0.05
VICTIM_SHARE = 0.3
FLOOD_CONCURRENCY = 64

FULL = Settings(
    warmup_s=2.0, window_s=5.0, windows=3, probe_s=6.0, probe_concurrency=16, max_probes=1,
    growth=1.25, rel_tol=0.05, raw_seconds=0.0, overhead_s=0.0, overhead_concurrency=1,
    overload_factors=(), length_buckets=None, seed=0,
)  # fmt: skip
SMOKE = dataclasses.replace(FULL, warmup_s=0.5, window_s=1.5, probe_s=2.0)


def keys_toml(quotas: dict[str, float | None]) -> str:
    lines = []
    for tenant, key in KEYS.items():
        lines += ["[[keys]]", f'tenant = "{tenant}"', f'sha256 = "{hash_key(key)}"', ""]
    for tenant, rate in quotas.items():
        if rate is not None:
            lines += [f"[tenants.{tenant}]", f"requests_per_s = {rate:.1f}", ""]
    return "\n".join(lines)


def sender(channel: grpc.aio.Channel, tenant: str, texts: list[str], timeout_s: float) -> Any:
    stub = api_grpc.InferenceServiceStub(channel)
    metadata = (("authorization", f"Bearer {KEYS[tenant]}"),)
    requests = [
        api.PredictRequest(model_name=MODEL, inputs=[api.PredictInput(text=t)]) for t in texts
    ]
    position = 0

    async def send() -> None:
        nonlocal position
        position = (position + 1) % len(requests)
        await stub.Predict(requests[position], metadata=metadata, timeout=timeout_s)

    return send


async def flood(send: Any, stop: asyncio.Event) -> Counter[str]:
    """FLOOD_CONCURRENCY callers sending back to back, retry hints ignored."""
    statuses: Counter[str] = Counter()

    async def caller() -> None:
        while not stop.is_set():
            try:
                await send()
                statuses["OK"] += 1
            except grpc.aio.AioRpcError as error:
                statuses[error.code().name] += 1
                await asyncio.sleep(0.001)  # the event loop must breathe; the flood barely does

    await asyncio.gather(*(caller() for _ in range(FLOOD_CONCURRENCY)))
    return statuses


class FloodProcess:
    """`flood` in a child process, until `stop`; its statuses come back through a queue."""

    def __init__(self, address: str, texts: list[str], timeout_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results: Any = context.Queue()
        self._process = context.Process(
            target=_flood_main, args=(address, texts, timeout_s, self._stop, self._results)
        )
        self._process.start()

    async def stop(self) -> Counter[str]:
        self._stop.set()
        statuses = await asyncio.to_thread(self._results.get, True, 60)
        await asyncio.to_thread(self._process.join, 10)
        return Counter(statuses)


def _flood_main(address: str, texts: list[str], timeout_s: float, stop: Any, out: Any) -> None:
    async def run() -> Counter[str]:
        stopped = asyncio.Event()
        async with grpc.aio.insecure_channel(address) as channel:
            task = asyncio.create_task(flood(sender(channel, "flood", texts, timeout_s), stopped))
            await asyncio.to_thread(stop.wait)
            stopped.set()
            return await task

    out.put(dict(asyncio.run(run())))


async def victim_phase(
    name: str, channel: grpc.aio.Channel, texts: list[str], rate: float, settings: Settings,
    slo_s: float, observer: Observer, log: Progress, *, with_flood: bool, address: str,
) -> dict[str, Any]:  # fmt: skip
    target = Target(name, sender(channel, "victim", texts, 4 * slo_s), observer, MODEL)
    flood_process = None
    started_s = time.monotonic()
    if with_flood:
        # Its own process: a flood sharing the measuring client's event loop would delay the
        # victim's calls in the client, not in the fabric.
        flood_process = FloodProcess(address, texts, 4 * slo_s)
    try:
        result = await measure_rate(target, rate, settings, slo_s, log)
    finally:
        flood_statuses = await flood_process.stop() if flood_process else Counter[str]()
    elapsed_s = time.monotonic() - started_s
    return {
        "victim": {
            "offered_per_s": rate,
            "good_fraction": result.good_fraction,
            "goodput_per_s": result.good_fraction * rate,
            "p99_s": result.figure("p99_s")["median"],
            "statuses": result.statuses(),
        },
        "flood": {
            "offered_per_s": sum(flood_statuses.values()) / elapsed_s,
            "statuses": dict(flood_statuses),
        },
    }


async def run(
    settings: Settings, state_dir: Path, log: Progress, *, pin: bool = False
) -> dict[str, Any]:
    repo = state_dir / "repo"
    write_minilm_repository(repo, shed_past_slo=True)
    version = next(v for v in load_repository(repo) if v.config.name == MODEL)
    slo_s = version.config.slo_s
    texts = make_texts(256, settings.seed, version.weights_dir / "tokenizer.json")
    keys = state_dir / "api-keys.toml"
    keys.write_text(keys_toml({}))
    cpus = sorted(os.sched_getaffinity(0))
    pinning = dict(
        extra_worker_args=("--torch-threads=1",),
        launcher_args=("--cpus", f"worker={cpus[-1]}",
                       "--cpus", f"gateway,router,redis,jobs={cpus[0]}"),
    )  # fmt: skip
    stack = await asyncio.to_thread(
        start_stack,
        repo,
        state_dir / "stack",
        extra_gateway_args=(f"--api-keys-file={keys}",),
        **(pinning if pin else {}),
    )
    if pin:
        os.sched_setaffinity(0, {cpus[0]})  # this client, and the flood's process after it
    report: dict[str, Any] = {
        "slo_s": slo_s, "settings": dataclasses.asdict(settings), "pinned": pin
    }  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
            observer = Observer(stack.pids(), stack.metrics_ports())
            probe_send = sender(channel, "probe", texts, 4 * slo_s)
            probe = await closed_loop(probe_send, settings.probe_concurrency, settings.probe_s)
            capacity = probe["ok_per_s"]
            log(f"[capacity] closed loop: {capacity:.0f}/s")
            quota, rate = QUOTA_SHARE * capacity, VICTIM_SHARE * capacity
            report.update(capacity_per_s=capacity, quota_per_s=quota)
            flood_quota = FLOOD_QUOTA_SHARE * capacity
            keys.write_text(keys_toml({"victim": quota, "flood": flood_quota}))
            await asyncio.sleep(2.0)  # the gateway re-reads the keys file every second
            phases = {}
            for name, with_flood in (("alone", False), ("flood_with_quota", True)):
                phases[name] = await victim_phase(
                    name, channel, texts, rate, settings, slo_s, observer, log,
                    with_flood=with_flood, address=stack.gateway_address,
                )  # fmt: skip
            keys.write_text(keys_toml({"victim": quota, "flood": None}))
            await asyncio.sleep(2.0)
            phases["flood_without_quota"] = await victim_phase(
                "flood_without_quota", channel, texts, rate, settings, slo_s, observer, log,
                with_flood=True, address=stack.gateway_address,
            )  # fmt: skip
            report["phases"] = phases
            report["victim_p99_ratio"] = p99_ratio(phases)
    finally:
        await asyncio.to_thread(stack.stop)
    return report


def p99_ratio(phases: dict[str, Any]) -> float | None:
    """The victim's p99 beside the flood (refused by its quota) over its p99 alone: the
    isolation figure (issue 12's goal: within 10%, a ratio of 1.10 or less)."""
    alone, beside = (phases[name]["victim"]["p99_s"] for name in ("alone", "flood_with_quota"))
    return beside / alone if alone and beside is not None else None


def table(report: dict[str, Any]) -> str:
    capacity = report["capacity_per_s"]
    rows = [f"capacity {capacity:.0f}/s; victim's quota {report['quota_per_s']:.0f}/s, the "
            f"flood's {FLOOD_QUOTA_SHARE * capacity:.0f}/s; SLO "
            f"{report['slo_s'] * 1000:.0f} ms", "phase                 victim goodput  p99    "
            "good    flood offered (x capacity)  flood statuses"]  # fmt: skip
    for name, phase in report["phases"].items():
        victim, flooding = phase["victim"], phase["flood"]
        p99 = "-" if victim["p99_s"] is None else f"{victim['p99_s'] * 1000:.0f}ms"
        rows.append(
            f"{name:22s}{victim['goodput_per_s']:8.1f}/s  {p99:>6s} {victim['good_fraction']:6.1%}"
            f"  {flooding['offered_per_s'] / capacity:10.1f}x  {flooding['statuses']}"
        )
    ratio = report.get("victim_p99_ratio")
    shown = "-" if ratio is None else f"{ratio:.2f}"
    rows.append(f"victim p99 beside the quota-refused flood / alone: {shown} (goal <= 1.10)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fabric.tenants", description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/tenants.json")
    parser.add_argument("--state-dir", type=Path)
    parser.add_argument(
        "--pin", action="store_true", help="worker on one CPU, CPU tiers and clients on another"
    )
    args = parser.parse_args(argv)
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="tenants-bench-"))
    report = asyncio.run(run(SMOKE if args.smoke else FULL, state_dir, Progress(), pin=args.pin))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + table(report) + f"\n\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
