"""A generation engine past its capacity, with callers that allow minutes (as HTTP clients do):
once its waiting queue stands, new online requests are refused at once with a retry hint, and
queued ones that waited past the SLO are dropped unrun, while `batch` ones queue; everything
else admitted is served whole, and once the flood is over a new online request is served
(generation.standing_shedding)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from services.common import metric_names as names
from services.common.errors import Overloaded
from services.common.priority import PriorityClass
from services.common.sampling import SamplingParams
from services.gpu_worker.generation.engine import GenerationEngine
from tests.integration.test_generation_engine import PROMPTS, make_backend, write_repository
from tests.support.metrics import total

pytestmark = pytest.mark.integration

#: The model's SLO: the queue stands once its oldest online sequence has waited above 30 ms
#: for 300 ms, and stays so 1.2 s past the last such wait or refusal.
SLO_MS = 300
NUM_TOKENS = 64


async def tokens_of(
    engine: GenerationEngine,
    prompt: list[int],
    params: SamplingParams,
    refusals: list[Overloaded],
    **options: Any,
) -> int | None:
    """The tokens one request (`options`: its priority, tenant) got, or None when it was
    refused or dropped (its Overloaded appended to `refusals`). No first-token limit: a caller
    that allows minutes."""
    got = 0
    try:
        async for delta in engine.generate(prompt, params, **options):
            got += len(delta.token_ids)
    except Overloaded as refused:
        refusals.append(refused)
        return None
    return got


async def test_a_standing_queue_refuses_and_drops_online_requests_and_serves_the_rest_whole(
    tmp_path: Path,
) -> None:
    # Two sequences at once: a request every 5 ms asks for several times what the engine serves.
    backend, registry = make_backend(write_repository(tmp_path, max_num_seqs=2, slo_p99_ms=SLO_MS))
    engine = backend.engine
    prompt = backend.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    refusals: list[Overloaded] = []

    def one(priority: PriorityClass) -> Coroutine[Any, Any, int | None]:
        return tokens_of(engine, prompt, params, refusals, priority=priority.rank)

    engine.start()
    standing = 0.0
    try:
        flood: list[asyncio.Task[int | None]] = []
        for i in range(300):
            priority = PriorityClass.BATCH if i % 10 == 0 else PriorityClass.INTERACTIVE
            flood.append(asyncio.ensure_future(one(priority)))
            await asyncio.sleep(0.005)
            if i >= 100 and i % 10 == 0 and not standing:  # until the queue shows standing
                standing = total(
                    generate_latest(registry).decode(), names.GENERATION_QUEUE_STANDING
                )
        got = await asyncio.wait_for(asyncio.gather(*flood), 300)
        # The flood is over and served: the next online request is admitted (the queue drained,
        # whether or not its standing is still held).
        after = await asyncio.wait_for(one(PriorityClass.INTERACTIVE), 60)
    finally:
        await engine.drain()

    batch, interactive = got[::10], [g for i, g in enumerate(got) if i % 10]
    assert batch == [NUM_TOKENS] * 30  # `batch` requests queue: every one served whole
    refused = interactive.count(None)
    assert 0 < refused < len(interactive)
    # Nothing admitted is lost or cut short.
    assert {g for g in interactive if g is not None} == {NUM_TOKENS}
    assert after == NUM_TOKENS
    for refusal in refusals:
        assert "waiting queue stands" in str(refusal)
        assert refusal.retry_after_s > 0.1 * SLO_MS / 1000  # above the target, as it waited
    # Both kinds: new requests refused at once, and queued ones dropped unrun once they had
    # waited past the SLO (admitted before the queue stood).
    assert {"dropped unrun" in str(refusal) for refusal in refusals} == {True, False}
    dropped = sum("dropped unrun" in str(refusal) for refusal in refusals)
    metrics = generate_latest(registry).decode()
    assert total(metrics, names.GENERATION_REJECTED_TOTAL) == refused - dropped
    assert total(metrics, names.GENERATION_DROPPED_TOTAL) == dropped
    assert standing == 1
    assert total(metrics, names.GENERATION_QUEUE_STANDING) == 0  # nothing waits any more


async def test_a_tenant_within_its_share_is_served_beside_another_tenants_flood(
    tmp_path: Path,
) -> None:
    """The standing queue refuses a tenant by what it would wait behind: its own backlog, and
    the flood's first sequence only (the scheduler admits the tenant with the least compute
    first, and the flood's runs charge it past the quiet one), which the next admission takes
    anyway: nothing to count. The SLO is 2 s (target 200 ms), so the flood lasts 3 s: its
    queue stands after 2. The quiet tenant sends one request at a time, one every 250 ms or
    more (within its share: no backlog of its own, which a busy machine's slow steps gave it
    when it sent on a schedule)."""
    backend, registry = make_backend(write_repository(tmp_path, max_num_seqs=2, slo_p99_ms=2000))
    engine = backend.engine
    prompt = backend.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    refusals: list[Overloaded] = []

    def one(tenant: str) -> Coroutine[Any, Any, int | None]:
        return tokens_of(engine, prompt, params, refusals, tenant=tenant)

    flooding = True
    #: Whether the flood's queue stood as each quiet request was sent.
    stood: list[bool] = []

    async def quietly() -> list[int | None]:
        served = []
        await asyncio.sleep(0.05)
        while flooding:
            gauge = total(generate_latest(registry).decode(), names.GENERATION_QUEUE_STANDING)
            stood.append(gauge == 1)
            served.append(await one("quiet"))
            await asyncio.sleep(0.25)
        return served

    engine.start()
    try:
        flood: list[asyncio.Task[int | None]] = []
        quiet = asyncio.ensure_future(quietly())
        try:
            for _ in range(600):  # a request every 5 ms for 3 s
                flood.append(asyncio.ensure_future(one("flood")))
                await asyncio.sleep(0.005)
        finally:
            flooding = False
        flooded = await asyncio.wait_for(asyncio.gather(*flood), 300)
        served_quietly = await asyncio.wait_for(quiet, 300)
    finally:
        await engine.drain()

    # The quiet tenant: every request served whole, some sent while the flood's queue stood.
    assert len(served_quietly) >= 3 and served_quietly == [32] * len(served_quietly)
    assert any(stood), stood
    assert flooded.count(None) > 0  # the flood's queue stood: part of it was turned away
    assert len(refusals) == flooded.count(None)


def test_the_standing_gauge_keeps_no_backend_alive(tmp_path: Path) -> None:
    """The gauge's function must not hold the backend: an unloaded version's tensors are freed
    only once nothing references it (hot_swap.unload releases device memory then)."""
    backend, registry = make_backend(write_repository(tmp_path, max_num_seqs=2, slo_p99_ms=SLO_MS))
    alive = weakref.ref(backend)
    del backend
    gc.collect()

    assert alive() is None
    # The gauge still reads (the scheduler it holds): 0, nothing waits.
    assert total(generate_latest(registry).decode(), names.GENERATION_QUEUE_STANDING) == 0
