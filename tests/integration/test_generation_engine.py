"""The generation engine on a real (tiny, random) Llama checkpoint made with `transformers`,
checked token for token against `transformers`' own greedy generate."""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from services.common import metric_names as names
from services.common.errors import ExecutionFailed, InvalidInput, Overloaded, Unavailable
from services.common.model_repository import load_repository
from services.common.sampling import SamplingParams
from services.gpu_worker.batching.failure_streak import FailingConfig
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.engine import GenerationEngine
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.generation.request_stream import Delta, RequestStream
from services.gpu_worker.generation.sampler import Sampler
from services.gpu_worker.generation.step_inputs import is_decode
from services.gpu_worker.load_options import LoadOptions
from services.gpu_worker.loaded_models import load_version
from services.gpu_worker.metrics import WorkerMetrics
from services.gpu_worker.server import WorkerServicer
from services.gpu_worker.thread_choice import ThreadChoice
from services.pb.inference.v1 import types_pb2 as tpb
from services.pb.inference.v1 import worker_pb2 as wpb
from tests.support.metrics import total
from tests.support.processes import REPO_ROOT
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

PROMPTS = ("Hello, world", "a", "The quick brown fox jumps over the lazy dog and keeps running")


def write_repository(
    root: Path,
    *,
    num_kv_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    weights_from: Path | None = None,
    prefix_caching: str = "shared",
    slo_p99_ms: int = 5000,
) -> Path:
    """A model repository holding a random transformers Llama and tiny-llama's byte tokenizer
    (copied from `weights_from`, another such repository, when given)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    version_dir = root / "ref-llama" / "1"
    if weights_from is not None:
        shutil.copytree(weights_from / "ref-llama" / "1", version_dir)
    else:
        torch.manual_seed(1234)
        config = LlamaConfig(
            vocab_size=258,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=256,
            eos_token_id=257,
        )
        LlamaForCausalLM(config).save_pretrained(version_dir, safe_serialization=True)
        shutil.copy(REPO_ROOT / "models" / "tiny-llama" / "1" / "tokenizer.json", version_dir)
    (root / "ref-llama" / "config.toml").write_text(
        f"""
kind = "generation"
slo_p99_ms = {slo_p99_ms}
max_batch_size = {max_num_seqs}

[generation]
max_model_len = 256
block_size = {block_size}
num_kv_blocks = {num_kv_blocks}
max_num_seqs = {max_num_seqs}
max_num_batched_tokens = 64
prefix_caching = "{prefix_caching}"

[inputs.text_input]
dtype = "BYTES"
dims = [1]

