"""The generation stand-in (`bench.generation_stand_in`): every step takes a GPU's host path
and never runs the model, so benchmarks on a CPU measure the engine's own Python."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from bench import generation_stand_in
from bench.generation import run, workload
from services.common.model_repository import load_repository
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.metrics import GenerationMetrics

pytestmark = pytest.mark.integration


def test_the_stand_in_serves_every_step_and_never_runs_the_model() -> None:
    repository = Path(__file__).resolve().parents[2] / "models"
    version = next(v for v in load_repository(repository) if v.config.name == "tiny-llama")
    backend = GenerationBackend(
        version, torch.device("cpu"), GenerationMetrics(CollectorRegistry())
    )
    backend.warm_up()
    runner = backend.runner
    generation_stand_in.install(backend, 0.0001)
    for cache in (*runner.kv_cache.keys, *runner.kv_cache.values):
        cache.zero_()  # the warm-up's steps wrote some
    eager_before = runner.num_eager_steps
    arrivals = workload(48, 2000.0, seed=1)

    result = asyncio.run(run(backend, arrivals))

    # Every request got all its tokens, each token 0 (zero logits, greedy).
    assert [len(t) for t in result["tokens"]] == [a.max_tokens for a in arrivals]
    assert {token for tokens in result["tokens"] for token in tokens} == {0}
    # Every step (prompts' too: 48 prompts in 0.02 s share steps with decodes) was the
    # stand-in's; the model never ran: nothing was written to the KV cache.
    assert runner.num_eager_steps == eager_before
    assert runner.num_replayed_steps == result["steps"] > max(a.max_tokens for a in arrivals)
    assert not any(cache.any() for cache in (*runner.kv_cache.keys, *runner.kv_cache.values))
