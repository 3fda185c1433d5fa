"""Time of one generation step, eager and replayed from a CUDA graph.

    python -m bench.generation_steps [--model NAME_OR_DIR] [--batch-sizes 1 8 32]
        [--context 128] [--steps 50] [--prompt-tokens 64]

For each batch size: that many sequences with `context` cached positions each, then `steps`
decode steps through `ModelRunner.execute` (the engine's step, logits copied back included),
timed on the host, eagerly and (on a GPU) from the captured graphs, on the kernels the warm-up
chose; beside each, the device's busy time per step (CUDA events, as the worker's duty cycle
counts it; the wall time on a CPU). Then the same number of sequences with a prompt of
`prompt-tokens` in each step in place of one decode (a mixed step, `+prompt`). Writes
bench/results/generation_steps.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from bench.generation import resolve_model
from services.gpu_worker.device_busy import DeviceBusy
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.block_allocator import num_blocks_for
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.generation.model_runner import ModelRunner, SequenceBatchItem


def time_steps(
    runner: ModelRunner,
    tables: list[tuple[int, ...]],
    context: int,
    steps: int,
    prompt: SequenceBatchItem | None = None,
) -> dict[str, float]:
    """Mean host and device milliseconds of a decode step of every sequence in `tables`
    (three untimed steps first), or with `prompt` in every step in place of the last."""
    wall, device = [], []
    for step in range(-3, steps):
        position = context + max(step, 0)
        items = [SequenceBatchItem((7,), position, table) for table in tables]
        if prompt is not None:
            items[-1] = prompt
        busy = DeviceBusy(runner.execute, runner.device)
        started = time.perf_counter()
        busy(items)
        if step >= 0:
            wall.append(time.perf_counter() - started)
            device.append(busy.seconds)
    return {
        "step_ms": statistics.fmean(wall) * 1000,
        "step_p90_ms": sorted(wall)[int(0.9 * (len(wall) - 1))] * 1000,
        "device_busy_ms": statistics.fmean(device) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=Path("bench/results/generation_steps.json"))
    args = parser.parse_args()

    version = resolve_model(args.model_repository, args.model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = GenerationBackend(version, device, GenerationMetrics(CollectorRegistry()))
    backend.warm_up()
    runner, graphs = backend.runner, backend.runner.graphs
    settings = backend.settings
    per_seq = num_blocks_for(args.context + args.steps + 1, runner.block_size)
    report: dict = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "model": version.config.name,
        "context": args.context,
        "attention_backends": runner.attention.name,
        "cuda_graphs": 0 if graphs is None else graphs.count,
        "batches": {},
    }
    print(f"{report['model']} on {report['device']}, attention {runner.attention.name}")
    print(f"{'batch':>5} {'mode':>12} {'step ms':>8} {'p90 ms':>8} {'device ms':>10}")
    # The mixed steps' prompt: the cache's last blocks, past every batch's sequences.
    prompt_blocks = num_blocks_for(args.prompt_tokens, runner.block_size)
    first_free = settings.num_kv_blocks - prompt_blocks
    mixed = SequenceBatchItem(
        tuple(1 + j % 200 for j in range(args.prompt_tokens)),
        0,
        tuple(range(first_free, first_free + prompt_blocks)),
    )
    for count in args.batch_sizes:
        if count * per_seq > first_free or count > settings.max_num_seqs:
            print(f"{count:>5}: more sequences than the cache or max_num_seqs holds, skipped")
            continue
        tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(count)]
        prompt = tuple(1 + j % 200 for j in range(args.context))
        runner.execute([SequenceBatchItem(prompt, 0, table) for table in tables])
        modes = {"eager": None, "graph": graphs} if graphs is not None else {"eager": None}
        for with_prompt in (None, mixed):
            for mode, replaying in modes.items():
                runner.graphs = replaying
                replays = runner.num_replayed_steps
                figures = time_steps(runner, tables, args.context, args.steps, with_prompt)
                # Every step, the three untimed ones too, from a graph.
                figures["replayed"] = runner.num_replayed_steps - replays == args.steps + 3
                name = mode if with_prompt is None else f"{mode}+prompt"
                report["batches"].setdefault(str(count), {})[name] = figures
                print(
                    f"{count:>5} {name:>12} {figures['step_ms']:>8.3f}"
                    f" {figures['step_p90_ms']:>8.3f} {figures['device_busy_ms']:>10.3f}"
                )
        runner.graphs = graphs
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