[outputs.text_output]
dtype = "BYTES"
dims = [1]
"""
    )
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("ref"))


def make_backend(repository: Path) -> tuple[GenerationBackend, CollectorRegistry]:
    registry = CollectorRegistry()
    (version,) = load_repository(repository)
    return GenerationBackend(version, torch.device("cpu"), GenerationMetrics(registry)), registry


@pytest.fixture
async def engine_backend(checkpoint: Path) -> Iterator[GenerationBackend]:
    backend, _ = make_backend(checkpoint)
    backend.engine.start()
    yield backend
    await backend.engine.drain()


def reference_greedy(checkpoint: Path, prompt_ids: list[int], num_tokens: int) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(checkpoint / "ref-llama" / "1").eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=num_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


async def deltas(
    backend: GenerationBackend,
    prompt: str,
    params: SamplingParams,
    started: asyncio.Event | None = None,
) -> list[Delta]:
    """Every delta of a request; sets `started` once it has two tokens."""
    got: list[Delta] = []
    async for delta in backend.engine.generate(backend.encode(prompt), params):
        got.append(delta)
        if started is not None and sum(len(d.token_ids) for d in got) >= 2:
            started.set()
    return got


def token_ids(got: list[Delta]) -> list[int]:
    return [token for delta in got for token in delta.token_ids]


async def collect(
    backend: GenerationBackend,
    prompt: str,
    params: SamplingParams,
    started: asyncio.Event | None = None,
) -> list[int]:
    return token_ids(await deltas(backend, prompt, params, started))


async def test_s18_greedy_matches_transformers_with_staggered_arrivals(
    checkpoint: Path, engine_backend: GenerationBackend
) -> None:
    backend = engine_backend
    lengths = (24, 30, 18)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    # Each request joins while the previous ones are decoding: one continuous batch.
    first_started, second_started = asyncio.Event(), asyncio.Event()
    a = asyncio.ensure_future(collect(backend, PROMPTS[0], params[0], first_started))
    await first_started.wait()
    b = asyncio.ensure_future(collect(backend, PROMPTS[1], params[1], second_started))
    await second_started.wait()
    c = asyncio.ensure_future(collect(backend, PROMPTS[2], params[2]))
    results = await asyncio.gather(a, b, c)
    for prompt, n, got in zip(PROMPTS, lengths, results, strict=True):
        assert got == reference_greedy(checkpoint, backend.encode(prompt), n), prompt
    assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks


SYSTEM = "You are a careful assistant. Answer briefly and cite the manual. "


async def generate_ids(backend: GenerationBackend, prompt: str, tenant: str = "") -> list[int]:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens: list[int] = []
    async for delta in backend.engine.generate(backend.encode(prompt), params, tenant=tenant):
        tokens.extend(delta.token_ids)
    return tokens


@pytest.mark.parametrize("scope", ["shared", "per_tenant"])
async def test_prefix_cached_prompts_give_the_reference_tokens(
    checkpoint: Path, tmp_path: Path, scope: str
) -> None:
    """Requests that start with the same system prompt share its computed blocks (one after
    another and at once); every reply still equals transformers' greedy one. Per tenant, one
    tenant's blocks are never another's."""
    backend, registry = make_backend(
        write_repository(tmp_path, weights_from=checkpoint, prefix_caching=scope)
    )
    prompts = [SYSTEM + "What is a KV cache?", SYSTEM + "Why batch requests?"]
    backend.engine.start()
    try:
        first = await generate_ids(backend, prompts[0], tenant="a")
        other_tenant = await generate_ids(backend, prompts[0], tenant="b")
        metrics = generate_latest(registry).decode()
        hits_across_tenants = total(metrics, names.GENERATION_PREFIX_CACHE_HIT_TOKENS_TOTAL)
        together = await asyncio.gather(
            *(generate_ids(backend, prompt, tenant="a") for prompt in [*prompts, *prompts])
        )
    finally:
        await backend.engine.drain()
    metrics = generate_latest(registry).decode()
    queried = total(metrics, names.GENERATION_PREFIX_CACHE_QUERIED_TOKENS_TOTAL)
    hits = total(metrics, names.GENERATION_PREFIX_CACHE_HIT_TOKENS_TOTAL)
    num_system_tokens = len(backend.encode(SYSTEM))
    # The same prompt again: every full block but the one holding its last token.
    same_prompt_hits = (len(backend.encode(prompts[0])) - 1) // 4 * 4
    assert hits_across_tenants == (0 if scope == "per_tenant" else same_prompt_hits)
    assert queried == sum(
        len(backend.encode(p)) for p in [prompts[0], *prompts, *prompts, prompts[0]]
    )
    assert hits >= 4 * (num_system_tokens // 4 * 4), (hits, queried)
    expected = [reference_greedy(checkpoint, backend.encode(p), 12) for p in prompts]
    assert first == other_tenant == expected[0]
    assert together == [*expected, *expected]
    assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks


async def test_preemption_then_resume_gives_the_uninterrupted_tokens(
    checkpoint: Path, tmp_path: Path
) -> None:
    # 28 blocks of 4 tokens: each sequence fits alone (the longest needs 24 blocks), all three
    # (43 blocks) do not, so running them together must preempt.
    backend, registry = make_backend(
        write_repository(tmp_path, num_kv_blocks=28, weights_from=checkpoint)
    )
    backend.engine.start()
    try:
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        results = await asyncio.gather(*(collect(backend, p, params) for p in PROMPTS))
    finally:
        await backend.engine.drain()
    preemptions = total(generate_latest(registry).decode(), names.GENERATION_PREEMPTIONS_TOTAL)
    assert preemptions > 0, "the test must actually preempt"
    for prompt, got in zip(PROMPTS, results, strict=True):
        assert got == reference_greedy(checkpoint, backend.encode(prompt), 30), prompt
    assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks


async def test_s10_cancelled_stream_frees_blocks_and_a_waiting_request_starts(
    checkpoint: Path, tmp_path: Path
) -> None:
    # One sequence at a time: the second waits until the first is cancelled.
    backend, registry = make_backend(
        write_repository(tmp_path, max_num_seqs=1, weights_from=checkpoint)
    )
    backend.engine.start()
    try:
        long_params = SamplingParams(max_tokens=60, ignore_eos=True)
        stream = backend.engine.generate(backend.encode(PROMPTS[2]), long_params)
        first = await anext(stream)
        assert first.token_ids
        waiting = asyncio.ensure_future(collect(backend, PROMPTS[2], long_params))
        await eventually(lambda: backend.scheduler.num_waiting == 1, interval_s=0.01)
        assert not waiting.done()
        await stream.aclose()  # the client goes away
        tokens = await asyncio.wait_for(waiting, 60)
        assert len(tokens) == 60
    finally:
        await backend.engine.drain()
    assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks
    assert total(generate_latest(registry).decode(), names.GENERATION_CANCELLED_TOTAL) == 1


async def test_first_token_deadline_refuses_only_a_busy_engine(
    checkpoint: Path, tmp_path: Path
) -> None:
    backend, registry = make_backend(
        write_repository(tmp_path, max_num_seqs=1, weights_from=checkpoint)
    )
    backend.engine.start()
    try:
        # Idle: admitted however small the limit, the prediction alone never refuses.
        tokens = []
        async for delta in backend.engine.generate(
            backend.encode(PROMPTS[0]), SamplingParams(max_tokens=3), first_token_limit_s=1e-9
        ):
            tokens.extend(delta.token_ids)
        assert len(tokens) == 3
        # Busy (one long stream holds the only slot): a prompt that cannot see its first token
        # within its limit is refused at once, with a retry hint; a patient one is admitted.
        busy = backend.engine.generate(
            backend.encode(PROMPTS[2]), SamplingParams(max_tokens=60, ignore_eos=True)
        )
        await anext(busy)
        with pytest.raises(Overloaded, match="first token predicted") as refused:
            await anext(
                backend.engine.generate(
                    backend.encode(PROMPTS[2]),
                    SamplingParams(max_tokens=3),
                    first_token_limit_s=1e-6,
                )
            )
        assert refused.value.retry_after_s > 0
        patient = asyncio.ensure_future(
            collect(backend, PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
        )
        await busy.aclose()
        assert len(await asyncio.wait_for(patient, 60)) == 3
    finally:
        await backend.engine.drain()
    assert total(generate_latest(registry).decode(), names.GENERATION_REJECTED_TOTAL) == 1


async def test_the_prefill_backlog_counts_the_prompts_still_waiting_for_a_first_token(
    checkpoint: Path, tmp_path: Path
) -> None:
    """`num_waiting_tokens` (the first-token prediction's backlog, and the worker's record)
    is kept as a count: each prompt counts from its admission until its first token is
    sampled or it leaves."""
    backend, _ = make_backend(write_repository(tmp_path, max_num_seqs=1, weights_from=checkpoint))
    engine = backend.engine
    engine.start()
    try:
        busy = engine.generate(
            backend.encode(PROMPTS[2]), SamplingParams(max_tokens=180, ignore_eos=True)
        )
        await anext(busy)
        assert engine.num_waiting_tokens == 0  # its first token came
        short = SamplingParams(max_tokens=2, ignore_eos=True)
        staying, leaving = (engine.generate(backend.encode(p), short) for p in PROMPTS[:2])
        first = asyncio.ensure_future(anext(staying))
        leaving_first = asyncio.ensure_future(anext(leaving))
        # The only seat is busy for its 180 tokens.
        await eventually(lambda: engine.scheduler.num_waiting == 2, interval_s=0.001)
        lengths = [len(backend.encode(p)) for p in PROMPTS[:2]]
        assert engine.num_waiting_tokens == sum(lengths)
        leaving_first.cancel()  # its caller goes before its first token
        with contextlib.suppress(asyncio.CancelledError):
            await leaving_first
        await leaving.aclose()
        assert engine.num_waiting_tokens == lengths[0]
        await busy.aclose()
        await first
        assert engine.num_waiting_tokens == 0
        await staying.aclose()
    finally:
        await engine.drain()
    assert engine.num_waiting_tokens == 0


async def test_a_request_past_the_context_is_counted_refused(checkpoint: Path) -> None:
    """Refused before the scheduler's checks (prompt and max_tokens past max_model_len, the
    commonest refusal), it was counted nowhere: the refused counter saw only the scheduler's
    own refusals (review finding)."""
    backend, registry = make_backend(checkpoint)
    backend.engine.start()
    try:
        with pytest.raises(InvalidInput, match="maximum length of 256"):
            await anext(
                backend.engine.generate(backend.encode(PROMPTS[0]), SamplingParams(max_tokens=256))
            )
    finally:
        await backend.engine.drain()
    assert total(generate_latest(registry).decode(), names.GENERATION_REJECTED_TOTAL) == 1


@pytest.mark.parametrize(("num_kv_blocks", "block_size"), [(64, 1), (2, 1), (1, 4)])
async def test_a_cache_of_small_blocks_or_one_block_warms_up_and_serves(
    checkpoint: Path, tmp_path: Path, num_kv_blocks: int, block_size: int
) -> None:
    """Warm-up ran a fixed table of two blocks past a block's length: a cache of one-token
    blocks (its decode needed three) or of one block failed the load with the runner's
    ValueError (review finding). Each such cache warms up and serves a request that fits."""
    repository = write_repository(
        tmp_path, num_kv_blocks=num_kv_blocks, block_size=block_size, weights_from=checkpoint
    )
    backend, _ = make_backend(repository)
    backend.warm_up()
    backend.engine.start()
    try:  # one prompt token and one generated: what the smallest of these caches holds
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        deltas = [d async for d in backend.engine.generate(backend.encode("hi")[:1], params)]
    finally:
        await backend.engine.drain()
    assert len(token_ids(deltas)) == 1


async def test_a_request_that_can_never_fit_is_invalid(checkpoint: Path, tmp_path: Path) -> None:
    backend, _ = make_backend(write_repository(tmp_path, num_kv_blocks=4, weights_from=checkpoint))
    backend.engine.start()
    try:
        # Not Overloaded: no retry, here or elsewhere, can make it fit this cache.
        with pytest.raises(InvalidInput, match="KV blocks"):
            await anext(
                backend.engine.generate(backend.encode(PROMPTS[2]), SamplingParams(max_tokens=40))
            )
        # Nor while the engine is busy and the caller's first token has a limit (its
        # prediction was checked first, and refused it Overloaded, with a retry hint).
        busy = backend.engine.generate(
            backend.encode(PROMPTS[1]), SamplingParams(max_tokens=4, ignore_eos=True)
        )
        await anext(busy)
        with pytest.raises(InvalidInput, match="KV blocks"):
            await anext(
                backend.engine.generate(
                    backend.encode(PROMPTS[2]),
                    SamplingParams(max_tokens=40),
                    first_token_limit_s=1e-6,
                )
            )
        await busy.aclose()
    finally:
        await backend.engine.drain()


async def test_same_seed_same_tokens_and_stop_conditions(engine_backend: GenerationBackend) -> None:
    backend = engine_backend
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    first, second = await asyncio.gather(*(collect(backend, "seeded", sampled) for _ in range(2)))
    assert first == second and len(first) == 12
    other = await collect(
        backend, "seeded", SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)
    )
    assert other != first
    # A stop token ends the stream without returning it.
    greedy = await collect(backend, "stops", SamplingParams(max_tokens=12, ignore_eos=True))
    stopped = await collect(
        backend,
        "stops",
        SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(greedy[4],)),
    )
    assert stopped == greedy[: greedy.index(greedy[4])]


async def test_generation_steps_count_their_device_time(checkpoint: Path) -> None:
    # The worker's device-busy counter is shared with its generation models: a pod serving
    # only generation still has a duty cycle, at zero from load.
    registry = CollectorRegistry()
    busy = WorkerMetrics(registry).device_busy_seconds_total
    (version,) = load_repository(checkpoint)
    metrics = GenerationMetrics(registry, device_busy_seconds_total=busy)
    backend = GenerationBackend(version, torch.device("cpu"), metrics)
    labels = {"model": version.config.name, "version": version.version, "work": "online"}
    name = names.WORKER_DEVICE_BUSY_SECONDS_TOTAL
    assert registry.get_sample_value(name, labels) == 0.0
    backend.engine.start()
    try:
        tokens = await collect(backend, "busy", SamplingParams(max_tokens=8, ignore_eos=True))
    finally:
        await backend.engine.drain()
    assert len(tokens) == 8
    assert (registry.get_sample_value(name, labels) or 0.0) > 0.0


async def test_only_online_streams_count_in_the_time_to_first_token(checkpoint: Path) -> None:
    """A generation pool scales on this histogram's p90 (deploy/k8s/prometheus-adapter), and
    batch-class streams wait behind online ones on purpose: counted, a backlog of batch
    generations scaled GPU pools up, as queue wait and the duty cycle leave batch work out
    not to (review finding)."""
    backend, registry = make_backend(checkpoint)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    count = f"{names.GENERATION_TTFT_SECONDS}_count"
    labels = {"model": backend.config.name, "version": backend.version.version}
    backend.engine.start()
    try:
        for rank in (0, 1, 2, 2):  # critical, interactive, batch, batch
            stream = backend.engine.generate(backend.encode("hello"), params, priority=rank)
            assert len([token async for delta in stream for token in delta.token_ids]) == 2
    finally:
        await backend.engine.drain()
    assert registry.get_sample_value(count, labels) == 2


async def test_streamed_tokens_are_counted_once_each_by_the_time_a_reader_has_them(
    checkpoint: Path,
) -> None:
    """The engine records a step's tokens and times per output token in one flush: whenever a
    reader has a delta, its tokens are in the counter (while other streams still run, and
    after all end), and every token after a stream's first in the histogram, once."""
    backend, registry = make_backend(checkpoint)
    labels = {"model": backend.config.name, "version": backend.version.version}
    lengths = (1, 3, 8, 40)
    behind: list[tuple[int, float]] = []  # (tokens read, the counter) where it lagged

    async def read(num_tokens: int) -> int:
        params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
        num_read = 0
        async for delta in backend.engine.generate(backend.encode(f"tally {num_tokens}"), params):
            num_read += len(delta.token_ids)
            counted = registry.get_sample_value(names.GENERATION_TOKENS_TOTAL, labels) or 0.0
            if counted < num_read:
                behind.append((num_read, counted))
        return num_read

    backend.engine.start()
    try:
        assert await asyncio.gather(*map(read, lengths)) == list(lengths)
        assert not behind
        assert registry.get_sample_value(names.GENERATION_TOKENS_TOTAL, labels) == sum(lengths)
        count = registry.get_sample_value(f"{names.GENERATION_TPOT_SECONDS}_count", labels)
        assert count == sum(n - 1 for n in lengths)
    finally:
        await backend.engine.drain()


