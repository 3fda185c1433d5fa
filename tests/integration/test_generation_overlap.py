"""Where a device runs the steps, the engine streams a step's tokens while the next step runs
(`GenerationEngine._finish_step`, `StepExecutor.execute`'s `while_running`). On this CPU a
test runner signals each step's launch before computing it eagerly, as a GPU's graph replay
signals before its device computes: the engine then takes the deferred path for real, on a
real (tiny, random) Llama checked against `transformers`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from services.common import metric_names as names
from services.common.sampling import SamplingParams
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.request_stream import Delta, RequestStream
from services.gpu_worker.generation.step_graphs import StepGraphs
from services.gpu_worker.generation.step_inputs import StepItem
from tests.integration.test_generation_engine import (
    PROMPTS,
    deltas,
    make_backend,
    reference_greedy,
    stream_failing_alone,
    token_ids,
    write_repository,
)
from tests.support.metrics import total

pytestmark = pytest.mark.integration


class LaunchedFirst(StepGraphs):
    """No graphs: each step says it is launched, then runs eagerly (the runner's fallback)."""

    #: Called once, on the step's thread, before a step says it is launched.
    before_launch: Callable[[], None] | None = None
    #: Called on the step's thread before every step says it is launched.
    at_each_launch: Callable[[], None] | None = None

    def replay(self, items: Sequence[StepItem]) -> torch.Tensor | None:
        if (hook := self.before_launch) is not None:
            self.before_launch = None
            hook()
        if self.at_each_launch is not None:
            self.at_each_launch()
        self._runner.launched()
        return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("ref"))


def started_backend(checkpoint: Path, *, overlaps: bool) -> GenerationBackend:
    return started(checkpoint, overlaps=overlaps)[0]


def started(checkpoint: Path, *, overlaps: bool) -> tuple[GenerationBackend, CollectorRegistry]:
    backend, registry = make_backend(checkpoint)
    if overlaps:
        runner = backend.runner
        runner.graphs = LaunchedFirst(runner, 8, runner.max_model_len, 64)
    backend.engine.start()
    return backend, registry


class Pushes:
    """Every token pushed to a stream: (its request's params, the token, whether `backend`'s
    engine ran a step)."""

    def __init__(self) -> None:
        self.backend: GenerationBackend | None = None
        self.seen: list[tuple[SamplingParams, int, bool]] = []


@pytest.fixture
def pushes(monkeypatch: pytest.MonkeyPatch) -> Pushes:
    watched = Pushes()
    real_push_token = RequestStream.push_token

    def recording(self: RequestStream, token: int, *rest: object) -> bool:
        stepping = watched.backend is not None and watched.backend.engine._is_stepping
        watched.seen.append((self.params, token, stepping))
        return real_push_token(self, token, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(RequestStream, "push_token", recording)
    return watched


async def staggered(backend: GenerationBackend, params: list[SamplingParams]) -> list[list[Delta]]:
    """Each request joins while the ones before it decode: one continuous batch."""
    tasks = []
    for prompt, one in zip(PROMPTS, params, strict=True):
        started = asyncio.Event()
        tasks.append(asyncio.ensure_future(deltas(backend, prompt, one, started)))
        if len(tasks) < len(params):
            await started.wait()
    return list(await asyncio.gather(*tasks))


@pytest.mark.parametrize(
    ("launched_first", "during_steps"), [(True, True), (False, True), (True, False)]
)
async def test_tokens_streamed_while_the_next_step_runs_are_the_reference_tokens(
    checkpoint: Path, pushes: Pushes, launched_first: bool, during_steps: bool
) -> None:
    """Overlapping where steps say they are launched before they run, unless the engine is
    told to stream between steps (`streams_during_steps`, the benchmarks' side by side)."""
    lengths = (24, 30, 18)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    overlapping = pushes.backend = started_backend(checkpoint, overlaps=launched_first)
    overlapping.engine.streams_during_steps = during_steps
    overlaps = launched_first and during_steps
    try:
        results = await staggered(overlapping, params)
    finally:
        await overlapping.engine.drain()
    for prompt, n, got in zip(PROMPTS, lengths, results, strict=True):
        assert token_ids(got) == reference_greedy(checkpoint, overlapping.encode(prompt), n)
        last = got[-1]
        assert (last.finish_reason, last.completion_tokens) == ("length", n), prompt
        assert all(delta.finish_reason is None for delta in got[:-1])
    assert overlapping.engine.scheduler.num_free_blocks == overlapping.runner.num_blocks
    assert overlapping.engine.num_waiting_tokens == 0
    # Overlapping, the tokens went out while the next step ran, bar those of a step that
    # nothing followed; else each after its own step.
    during = sum(1 for _, _, stepping in pushes.seen if stepping)
    assert len(pushes.seen) == sum(lengths)
    assert during >= sum(lengths) - 6 if overlaps else during == 0, pushes.seen


async def test_overlapping_changes_no_token_no_end_and_no_step(checkpoint: Path) -> None:
    """Same workload on an engine streaming tokens after each step and on one streaming them
    during the next: the same deltas' tokens, text and ends, and as many tokens computed (a
    sequence ended by its length or a stop token never runs a step past it; how many steps
    they take depends on when each request joins). A request with stop strings, whose text
    may end it, streams at once on either."""
    plain = started_backend(checkpoint, overlaps=False)
    try:
        greedy = token_ids(await deltas(plain, PROMPTS[0], SamplingParams(max_tokens=20)))
        long = await deltas(plain, PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True))
        text = "".join(d.text for d in long)
    finally:
        await plain.engine.drain()
    stop_token = greedy[6]
    params = [
        SamplingParams(max_tokens=20, stop_token_ids=(stop_token,)),
        SamplingParams(max_tokens=9, ignore_eos=True),
        SamplingParams(max_tokens=20, ignore_eos=True, stop=(text[8:11],)),
    ]
    runs = {}
    for overlaps in (False, True):
        backend, registry = started(checkpoint, overlaps=overlaps)
        try:
            got = await staggered(backend, params)
            runs[overlaps] = (
                [(token_ids(g), "".join(d.text for d in g), g[-1].finish_reason) for g in got],
                total(generate_latest(registry).decode(), f"{names.GENERATION_STEP_TOKENS}_sum"),
            )
        finally:
            await backend.engine.drain()
        assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks
        assert backend.engine.num_waiting_tokens == 0
    assert backend.engine.num_waiting_tokens == 0  # every prompt's count went with it
    assert runs[True] == runs[False]
    assert runs[True][1] > 0
    (stopped, _, reason), (capped, _, capped_reason), (_, cut, cut_reason) = runs[True][0]
    assert (stopped, reason) == (greedy[: greedy.index(stop_token)], "stop")
    assert (len(capped), capped_reason) == (9, "length")
    assert (cut, cut_reason) == (text[: text.index(text[8:11])], "stop")


