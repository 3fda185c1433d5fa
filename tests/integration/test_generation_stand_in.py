"""The generation stand-in (`bench.generation_stand_in`): every step takes a GPU's host path
and never runs the model, so benchmarks on a CPU measure the engine's own Python."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from bench import generation_stand_in
from bench.generation import Arrival, run, workload
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


def test_a_send_its_loop_held_back_counts_late_and_waits_in_its_ttft() -> None:
    """The second arrival is due at 0.1 s while the loop is held from 0.02 s to 0.42 s (as
    the engine's steps, which share it, may hold it): it is counted late, and its TTFT counts
    from when it was due. Judged before its sleep and timed from its wake-up, it was neither
    (bench review)."""
    repository = Path(__file__).resolve().parents[2] / "models"
    version = next(v for v in load_repository(repository) if v.config.name == "tiny-llama")
    backend = GenerationBackend(
        version, torch.device("cpu"), GenerationMetrics(CollectorRegistry())
    )
    backend.warm_up()
    generation_stand_in.install(backend, 0.0001)
    arrivals = [Arrival(0.0, "a prompt", 2), Arrival(0.1, "another prompt", 2)]

    async def held() -> dict[str, object]:
        asyncio.get_running_loop().call_later(0.02, time.sleep, 0.4)
        return await run(backend, arrivals)

    result = asyncio.run(held())
    assert result["late_sends"] == 1
    assert result["ttft_p99_s"] >= 0.3  # the held arrival's, from 0.1 s: about 0.32 s