async def test_steps_run_on_the_thread_counts_the_choice_picks(checkpoint: Path) -> None:
    backend, _ = make_backend(checkpoint)
    execute = backend.runner.execute
    seen: list[int] = []

    def observed_execute(items):
        seen.append(torch.get_num_threads())  # on the step thread, inside the step
        return execute(items)

    backend.runner.execute = observed_execute
    # The backend's own engine, built again with a choice between one and two threads whatever
    # this host's cores, as the backend builds it (a step's cost follows what it holds): one
    # thread is measured first, twice, then two are tried, whatever the steps cost. What the
    # choice picks after that follows the steps' costs on this host, so the test compares each
    # step's count with the choice's own pick, not with a count of picks.
    choice = ThreadChoice((1, 2), explore_every=4, min_samples=2, detects_busy_host=False)
    picks: list[int] = []
    choose = choice.choose

    def observed_choose(size: int, *, may_explore: bool = True) -> int:
        picks.append(choose(size, may_explore=may_explore))
        return picks[-1]

    choice.choose = observed_choose  # type: ignore[method-assign]
    engine = GenerationEngine(
        backend.runner,
        backend.text.tokenizer,
        backend.scheduler,
        GenerationMetrics(CollectorRegistry()),
        labels=("ref-llama", "1"),
        eos_token_ids=frozenset(),
        max_model_len=backend.max_model_len,
        thread_choice=choice,
    )
    configured = torch.get_num_threads()
    engine.start()
    tokens: list[int] = []
    async for delta in engine.generate(
        backend.encode(PROMPTS[2]), SamplingParams(max_tokens=24, ignore_eos=True)
    ):
        tokens.extend(delta.token_ids)
    await engine.drain()
    assert seen == picks and set(seen) == {1, 2}
    assert tokens == reference_greedy(checkpoint, backend.encode(PROMPTS[2]), 24)
    # Each step's count is restored after it: threads started later get the configured one.
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [configured] and torch.get_num_threads() == configured


