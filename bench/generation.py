"""Continuous vs static (run-to-completion) batching on a mixed-length workload, and prefix
caching on vs off on a shared-prefix workload.

`--model` names a model of the repository or any Llama checkpoint directory (served with the
repository's tiny-llama settings: `python -m services.gpu_worker.generation.tiny_llama DIR
--size 100m` writes a ~100M-parameter one). `--quick` runs the continuous engine alone.
`--attention torch-default` (torch's own kernel set, cuDNN attention included) and
`--no-cuda-graphs` reproduce the engine as it was before either, and `--decode-only-graphs`
as it was before steps with prompts replayed graphs, for side-by-side runs.
`--max-num-seqs N` lets N sequences run at once instead of the model's configured count (its
KV blocks grown to hold as many per sequence). `--stand-in-step-ms X` serves every step from
`bench.generation_stand_in` (a GPU's host path, then X ms asleep for the device; outputs are
token 0 throughout): what the engine's Python allows on a GPU box, measured on a CPU.
`--stream-between-steps` streams each step's tokens after it, as the engine did before it
streamed them while the next step runs on the device (a GPU's, or the stand-in's).
Requests are `batch` class, queued up to their deadline: what the engine serves at
saturation. `--priority interactive` sends online requests, which the engine refuses while its
waiting queue stands (generation.standing_shedding): the refused are counted, and the figures
are those of the requests served (past capacity, e.g. `--quick --rate 260 --requests 2600`).
`--tenant-per-request` sends each request as a tenant of its own (fair share then ranks every
new one at the floor, as many one-stream callers), instead of all as one.

    python -m bench.generation [--requests 192] [--rate 400] [--seed 0] [--model NAME_OR_DIR]
        [--quick] [--attention measured|torch-default] [--no-cuda-graphs | --decode-only-graphs]
        [--max-num-seqs N] [--stand-in-step-ms X] [--stream-between-steps]
        [--priority batch|interactive] [--tenant-per-request]

Same engine, same model (the default repository's tiny-llama), same open-loop arrival schedule
(Poisson, precomputed), greedy decoding. Reports tokens/s, goodput (tokens/s of the requests
whose first token came within the model's `slo_p99_ms`), time to first token (p50/p99), time
per output token, and checks both policies produced the same tokens for every request. Then
the shared-prefix workload (every prompt one of a few long system prompts plus a short
question, short replies: chat and RAG traffic) through the continuous engine with the prefix
cache off and on: the same figures, the cache's hit rate, and identical outputs again. Writes
bench/results/generation.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from bench import generation_stand_in as stand_in
from bench.fabric.sweep import percentile
from services.common import metric_names as names
from services.common.errors import Overloaded
from services.common.model_repository import ModelVersion, load_repository
from services.common.priority import PriorityClass
from services.common.sampling import SamplingParams
from services.gpu_worker.generation.attention_backends import TORCH_DEFAULT
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


def shared_prefix_workload(num_requests: int, rate_per_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals; each prompt one of 4 system prompts (240-360 characters) followed by
    a 10-40 character question; replies of 8-32 tokens."""
    rng = random.Random(seed)
    letters = "abcdefghij klmnop"
    systems = ["".join(rng.choice(letters) for _ in range(rng.randint(240, 360))) for _ in range(4)]
    at_s, arrivals = 0.0, []
    for _ in range(num_requests):
        at_s += rng.expovariate(rate_per_s)
        question = "".join(rng.choice(letters) for _ in range(rng.randint(10, 40)))
        arrivals.append(Arrival(at_s, rng.choice(systems) + question, rng.randint(8, 32)))
    return arrivals


def resolve_model(repository: Path, model: str) -> ModelVersion:
    """The repository's model `model`, or the checkpoint directory `model` served with the
    repository's tiny-llama settings."""
    versions = load_repository(repository)
    named = [v for v in versions if v.config.name == model]
    if named:
        return named[0]
    weights = Path(model)
    if not (weights / "config.json").is_file():
        raise SystemExit(f"{model}: neither a model of {repository} nor a checkpoint directory")
    (tiny,) = (v for v in versions if v.config.name == "tiny-llama")
    return dataclasses.replace(
        tiny, config=dataclasses.replace(tiny.config, name=weights.name), weights_dir=weights
    )


