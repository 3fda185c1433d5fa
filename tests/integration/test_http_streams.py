"""An OpenAI stream whose upstream fails after its headers went out, served by aiohttp on
loopback through the gateway's own stream writer and error middleware: the failure goes in-band
and the stream still ends as a stream (before, the middleware wrote a second, 500 response
inside the chunked body, and clients reported a broken transfer)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.gateway.http.openai_api import _stream
from services.gateway.http.openai_codec import ResponseShape
from services.gateway.metrics import GatewayMetrics
from tests.support.http_app import serving_route

pytestmark = pytest.mark.integration


async def chunks_then_a_bug() -> AsyncIterator[dict[str, Any]]:
    yield {"text_output": "Hel", "finish_reason": None}
    raise RuntimeError("upstream ended without a finish reason")


METRICS = GatewayMetrics(CollectorRegistry())


async def completions(request: web.Request) -> web.StreamResponse:
    shape = ResponseShape("cmpl-1", "m", 0, is_chat=False)
    with METRICS.observe_request("v1", "m"):  # as the OpenAI routes count their requests
        return await _stream(request, shape, chunks_then_a_bug(), include_usage=False)


async def test_a_failure_mid_stream_goes_in_band_and_the_stream_ends_whole() -> None:
    async with serving_route("/v1/completions", completions) as port:
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json={}) as answer:
            assert answer.status == 200
            body = (await answer.read()).decode()
    events = [line for line in body.split("\n\n") if line]
    assert events[0].startswith("data: ") and '"Hel"' in events[0]
    assert '"error"' in events[1]
    assert events[-1] == "data: [DONE]"
    assert "HTTP/1.1" not in body
    # Counted as what it was: a failed request (INTERNAL, a bug), not an OK one.
    counted = METRICS.registry.get_sample_value(
        names.GATEWAY_REQUESTS_TOTAL, {"api": "v1", "model": "m", "code": "INTERNAL"}
    )
    assert counted == 1