def test_a_version_loaded_while_serving_chooses_up_to_the_threads_resolved_at_start(
    checkpoint: Path,
) -> None:
    """torch gives a thread its count when it first asks, from the last count set anywhere: a
    version loaded while a batch runs on one thread could read one and never try more. Loaded
    with the count the worker resolved at start (LoadOptions.host_threads), it chooses up to
    that; without one, up to what its loading thread reads."""
    (version,) = load_repository(checkpoint)
    metrics = GenerationMetrics(CollectorRegistry())
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # a batch's momentary count, as the loading thread reads it
    try:
        resolved = load_version(version, torch.device("cpu"), metrics, LoadOptions(host_threads=2))
        unresolved = load_version(version, torch.device("cpu"), metrics)
    finally:
        torch.set_num_threads(previous)
    assert isinstance(resolved, GenerationBackend) and resolved.thread_choice is not None
    assert resolved.thread_choice.options == (1, 2)
    assert isinstance(unresolved, GenerationBackend) and unresolved.thread_choice is not None
    assert unresolved.thread_choice.options == (1,)


async def test_s19_failure_mid_stream_ends_with_an_error(checkpoint: Path) -> None:
    backend, _ = make_backend(checkpoint)
    execute = backend.runner.execute
    calls = {"n": 0}

    def failing_execute(items):
        # Fault injection into the real runner: the fourth step fails.
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device lost")
        return execute(items)

    backend.runner.execute = failing_execute
    backend.engine.start()
    received: list[int] = []
    try:
        with pytest.raises(ExecutionFailed, match="device lost"):
            async for delta in backend.engine.generate(
                backend.encode("x"), SamplingParams(max_tokens=20, ignore_eos=True)
            ):
                received.extend(delta.token_ids)
        # The engine keeps serving after a failed step.
        tokens = await collect(backend, "after", SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        await backend.engine.drain()
    assert 0 < len(received) < 20
    assert len(tokens) == 3
    assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks


@pytest.mark.parametrize("fault", ["the forward raises", "the logits are NaN"])
async def test_a_version_whose_steps_all_fail_is_marked_failing_until_one_succeeds(
    checkpoint: Path, fault: str
) -> None:
    """A generation version whose every step fails (fault injected into the real runner: a
    model whose weights went bad) is marked failing in the worker's heartbeat once three steps
    in a row failed over the second they must span (`--failing-batches-to-mark 3`), as a
    fixed-cost version's batches are: routers then send its streams to other workers. A step
    that succeeds clears it. Bad weights show as NaN logits no sampling takes as often as a
    forward that raises: a step whose sampling failed counted as a success, and cleared the
    mark (review finding)."""
    registry = CollectorRegistry()
    (version,) = load_repository(checkpoint)
    backend = GenerationBackend(
        version, torch.device("cpu"), GenerationMetrics(registry), failing_steps_to_mark=3
    )
    execute = backend.runner.execute
    broken = True

    def broken_execute(items):  # fault injection into the real runner
        if not broken:
            return execute(items)
        if fault == "the forward raises":
            raise RuntimeError("weights went bad")
        return torch.full_like(execute(items), math.nan)

    def is_failing() -> bool:
        record = backend.model_record(is_ready=True, batching=None)  # type: ignore[arg-type]
        gauge = total(generate_latest(registry).decode(), names.GENERATION_MODEL_FAILING)
        assert gauge == int(record.is_failing)
        return record.is_failing

    backend.runner.execute = broken_execute
    backend.engine.start()
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=1)
    try:
        for num_failed in range(1, 4):
            if num_failed > 1:
                await asyncio.sleep(0.6 * FailingConfig.min_span_s)
            with pytest.raises(ExecutionFailed):
                await collect(backend, f"call {num_failed}", params)
            assert is_failing() is (num_failed == 3)
        broken = False
        assert len(await collect(backend, "after", params)) == 3
        assert not is_failing()
    finally:
        await backend.engine.drain()


