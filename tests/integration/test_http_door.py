"""The gateway's HTTP model calls pass the process's door (services.common.door) as its gRPC
model calls do, under one limit, whose queue-delay target derives from the models' SLO: a real
in-process fabric whose worker serves the stalling model, so a call stays in flight for as long
as the test wants, and a door whose limit is one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest

from services.common import metric_names as names
from services.common.door_config import DoorConfig
from services.gateway.http import server as http_server
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from tests.support.in_process import Fabric, running_fabric
from tests.support.models import STALL, release_stall, write_stalling_model
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

MODEL = "stall"


@pytest.fixture
async def fabric(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fabric]:
    write_stalling_model(tmp_path / "repo", tmp_path / "gate")
    door = DoorConfig(initial_limit=1, min_limit=1, max_limit=1)
    try:
        async with running_fabric(
            tmp_path / "repo", redis_server, gateway_settings={"door": door}
        ) as fabric:
            yield fabric
    finally:
        release_stall(tmp_path / "gate")  # a stalled executor must not outlive the test


def infer_body(first: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                        "data": [first, 0.0, 0.0, 0.0]}]}  # fmt: skip


async def test_http_model_calls_share_the_door_and_its_limit_with_grpc(
    fabric: Fabric, tmp_path: Path
) -> None:
    """One HTTP infer in flight fills a door of one: the next HTTP model call (KServe or
    OpenAI) is refused 429 with Retry-After in its API's error body, and a gRPC ModelInfer
    RESOURCE_EXHAUSTED, all before any other stage; a call that runs no model is not the
    door's, and generation (its own admission) only sheds while the queue stands
    (`integration/test_door.py`), never at the limit. Once the stalled call is answered,
    model calls are served again."""
    door = fabric.gateway.door
    assert door is not None and fabric.gateway.http is not None
    # A quarter of the model's SLO (30 s), at most the interval: derived, not the default.
    assert door.target_s == pytest.approx(min(0.25 * 30.0, door.config.interval_s))
    base = f"http://127.0.0.1:{fabric.gateway.http.port}"
    infer_url = f"{base}/v2/models/{MODEL}/infer"
    async with aiohttp.ClientSession() as session:

        async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
            async with session.post(url, json=body) as answer:
                return answer.status, await answer.json(), answer.headers.get("Retry-After", "")

        stalled = asyncio.create_task(post(infer_url, infer_body(STALL)))
        await eventually(lambda: door.num_in_flight == 1, message="the stalled call is in flight")

        status, body, retry_after = await post(infer_url, infer_body(1.0))
        assert status == 429 and int(retry_after) >= 1, (status, body, retry_after)
        assert "calls in flight, its limit" in body["error"], body
        status, body, _ = await post(f"{base}/v1/embeddings", {"model": MODEL, "input": "hi"})
        assert status == 429 and body["error"]["type"] == "rate_limit_error", body
        status, body, _ = await post(f"{base}/", {"inputs": "hi"})  # TEI's root embeds
        assert status == 429 and body["error_type"] == "Overloaded", body

        request = kserve.ModelInferRequest(
            model_name=MODEL,
            inputs=[kserve.ModelInferRequest.InferInputTensor(name="x", datatype="FP32",
                                                              shape=[1, 4])],
            raw_input_contents=[np.ones((1, 4), np.float32).tobytes()],
        )  # fmt: skip
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value
        assert "calls in flight, its limit" in (raised.value.details() or "")

        async with session.get(f"{base}/v2/models/{MODEL}") as answer:
            assert answer.status == 200  # model metadata: not a model call
        for path in ("/v1/models/embed", "/v2/models/infer"):  # nor is a GET of a model so named
            async with session.get(f"{base}{path}") as answer:
                assert answer.status == 404, (path, await answer.text())
        # nor a POST no route runs a model for: a GET-only route's path, or none's
        for path, expected in (("/v1/models/embed", 405), ("/anything/infer", 404)):
            async with session.post(f"{base}{path}", json={}) as answer:
                assert answer.status == expected, (path, await answer.text())
        status, body, _ = await post(f"{base}/v1/completions", {"model": "nope", "prompt": "x"})
        assert status == 404, body  # generation passes a full door and meets its own checks

        assert fabric.gateway_metric(names.DOOR_REFUSED_TOTAL, method="http") == 3
        release_stall(tmp_path / "gate")
        status, body, _ = await stalled
        assert status == 200 and body["outputs"][0]["shape"] == [1, 2], body
        await eventually(lambda: door.num_in_flight == 0, message="the door was not left")
        status, body, _ = await post(infer_url, infer_body(1.0))
        assert status == 200, body


async def test_a_body_that_does_not_arrive_is_a_408_and_gives_its_place_back(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model call that sends its headers and 10 of its 1,000 bytes, then nothing: within the
    body's bound it is answered 408 and its place at the door (a limit of one) is free again,
    so the next call is served. Before, it held the place as long as its connection stayed
    open, and the door refused every other model call of the process."""
    monkeypatch.setattr(http_server, "BODY_TIMEOUT_S", 0.5)
    door = fabric.gateway.door
    assert door is not None and fabric.gateway.http is not None
    port = fabric.gateway.http.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\n"
        'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"inputs":'.encode()
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=10)
    assert status_line.startswith(b"HTTP/1.1 408"), status_line
    writer.close()
    await eventually(lambda: door.num_in_flight == 0, message="the door was not left")
    async with aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer"
        async with session.post(url, json=infer_body(1.0)) as answer:
            assert answer.status == 200, await answer.text()


