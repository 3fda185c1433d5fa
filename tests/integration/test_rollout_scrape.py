"""A rollout's scrape of a worker's /metrics is tried again after a failure: one failed
scrape (a timeout through a GC pause, a reset connection, a 503) aborted the whole rollout,
near its end too (review finding). An endpoint that keeps failing still fails the scrape,
after SCRAPE_TRIES tries. A real HTTP server on loopback."""

from __future__ import annotations

import contextlib
import http.client
from collections.abc import AsyncIterator
from urllib.error import HTTPError

import pytest
from aiohttp import web

from services.common import metric_names as names
from services.rollout import health

pytestmark = pytest.mark.integration

EXPOSITION = (
    f"# TYPE {names.WORKER_REQUESTS_TOTAL} counter\n"
    f'{names.WORKER_REQUESTS_TOTAL}{{model="m",version="2",code="OK"}} 7.0\n'
)


@contextlib.asynccontextmanager
async def metrics_failing_first(failures: int) -> AsyncIterator[tuple[str, list[int]]]:
    """A /metrics answering 503 `failures` times, then the exposition; yields its URL and
    the statuses it answered."""
    answered: list[int] = []

    async def metrics(request: web.Request) -> web.Response:
        status = 503 if len(answered) < failures else 200
        answered.append(status)
        return web.Response(status=status, text=EXPOSITION if status == 200 else "busy")

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/metrics", answered
    finally:
        await runner.cleanup()


async def test_a_scrape_that_fails_once_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "RETRY_S", 0.01)
    async with metrics_failing_first(1) as (url, answered):
        snapshot = await health.scrape([url], "m")
    assert answered == [503, 200]
    assert snapshot == [{"2": {"code:OK": 7.0}}]


async def test_an_endpoint_that_keeps_failing_fails_the_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(health, "RETRY_S", 0.01)
    async with metrics_failing_first(100) as (url, answered):
        with pytest.raises(HTTPError):
            await health.scrape([url], "m")
    assert answered == [503] * health.SCRAPE_TRIES


async def test_a_response_cut_mid_body_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection dropped mid-response raises http.client's IncompleteRead, no OSError:
    it ended the rollout on its first try (review finding)."""
    monkeypatch.setattr(health, "RETRY_S", 0.01)
    fetch, tries = health._fetch, []

    def cut_once(url: str) -> str:
        tries.append(url)
        if len(tries) == 1:
            raise http.client.IncompleteRead(b"# TYPE")
        return fetch(url)

    monkeypatch.setattr(health, "_fetch", cut_once)
    async with metrics_failing_first(0) as (url, _):
        snapshot = await health.scrape([url], "m")
    assert len(tries) == 2 and snapshot == [{"2": {"code:OK": 7.0}}]