async def test_a_step_failing_beside_a_new_prompt_fails_the_prompt_alone(checkpoint: Path) -> None:
    """A failed step failed every sequence in it: a new prompt's chunk whose forward failed
    (its attention out of memory, say) ended every stream decoding beside it, though they had
    sent tokens and could not be retried (review finding). The decodes run again alone, once,
    and only the prompt's stream fails; the decoding stream's tokens are those it gets alone."""
    backend, _ = make_backend(checkpoint)
    execute = backend.runner.execute
    armed, failed_beside_decodes, reruns = False, 0, 0
    # The call after a failure beside decodes is their rerun; the one after it reads the
    # steps' mean with the rerun's time in.
    calls_since_failure: int | None = None
    mean_at_failure, mean_after_rerun = 0.0, None

    def failing_with_prompts(items):  # fault injection into the real runner
        nonlocal failed_beside_decodes, reruns, calls_since_failure
        nonlocal mean_at_failure, mean_after_rerun
        if calls_since_failure is not None:
            calls_since_failure += 1
            reruns += calls_since_failure == 1
            if calls_since_failure == 2 and mean_after_rerun is None:
                mean_after_rerun = backend.engine.mean_step_s
        if armed and not all(is_decode(item) for item in items):
            if any(is_decode(item) for item in items):
                failed_beside_decodes += 1
                calls_since_failure, mean_at_failure = 0, backend.engine.mean_step_s
            time.sleep(2.0)  # a failed step that took long: its time is not the rerun's
            raise RuntimeError("out of memory in a prompt's attention")
        return execute(items)

    backend.runner.execute = failing_with_prompts
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    backend.engine.start()
    try:
        started = asyncio.Event()
        decoding = asyncio.ensure_future(collect(backend, PROMPTS[0], params, started))
        await started.wait()
        armed = True
        with pytest.raises(ExecutionFailed, match="out of memory"):
            await collect(backend, PROMPTS[2], SamplingParams(max_tokens=5, ignore_eos=True))
        armed = False
        tokens = await decoding
        after = await collect(backend, "after", SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        await backend.engine.drain()
    assert failed_beside_decodes >= 1 and reruns >= 1  # the case in point did arise
    # The rerun's step counted its own time (decodes of milliseconds), not the failed step's
    # two seconds besides, which moved the steps' mean by a tenth of them, 0.2 s (review
    # finding). The bound leaves a rerun step up to a second on a stalled machine.
    assert mean_after_rerun is not None
    assert mean_after_rerun - mean_at_failure < 0.1, (mean_at_failure, mean_after_rerun)
    assert tokens == reference_greedy(checkpoint, backend.encode(PROMPTS[0]), 40)
    assert len(after) == 3
    assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks


async def test_a_step_that_fails_to_sample_fails_its_streams_and_the_loop_goes_on(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 16: sampling raised outside the engine's error handling, the loop died and every
    # stream of the model hung. The fault is injected into the real sampler, once.
    backend, _ = make_backend(checkpoint)
    backend.engine.start()
    real_sample_rows = Sampler.sample_rows
    calls = 0

    def sample_failing_once(self: Sampler, *args: object, **kwargs: object) -> list[object]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise FloatingPointError("probabilities contain NaN")
        return real_sample_rows(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Sampler, "sample_rows", sample_failing_once)
    try:
        with pytest.raises(ExecutionFailed, match="NaN"):
            await collect(backend, PROMPTS[0], SamplingParams(max_tokens=4))
        assert len(await collect(backend, PROMPTS[1], SamplingParams(max_tokens=4))) == 4
    finally:
        await backend.engine.drain()


async def test_a_row_that_fails_to_sample_fails_its_stream_alone(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, one row's sampling error (torch's, for probabilities that are not finite) failed
    every stream of its step. The row of seed 13 gets non-finite logits, in the real sampler."""
    backend, _ = make_backend(checkpoint)
    backend.engine.start()
    real_sample_row = Sampler._sample_row

    def nan_for_seed_13(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> int:
        if params.seed == 13:
            logits = torch.full_like(logits, math.nan)
        return real_sample_row(logits, params, generator)

    monkeypatch.setattr(Sampler, "_sample_row", staticmethod(nan_for_seed_13))
    started = asyncio.Event()
    try:
        # The greedy stream is decoding when the failing one is prefilled: they share steps.
        greedy = asyncio.create_task(
            collect(backend, PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True), started)
        )
        await started.wait()
        with pytest.raises(ExecutionFailed, match="generation failed"):
            await collect(backend, PROMPTS[1], SamplingParams(temperature=1.0, seed=13))
        assert len(await greedy) == 40
        sampled = SamplingParams(temperature=1.0, seed=14, max_tokens=3, ignore_eos=True)
        assert len(await collect(backend, PROMPTS[2], sampled)) == 3
    finally:
        await backend.engine.drain()
    assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks


async def test_a_row_whose_streaming_fails_fails_its_stream_alone(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, one row's failure to stream its token (its detokenizer raising) failed every
    stream of its step, some of them after this step's token had already been sent."""
    backend, _ = make_backend(checkpoint)
    backend.engine.start()
    assert await stream_failing_alone(backend, monkeypatch) == [False]  # streamed after a step


async def stream_failing_alone(
    backend: GenerationBackend, monkeypatch: pytest.MonkeyPatch
) -> list[bool]:
    """The request of seed 13 fails in its own detokenizer, on its second token, while a greedy
    stream shares its steps: its stream ends with the error, the greedy one goes on to its
    end, every block comes back. Returns, for each failure, whether a step was running (the
    engine then streamed during the next step). Drains the started engine of `backend`."""
    real_push_token = RequestStream.push_token
    while_stepping: list[bool] = []

    def failing_for_seed_13(
        self: RequestStream, token: int, num_generated: int, *rest: object
    ) -> bool:
        if self.params.seed == 13 and num_generated == 2:
            while_stepping.append(backend.engine._is_stepping)
            raise UnicodeDecodeError("utf-8", b"\x80", 0, 1, "invalid start byte")
        return real_push_token(self, token, num_generated, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(RequestStream, "push_token", failing_for_seed_13)
    started = asyncio.Event()
    try:
        # The greedy stream is decoding when the failing one is prefilled: they share steps.
        greedy = asyncio.create_task(
            collect(backend, PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True), started)
        )
        await started.wait()
        failing = SamplingParams(temperature=1.0, seed=13, max_tokens=20, ignore_eos=True)
        with pytest.raises(ExecutionFailed, match="invalid start byte"):
            await collect(backend, PROMPTS[1], failing)
        assert len(await greedy) == 40
    finally:
        await backend.engine.drain()
    assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks
    assert backend.engine.num_waiting_tokens == 0
    return while_stepping


async def test_a_dead_loop_fails_its_streams_refuses_new_ones_and_says_so(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, _ = make_backend(checkpoint)
    fatal: list[Exception] = []
    backend.engine.start(on_fatal=fatal.append)
    stream = backend.engine.generate(
        backend.encode(PROMPTS[2]), SamplingParams(max_tokens=60, ignore_eos=True)
    )
    await anext(stream)

    def broken_schedule(*, admit: bool = True) -> None:
        raise RuntimeError("scheduler invariant broken")

    monkeypatch.setattr(backend.scheduler, "schedule", broken_schedule)
    with pytest.raises(Unavailable, match="stopped"):
        async for _ in stream:
            pass
    assert [str(e) for e in fatal] == ["scheduler invariant broken"]
    with pytest.raises(Unavailable, match="retry on another worker"):
        await collect(backend, PROMPTS[0], SamplingParams(max_tokens=2))
    await backend.engine.drain()


async def test_a_generate_call_closed_mid_stream_frees_its_sequence_at_once(
    checkpoint: Path,
) -> None:
    """The worker's Generate closed by its caller (gRPC closes the handler's stream when the
    client goes away): its sequence is cancelled before the close returns, not a loop turn or
    more later when the garbage collector finalizes the engine's stream (meanwhile steps could
    still run it for nobody)."""
    backend, registry = make_backend(checkpoint)
    backend.engine.start()
    servicer = WorkerServicer("cpu")
    # The servicer's model lookup only (the subject is its stream's closing).
    servicer._models = SimpleNamespace(generation_backend=lambda *_: backend)  # type: ignore[assignment]
    request = wpb.WorkerGenerateRequest(
        model_name="ref-llama",
        text=PROMPTS[2],
        sampling=tpb.SamplingParameters(max_tokens=60, ignore_eos=True),
    )
    try:
        responses = servicer.Generate(request, SimpleNamespace(time_remaining=lambda: 60.0))
        first = await anext(responses)
        assert first.token_ids
        await responses.aclose()
        # No await since: the close itself cancelled the sequence (a step in flight finishes
        # first; its blocks are free once that step is accounted).
        assert total(generate_latest(registry).decode(), names.GENERATION_CANCELLED_TOTAL) == 1
        await eventually(lambda: backend.scheduler.num_running == 0, interval_s=0.01)
        assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks
    finally:
        await backend.engine.drain()


async def test_a_generate_that_fills_the_context_stops_where_the_kv_cache_does(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A Generate without max_tokens that fills the context (an OpenAI chat completion's) on a
    worker whose KV cache holds fewer tokens than max_model_len (6 blocks of 8: 49 tokens
    against 256): it runs to the cache's end, not refused for a max_tokens its caller never
    sent (the gateway, knowing only max_model_len, cannot size it)."""
    backend, _ = make_backend(
        write_repository(tmp_path, num_kv_blocks=6, block_size=8, weights_from=checkpoint)
    )
    backend.engine.start()
    servicer = WorkerServicer("cpu")
    # The servicer's model lookup only (the subject is how it sizes the reply).
    servicer._models = SimpleNamespace(generation_backend=lambda *_: backend)  # type: ignore[assignment]
    prompt = backend.encode(PROMPTS[0])
    request = wpb.WorkerGenerateRequest(
        model_name="ref-llama",
        fingerprint=backend.fingerprint,
        token_ids=np.array(prompt, dtype="<i4").tobytes(),
        sampling=tpb.SamplingParameters(ignore_eos=True),
        fills_context=True,
    )
    try:
        context = SimpleNamespace(time_remaining=lambda: 60.0)
        messages = [m async for m in servicer.Generate(request, context)]
    finally:
        await backend.engine.drain()
    assert messages[-1].completion_tokens == 6 * 8 + 1 - len(prompt)
    assert messages[-1].finish_reason == tpb.FINISH_REASON_LENGTH


async def test_a_request_refused_while_draining_is_marked_not_started(checkpoint: Path) -> None:
    """A generation refused by a draining engine ran nothing: it carries the not-started mark,
    as the batcher's draining refusal does, so the router (and the gateway) may send it to
    another worker; unmarked, it reached the caller UNAVAILABLE once the router's retries were
    spent (review finding)."""
    backend, _ = make_backend(checkpoint)
    backend.engine.start()
    await backend.engine.drain()
    with pytest.raises(Unavailable, match="draining") as refused:
        await anext(backend.engine.generate(backend.encode(PROMPTS[0]), SamplingParams()))
    assert refused.value.is_not_started