def with_prefix_caching(version: ModelVersion, scope: str) -> ModelVersion:
    generation = version.config.generation
    assert generation is not None
    config = dataclasses.replace(
        version.config, generation=dataclasses.replace(generation, prefix_caching=scope)
    )
    return dataclasses.replace(version, config=config)


def with_max_num_seqs(version: ModelVersion, max_num_seqs: int) -> ModelVersion:
    """`version` running up to `max_num_seqs` sequences at once, its KV blocks scaled with them
    (never fewer than configured)."""
    generation = version.config.generation
    assert generation is not None
    blocks = max(
        generation.num_kv_blocks,
        generation.num_kv_blocks * max_num_seqs // generation.max_num_seqs,
    )
    settings = dataclasses.replace(generation, max_num_seqs=max_num_seqs, num_kv_blocks=blocks)
    config = dataclasses.replace(version.config, generation=settings, max_batch_size=max_num_seqs)
    return dataclasses.replace(version, config=config)


async def run(
    backend: GenerationBackend,
    arrivals: list[Arrival],
    priority: PriorityClass = PriorityClass.BATCH,
    tenant_per_request: bool = False,
) -> dict:
    engine = backend.engine
    engine.start()
    results: list[dict] = [{} for _ in arrivals]
    late = 0
    start = time.perf_counter()

    async def one(index: int, arrival: Arrival) -> None:
        nonlocal late
        due = start + arrival.at_s
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        # Judged after the sleep, and TTFT counted from when it was due: the engine's steps
        # share this loop, and a wake-up they held back was neither counted late nor waited
        # in the TTFT (bench review).
        if time.perf_counter() - due > 0.01:
            late += 1
        sent = due
        tokens: list[int] = []
        stamps: list[float] = []
        params = SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True)
        tenant = f"t{index}" if tenant_per_request else ""
        prompt_ids = backend.encode(arrival.prompt)
        stream = engine.generate(prompt_ids, params, priority=priority.rank, tenant=tenant)
        try:
            async for delta in stream:
                tokens.extend(delta.token_ids)
                stamps.append(time.perf_counter())
        except Overloaded:
            results[index] = {"tokens": None}  # refused, or dropped unrun: no tokens
            return
        ttft = stamps[0] - sent
        tpot = (stamps[-1] - stamps[0]) / max(1, len(tokens) - 1)
        results[index] = {"tokens": tokens, "ttft_s": ttft, "tpot_s": tpot}

    await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
    elapsed = time.perf_counter() - start
    await engine.drain()
    served = [r for r in results if r["tokens"] is not None]
    if not served:
        raise SystemExit("every request was refused: nothing to measure")
    num_tokens = sum(len(r["tokens"]) for r in served)
    ttfts = [r["ttft_s"] for r in served]
    # Goodput: the tokens of the requests whose first token came within the model's TTFT
    # objective (its slo_p99_ms), per second of the run.
    slo_s = backend.config.slo_s
    good = [r for r in served if r["ttft_s"] <= slo_s]
    return {
        "tokens_per_s": num_tokens / elapsed,
        "goodput_tokens_per_s": sum(len(r["tokens"]) for r in good) / elapsed,
        "ttft_slo_s": slo_s,
        "ttft_slo_attainment": len(good) / len(results),
        "refused": len(results) - len(served),
        "elapsed_s": elapsed,
        "num_tokens": num_tokens,
        "steps": engine.num_steps,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_mean_s": statistics.fmean(r["tpot_s"] for r in served),
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
    parser.add_argument("--quick", action="store_true", help="the continuous engine alone")
    parser.add_argument("--attention", choices=("measured", "torch-default"), default="measured")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--decode-only-graphs", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="0: the model's")
    parser.add_argument(
        "--stand-in-step-ms",
        type=float,
        default=0.0,
        help=f"0: the model; else e.g. {1000 * stand_in.H200_STEP_S}",
    )
    parser.add_argument("--stream-between-steps", action="store_true")
    parser.add_argument("--priority", choices=("batch", "interactive"), default="batch")
    parser.add_argument("--tenant-per-request", action="store_true")
    args = parser.parse_args()
    if args.stand_in_step_ms and (args.no_cuda_graphs or args.decode_only_graphs):
        parser.error(
            "--stand-in-step-ms serves every step: no --no-cuda-graphs, --decode-only-graphs"
        )

    version = resolve_model(args.model_repository, args.model)
    if args.max_num_seqs:
        version = with_max_num_seqs(version, args.max_num_seqs)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arrivals = workload(args.requests, args.rate, args.seed)
    engine = {
        "attention": TORCH_DEFAULT if args.attention == "torch-default" else None,
        "cuda_graphs": not args.no_cuda_graphs,
        "graph_prompts": not args.decode_only_graphs,
        "stand_in_step_s": args.stand_in_step_ms / 1000,
        "stream_between_steps": args.stream_between_steps,
        "priority": PriorityClass.parse(args.priority),
        "tenant_per_request": args.tenant_per_request,
    }
    report: dict = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "model": version.config.name,
        "requests": args.requests,
        "rate_per_s": args.rate,
        "attention": args.attention,
        "cuda_graphs": engine["cuda_graphs"],
        "graph_prompts": engine["graph_prompts"],
        "stand_in_step_s": engine["stand_in_step_s"],
        "stream_between_steps": engine["stream_between_steps"],
        "priority": args.priority,
        "tenant_per_request": args.tenant_per_request,
        "max_num_seqs": getattr(version.config.generation, "max_num_seqs", None),
    }
    if args.quick:
        report["continuous"] = measure("continuous", version, device, arrivals, **engine)
        report["continuous"].pop("tokens")
        print_table(report, ("continuous",))
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
        return
    for name, is_static in (("static", True), ("continuous", False)):
        report[name] = measure(name, version, device, arrivals, is_static=is_static, **engine)
    same = identical_outputs(report["static"], report["continuous"], engine)
    report["identical_outputs"] = same
    continuous, static = report["continuous"], report["static"]
    report["tokens_per_s_ratio"] = continuous["tokens_per_s"] / static["tokens_per_s"]
    report["ttft_p99_ratio"] = continuous["ttft_p99_s"] / static["ttft_p99_s"]
    report["steps_ratio"] = static["steps"] / continuous["steps"]
    print_table(report, ("static", "continuous"))
    print(
        f"\ncontinuous / static: {report['tokens_per_s_ratio']:.2f}x tokens/s, "
        f"TTFT p99 {report['ttft_p99_ratio']:.2f}x, {report['steps_ratio']:.2f}x fewer steps; "
        f"identical greedy outputs: {said(same)}"
    )
    report["prefix_cache"] = prefix_cache_report(
        version, device, shared_prefix_workload(args.requests, args.rate, args.seed + 1), engine
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))


