"""Continuous vs static (run-to-completion) batching on a mixed-length workload.

    python -m bench.generation [--requests 192] [--rate 400] [--seed 0]

Same engine, same model (the default repository's tiny-llama), same open-loop arrival schedule
(Poisson, precomputed), greedy decoding. Reports tokens/s, time to first token (p50/p99), time
per output token, and checks both policies produced the same tokens for every request. Writes
bench/results/generation.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from bench.fabric.sweep import percentile
from services.common.model_repository import load_repository
from services.common.sampling import SamplingParams
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.metrics import GenerationMetrics


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt: str
    max_tokens: int


def workload(num_requests: int, rate_per_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals; prompts 8-120 characters; output lengths heavy-tailed (most replies
    short, one in five long), the mix where run-to-completion batching wastes the most."""
    rng = random.Random(seed)
    at_s, arrivals = 0.0, []
    for _ in range(num_requests):
        at_s += rng.expovariate(rate_per_s)
        prompt = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(8, 120)))
        max_tokens = rng.randint(160, 240) if rng.random() < 0.2 else rng.randint(8, 32)
        arrivals.append(Arrival(at_s, prompt, max_tokens))
    return arrivals


async def run(backend: GenerationBackend, arrivals: list[Arrival]) -> dict:
    engine = backend.engine
    engine.start()
    results: list[dict] = [{} for _ in arrivals]
    late = 0
    start = time.perf_counter()

    async def one(index: int, arrival: Arrival) -> None:
        nonlocal late
        delay = arrival.at_s - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -0.01:
            late += 1
        sent = time.perf_counter()
        tokens, stamps = [], []
        params = SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True)
        async for delta in engine.generate(backend.encode(arrival.prompt), params):
            tokens.extend(delta.token_ids)
            stamps.append(time.perf_counter())
        ttft = stamps[0] - sent
        tpot = (stamps[-1] - stamps[0]) / max(1, len(tokens) - 1)
        results[index] = {"tokens": tokens, "ttft_s": ttft, "tpot_s": tpot}

    await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
    elapsed = time.perf_counter() - start
    await engine.drain()
    num_tokens = sum(len(r["tokens"]) for r in results)
    ttfts = [r["ttft_s"] for r in results]
    return {
        "tokens_per_s": num_tokens / elapsed,
        "elapsed_s": elapsed,
        "num_tokens": num_tokens,
        "steps": engine.num_steps,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_mean_s": statistics.fmean(r["tpot_s"] for r in results),
        "late_sends": late,
        "tokens": [r["tokens"] for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument(
        "--rate", type=float, default=400.0, help="arrivals per second (default saturates)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("bench/results/generation.json"))
    args = parser.parse_args()

    version = next(v for v in load_repository(args.model_repository) if v.config.name == args.model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arrivals = workload(args.requests, args.rate, args.seed)
    report: dict = {"device": str(device), "requests": args.requests, "rate_per_s": args.rate}
    for name, is_static in (("static", True), ("continuous", False)):
        backend = GenerationBackend(
            version, device, GenerationMetrics(CollectorRegistry()), is_static=is_static
        )
        backend.warm_up()
        print(f"running {name} ...", flush=True)
        report[name] = asyncio.run(run(backend, arrivals))
    same = report["static"].pop("tokens") == report["continuous"].pop("tokens")
    report["identical_outputs"] = same
    continuous, static = report["continuous"], report["static"]
    report["tokens_per_s_ratio"] = continuous["tokens_per_s"] / static["tokens_per_s"]
    report["ttft_p99_ratio"] = continuous["ttft_p99_s"] / static["ttft_p99_s"]
    report["steps_ratio"] = static["steps"] / continuous["steps"]
    header = ("policy", "tok/s", "steps", "TTFT p50", "TTFT p99", "TPOT", "late")
    print("\n{:<11} {:>8} {:>6} {:>9} {:>9} {:>8} {:>5}".format(*header))
    for name in ("static", "continuous"):
        r = report[name]
        print(
            f"{name:<11} {r['tokens_per_s']:>8.0f} {r['steps']:>6} "
            f"{r['ttft_p50_s'] * 1000:>7.0f}ms {r['ttft_p99_s'] * 1000:>7.0f}ms "
            f"{r['tpot_mean_s'] * 1000:>6.1f}ms {r['late_sends']:>5}"
        )
    print(
        f"\ncontinuous / static: {report['tokens_per_s_ratio']:.2f}x tokens/s, "
        f"TTFT p99 {report['ttft_p99_ratio']:.2f}x, {report['steps_ratio']:.2f}x fewer steps; "
        f"identical greedy outputs: {same}"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