async def test_a_repository_call_whose_body_does_not_arrive_is_a_408(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a model call, so past the door and quotas, but read within the same bound: a body
    that never came held the handler and its connection for as long as the client kept it
    open, any key's, before the admin check (review finding)."""
    monkeypatch.setattr(http_server, "BODY_TIMEOUT_S", 0.5)
    assert fabric.gateway.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", fabric.gateway.http.port)
    writer.write(
        b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 10\r\n\r\n{"
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=10)
    assert status_line.startswith(b"HTTP/1.1 408"), status_line
    writer.close()


async def test_bodies_held_past_the_processes_bound_are_refused_before_they_are_read(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process holds a bounded total of request bodies: 4 MiB a body times connections
    without bound passed a gateway pod's memory, bodies sent to their last byte and then held
    (review finding). With a bound of 1,500 bytes, a body of 1,000 being sent leaves no room
    for one of 600: it is refused 429 before it is read, and served once the first is gone."""
    monkeypatch.setattr(http_server, "MAX_BODIES_HELD_BYTES", 1500)
    assert fabric.gateway.http is not None
    port = fabric.gateway.http.port
    writer = await a_body_arriving(port, b"Content-Length: 1000\r\n", b"{")
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer"
    body = json.dumps(infer_body(1.0)).encode().ljust(600)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:

        async def status() -> tuple[int, str]:
            async with session.post(url, data=body, headers=headers) as answer:
                return answer.status, await answer.text()

        async def refused() -> bool:
            code, text = await status()
            return code == 429 and "request bodies" in text

        async def served() -> bool:
            return (await status())[0] == 200

        await eventually(refused, message="the held body left no room")
        writer.close()
        await eventually(served, message="served once the held body was gone")


async def test_a_body_is_counted_at_most_at_the_size_limit_and_then_at_its_own_length(
    fabric: Fabric, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body declaring more than the 4 MiB limit is counted at the limit (aiohttp answers it
    413 past it): counted as declared, one connection reserved the process's whole bound
    (diff review). A body of undeclared length (chunked) is counted at the limit while it
    arrives, then at its own length for the rest of its call, a stalled one here."""
    limit = 4 * 1024 * 1024
    monkeypatch.setattr(http_server, "MAX_BODIES_HELD_BYTES", limit + 3000)
    assert fabric.gateway.http is not None and fabric.gateway.door is not None
    door, port = fabric.gateway.door, fabric.gateway.http.port
    writer = await a_body_arriving(port, f"Content-Length: {limit + 2950}\r\n".encode(), b"{")
    base, headers = f"http://127.0.0.1:{port}", {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:

        async def infer_status(first: float, *, chunked: bool = False) -> int:
            body = json.dumps(infer_body(first)).encode()

            async def chunks() -> AsyncIterator[bytes]:
                yield body

            url = f"{base}/v2/models/{MODEL}/infer"
            data = chunks() if chunked else body
            async with session.post(url, data=data, headers=headers) as answer:
                return answer.status

        async def fits_beside(num_bytes: int) -> bool:
            url = f"{base}/v2/repository/index"
            async with session.post(url, data=b"{}".ljust(num_bytes), headers=headers) as answer:
                return answer.status != 429

        # The oversized body being sent counts the limit: a small call fits beside it.
        assert await infer_status(1.0) == 200
        writer.close()
        stalled = asyncio.create_task(infer_status(STALL, chunked=True))
        try:
            await eventually(lambda: door.num_in_flight == 1, message="the chunked call held")
            # Counted at its own length now: 3,500 bytes more fit (not at the limit's 4 MiB).
            await eventually(lambda: fits_beside(3500), message="room beside the chunked body")
        finally:
            release_stall(tmp_path / "gate")
        assert await stalled == 200


async def test_a_compressed_body_is_counted_at_the_size_limit_while_it_arrives(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp holds a gzip body decompressed, up to the 4 MiB limit: counted at its declared
    (compressed) length, 4 KB of zeros held 4 MiB, a thousand times the bound (review
    finding). While one arrives, a call of 3,500 bytes no longer fits beside it; once its
    connection closes, it does."""
    limit = 4 * 1024 * 1024
    monkeypatch.setattr(http_server, "MAX_BODIES_HELD_BYTES", limit + 3000)
    assert fabric.gateway.http is not None
    port = fabric.gateway.http.port
    gzip = b"Content-Encoding: gzip\r\nContent-Length: 100\r\n"
    writer = await a_body_arriving(port, gzip, b"\x1f\x8b")
    base, headers = f"http://127.0.0.1:{port}", {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:

        async def fits_beside(num_bytes: int) -> bool:
            url = f"{base}/v2/repository/index"
            async with session.post(url, data=b"{}".ljust(num_bytes), headers=headers) as answer:
                return answer.status != 429

        await eventually(lambda: _not(fits_beside(3500)), message="the gzip body counted")
        writer.close()
        await eventually(lambda: fits_beside(3500), message="room once its connection closed")


async def _not(fits: Awaitable[bool]) -> bool:
    return not await fits


async def test_a_rest_infer_refused_before_it_reaches_model_infer_is_counted(
    fabric: Fabric,
) -> None:
    """A REST body refused for its rows, or a model not found, was answered 400 or 404 and
    counted nowhere (gRPC's ModelInfer counts its own), so a client sending bad bodies was
    invisible (review finding). Counted once, as ModelInfer counts a call."""
    assert fabric.gateway.http is not None
    base = f"http://127.0.0.1:{fabric.gateway.http.port}"
    too_many = {"inputs": [{"name": "x", "shape": [100_000, 4], "datatype": "FP32",
                            "data": [0.0] * 4}]}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for path, body, status in ((f"/v2/models/{MODEL}/infer", too_many, 400),
                                   ("/v2/models/nope/infer", infer_body(1.0), 404)):  # fmt: skip
            async with session.post(base + path, json=body) as answer:
                assert answer.status == status, await answer.text()
    counted = {
        (model, code): fabric.gateway_metric(
            names.GATEWAY_REQUESTS_TOTAL, api="kserve_v2", model=model, code=code
        )
        for model, code in ((MODEL, "INVALID_ARGUMENT"), ("other", "NOT_FOUND"))
    }
    assert counted == {(MODEL, "INVALID_ARGUMENT"): 1, ("other", "NOT_FOUND"): 1}


async def a_body_arriving(port: int, headers: bytes, start: bytes) -> asyncio.StreamWriter:
    """A connection sending a repository call: its headers, then its body's first bytes."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + headers + b"\r\n" + start
    )  # fmt: skip
    await writer.drain()
    return writer