def measure(
    name: str, version: ModelVersion, device: torch.device, arrivals: list[Arrival], **kw: Any
) -> dict:
    """One fresh engine (its own metrics; `kw` for GenerationBackend, `stand_in_step_s`,
    `stream_between_steps`, `priority` and `tenant_per_request`) through `arrivals`; adds the
    prefix cache's counts and the engine's attention kernels and graphs."""
    stand_in_s = kw.pop("stand_in_step_s", 0.0)
    between_steps = kw.pop("stream_between_steps", False)
    priority = kw.pop("priority", PriorityClass.BATCH)
    tenant_per_request = kw.pop("tenant_per_request", False)
    registry = CollectorRegistry()
    backend = GenerationBackend(version, device, GenerationMetrics(registry), **kw)
    started = time.perf_counter()
    backend.warm_up()
    warm_up_s = time.perf_counter() - started
    runner = backend.runner
    if stand_in_s:
        stand_in.install(backend, stand_in_s)
    backend.engine.streams_during_steps = not between_steps
    warm_up_steps = (runner.num_replayed_steps, runner.num_eager_steps)
    print(f"running {name} ...", flush=True)
    result = asyncio.run(run(backend, arrivals, priority, tenant_per_request))
    labels = {"model": version.config.name, "version": version.version}
    for key, metric in (
        ("prefix_queried_tokens", names.GENERATION_PREFIX_CACHE_QUERIED_TOKENS_TOTAL),
        ("prefix_hit_tokens", names.GENERATION_PREFIX_CACHE_HIT_TOKENS_TOTAL),
    ):
        result[key] = registry.get_sample_value(metric, labels) or 0.0
    result["warm_up_s"] = warm_up_s
    # The step (forward and the hop to its thread) against the wall time per step, which
    # adds scheduling, sampling and streaming (and, below saturation, idle waits for arrivals).
    steps = registry.get_sample_value(f"{names.GENERATION_STEP_SECONDS}_count", labels) or 1.0
    step_s = registry.get_sample_value(f"{names.GENERATION_STEP_SECONDS}_sum", labels) or 0.0
    result["step_ms"] = 1000 * step_s / steps
    result["wall_per_step_ms"] = 1000 * result["elapsed_s"] / max(1, result["steps"])
    result["replayed_steps"] = runner.num_replayed_steps - warm_up_steps[0]
    result["eager_steps"] = runner.num_eager_steps - warm_up_steps[1]
    result["attention_backends"] = runner.attention.name
    result["cuda_graphs"] = 0 if runner.graphs is None else runner.graphs.count
    return result


