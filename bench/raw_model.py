"""Raw in-process model throughput: the physical limit the serving stack is measured against.

    python -m bench.raw_model [--batch-sizes 1 8 32] [--lengths 16 128] [--seconds 3] [--compile]

Runs the model repository's embedding backend directly (no gRPC, no batcher) on the device the
worker would use, and prints sequences/s per (input length, batch size). With `--compile`, the
same backend with its forward through torch.compile (the worker's `--compile-models`) is
measured right after each point, and the speed-up printed. Writes JSON to
bench/results/raw_model.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from services.common.model_repository import load_repository
from services.gpu_worker.backends import LoadOptions, load_backend
from services.gpu_worker.backends.base import select_device


def measure(backend, num_tokens: int, batch_size: int, seconds: float) -> float:
    rows = backend.warmup_rows(num_tokens, batch_size)
    backend.run(rows)  # warm
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        backend.run(rows)
        done += batch_size
    if backend.device.type == "cuda":
        torch.cuda.synchronize()
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[16, 128],
        help="input lengths in tokens, special tokens included",
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per point")
    parser.add_argument("--output", type=Path, default=Path("bench/results/raw_model.json"))
    parser.add_argument(
        "--compile", action="store_true", help="also measure the forward through torch.compile"
    )
    args = parser.parse_args()

    version = next(v for v in load_repository(args.model_repository) if v.config.name == args.model)
    backend = load_backend(version, select_device())
    compiled = None
    if args.compile:
        compiled = load_backend(version, backend.device, LoadOptions(compile_models=True))
        started = time.perf_counter()
        compiled.warm_up()
        state = "compiled" if compiled.is_compiled else "NOT compiled (see the warning)"
        print(f"torch.compile: {state} in {time.perf_counter() - started:.1f} s")
    results = []
    threads = torch.get_num_threads()
    print(f"{args.model}/{version.version} on {backend.device}, torch threads {threads}")
    print(f"{'tokens':>7} {'batch':>6} {'seq/s':>9}" + ("  compiled  speed-up" if compiled else ""))
    for length in args.lengths:
        for batch_size in args.batch_sizes:
            rate = measure(backend, length, batch_size, args.seconds)
            point = {"num_tokens": length, "batch_size": batch_size, "sequences_per_s": rate}
            line = f"{length:>7} {batch_size:>6} {rate:>9.1f}"
            if compiled is not None:
                compiled_rate = measure(compiled, length, batch_size, args.seconds)
                point["compiled_sequences_per_s"] = compiled_rate
                point["compile_speedup"] = compiled_rate / rate
                line += f" {compiled_rate:>9.1f} {compiled_rate / rate:>8.2f}x"
            results.append(point)
            print(line, flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"device": str(backend.device), "points": results}, indent=2))


if __name__ == "__main__":
    main()