async def test_a_stream_failing_while_the_next_step_runs_fails_alone(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its token is streamed while a step it is part of runs: its stream ends with the error
    once, its blocks come back once that step is accounted, and the stream sharing its steps
    goes on to its end."""
    backend = started_backend(checkpoint, overlaps=True)
    assert await stream_failing_alone(backend, monkeypatch) == [True]


async def test_a_stream_closed_while_its_token_waits_gets_no_more_and_frees_its_sequence(
    checkpoint: Path, pushes: Pushes
) -> None:
    """The stream closes just before a step's launch, when the token its last step sampled
    waits to be streamed: that token is never pushed (nor counted), its sequence is freed,
    and the stream sharing its steps goes on to its end."""
    backend = pushes.backend = started_backend(checkpoint, overlaps=True)
    graphs = backend.runner.graphs
    assert isinstance(graphs, LaunchedFirst)
    loop = asyncio.get_running_loop()
    closing = SamplingParams(max_tokens=100, ignore_eos=True)
    closed_at: list[int] = []
    try:
        others = asyncio.create_task(
            deltas(backend, PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
        )
        stream = backend.engine.generate(backend.encode(PROMPTS[2]), closing)
        await anext(stream)

        async def close() -> None:
            await stream.aclose()
            closed_at.append(len(pushes.seen))

        # Queued on the loop ahead of the launch's wake-up: the stream closes first.
        graphs.before_launch = lambda: loop.call_soon_threadsafe(asyncio.ensure_future, close())
        assert len(token_ids(await others)) == 30
    finally:
        await backend.engine.drain()
    (at,) = closed_at
    assert any(params is closing for params, _, _ in pushes.seen[:at])
    assert not any(params is closing for params, _, _ in pushes.seen[at:])
    assert backend.engine.scheduler.num_free_blocks == backend.runner.num_blocks
    assert backend.engine.num_waiting_tokens == 0  # every prompt's count went with it
    assert not backend.engine.scheduler.has_unfinished()


async def test_a_prompt_leaves_the_backlog_when_its_first_token_is_sampled_not_streamed(
    checkpoint: Path,
) -> None:
    """At the second step's launch the first token is sampled and waits to be streamed: the
    prompt no longer counts in the backlog (the first-token prediction's), as it did not once
    its first token was streamed between steps."""
    backend = started_backend(checkpoint, overlaps=True)
    graphs = backend.runner.graphs
    assert isinstance(graphs, LaunchedFirst)
    engine = backend.engine
    # At each launch, on the step's thread, while the loop waits for it: the backlog and the
    # tokens waiting to be streamed.
    seen: list[tuple[int, int]] = []
    graphs.at_each_launch = lambda: seen.append((engine.num_waiting_tokens, len(engine._unsent)))
    try:
        got = await deltas(backend, PROMPTS[2], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        await engine.drain()
    assert len(token_ids(got)) == 4
    prompt = len(backend.encode(PROMPTS[2]))
    assert seen == [(prompt, 0), (0, 1), (0, 1), (0, 1)]