def prefix_cache_report(
    version: ModelVersion, device: torch.device, arrivals: list[Arrival], engine: dict
) -> dict:
    """The continuous engine on a shared-prefix workload, prefix cache off, then on."""
    report = {
        name: measure(f"shared prefix, cache {name}", with_prefix_caching(version, scope), device,
                      arrivals, is_static=False, **engine)
        for name, scope in (("off", "off"), ("on", "shared"))
    }  # fmt: skip
    report["identical_outputs"] = identical_outputs(report["off"], report["on"], engine)
    on, off = report["on"], report["off"]
    report["hit_rate"] = on["prefix_hit_tokens"] / max(1.0, on["prefix_queried_tokens"])
    report["tokens_per_s_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    report["ttft_p50_ratio"] = on["ttft_p50_s"] / off["ttft_p50_s"]
    report["ttft_p99_ratio"] = on["ttft_p99_s"] / off["ttft_p99_s"]
    print_table(report, ("off", "on"))
    print(
        f"\nprefix cache on / off: {report['tokens_per_s_ratio']:.2f}x tokens/s, TTFT p50 "
        f"{report['ttft_p50_ratio']:.2f}x, p99 {report['ttft_p99_ratio']:.2f}x; hit rate "
        f"{report['hit_rate']:.0%} of prompt tokens; identical greedy outputs: "
        f"{said(report['identical_outputs'])}"
    )
    return report


def identical_outputs(first: dict, second: dict, engine: dict) -> bool | None:
    """Whether two runs gave every request both served the same tokens (their token lists
    taken out of the reports); None under the stand-in, whose tokens are all 0."""
    pairs = zip(first.pop("tokens"), second.pop("tokens"), strict=True)
    same = all(a == b for a, b in pairs if a is not None and b is not None)
    return None if engine["stand_in_step_s"] else same


def said(same: bool | None) -> str:
    return "not compared (stand-in)" if same is None else str(same)


def print_table(report: dict, names_: tuple[str, ...]) -> None:
    header = (
        "policy", "tok/s", "good", "steps", "TTFT p50", "TTFT p99", "TPOT", "late", "step", "wall",
        "refused",
    )  # fmt: skip
    print("\n{:<11} {:>8} {:>8} {:>6} {:>9} {:>9} {:>8} {:>5} {:>8} {:>8} {:>7}".format(*header))
    for name in names_:
        r = report[name]
        print(
            f"{name:<11} {r['tokens_per_s']:>8.0f} {r['goodput_tokens_per_s']:>8.0f} "
            f"{r['steps']:>6} "
            f"{r['ttft_p50_s'] * 1000:>7.0f}ms {r['ttft_p99_s'] * 1000:>7.0f}ms "
            f"{r['tpot_mean_s'] * 1000:>6.1f}ms {r['late_sends']:>5} "
            f"{r['step_ms']:>6.2f}ms {r['wall_per_step_ms']:>6.2f}ms {r['refused']:>7}"
        )
        if r["replayed_steps"]:
            replayed, eager = r["replayed_steps"], r["eager_steps"]
            print(f"{'':<11} steps from CUDA graphs {replayed}, eager {eager}")


if __name__ == "__main__":
    main()
