"""Host time of streaming one sampled token: the generation engine's per-token path.

    python -m bench.token_stream [--streams 32] [--steps 300] [--repeats 5]

`streams` requests (tiny-llama's tokenizer, no stop strings) each take one token a step for
`steps` steps through `RequestStream.push_token` (stop checks, incremental detokenizing, the
delta queued for its reader, its metrics counted), with the metrics' flush once a step as the
engine's plan does (`BoundGenerationMetrics.flush_tokens`); readers take nothing (what they
would merge is dropped a step at a time). Reports the best of `repeats` in microseconds a
token. On a GPU this path is the engine's host work a token, beside the device's step; here it
is timed alone, to a few percent where the engine's end-to-end figure moves 10-30% between
runs. Writes bench/results/token_stream.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.common.sampling import SamplingParams
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.generation.request_stream import RequestStream
from services.gpu_worker.generation.tiny_llama import EOS_TOKEN_ID, build_tokenizer

#: Letters, as tiny-llama's byte tokenizer reads them: each token is one character of text.
_FIRST_LETTER = 65


def us_per_token(num_streams: int, num_steps: int) -> float:
    """Microseconds a token over `num_steps` steps of `num_streams` streams."""
    tokenizer = build_tokenizer()
    bound = GenerationMetrics(CollectorRegistry()).bind(("tiny-llama", "1"))
    params = SamplingParams(max_tokens=num_steps + 1)
    streams = [
        RequestStream.open(i, params, tokenizer, [5, 6, 7], arrival_s=0.0, tenant="t")
        for i in range(num_streams)
    ]
    eos = frozenset({EOS_TOKEN_ID})
    started = time.perf_counter()
    for step in range(1, num_steps + 1):
        now_s = step * 0.001
        for stream in streams:
            stream.push_token(_FIRST_LETTER + step % 26, step, now_s, eos, bound)
        bound.flush_tokens()
        for stream in streams:
            stream.output._pending.clear()  # read by no one: nothing piles up
    return (time.perf_counter() - started) / (num_streams * num_steps) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("bench/results/token_stream.json"))
    args = parser.parse_args()
    runs = [us_per_token(args.streams, args.steps) for _ in range(args.repeats)]
    result = {"streams": args.streams, "steps": args.steps, "us_per_token": min(runs)}
    print(f"{min(runs):.2f} us a token (best of {args.repeats}; all: "
          f"{', '.join(f'{r:.2f}' for r in runs)})")  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
