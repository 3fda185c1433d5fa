"""The gateway's HTTP APIs when their client goes away: the work it asked for stops, as a gRPC
caller's cancellation stops it (a real in-process fabric serving tiny-llama, called over a raw
socket that the test closes mid-request)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.common import metric_names as names
from tests.support.generation_cancel import cancel_before_the_end
from tests.support.in_process import Fabric, running_fabric
from tests.support.processes import REPO_ROOT
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"


@pytest.fixture
async def fabric(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fabric]:
    repository = tmp_path / "repo"
    repository.mkdir()
    shutil.copytree(REPO_ROOT / "models" / MODEL, repository / MODEL)
    async with running_fabric(repository, redis_server) as fabric:
        yield fabric


@pytest.mark.parametrize("path", ["/v1/completions", f"/v2/models/{MODEL}/generate"])
async def test_a_client_that_hangs_up_stops_its_generation(fabric: Fabric, path: str) -> None:
    """A non-streamed completion of 400 tokens whose client closes the connection once its
    sequence runs: the worker cancels the sequence (before, the handler, not cancelled by its
    connection's end, generated every token for nobody and held the tenant's slot)."""
    if path == "/v1/completions":
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 400}
    else:
        body = {"text_input": "hello", "parameters": {"max_tokens": 400, "ignore_eos": True}}
    payload = json.dumps(body).encode()
    http = fabric.gateway.http
    assert http is not None

    def running() -> float:
        return fabric.worker_metric(names.GENERATION_RUNNING_SEQUENCES, model=MODEL)

    def finished() -> float:
        return fabric.worker_metric(names.GENERATION_FINISHED_TOTAL, model=MODEL)

    async def start_and_cancel() -> None:
        # The previous attempt's sequence (it finished first) has left the gauge.
        await eventually(lambda: running() == 0, message="a sequence still runs")
        finished_before = finished()
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        # Running, or already finished between two looks (the helper then tries again).
        await eventually(
            lambda: running() == 1 or finished() > finished_before,
            interval_s=0.005,
            message="the sequence runs",
        )
        writer.close()
        del reader

    await cancel_before_the_end(
        start_and_cancel, lambda name: fabric.worker_metric(name, model=MODEL)
    )
    # The running gauge is exported once the engine's loop next turns (the cancel is counted
    # at once): a scrape between the two still sees the sequence.
    await eventually(lambda: running() == 0, message="the cancelled sequence still runs")
