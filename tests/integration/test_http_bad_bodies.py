"""Bodies a client got wrong, through the gateway's HTTP middleware on loopback: a 400 that
names what is wrong, never a 500 with a logged traceback (which a client could also use to
fill the logs)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from services.gateway.http.codec import infer_body
from services.gateway.http.kserve_rest import generate_request
from tests.support.http_app import serving_route

pytestmark = pytest.mark.integration

INFER = "/v2/models/m/infer"
GENERATE = "/v2/models/m/generate"


async def infer(request: web.Request) -> web.Response:
    infer_body("m", "", await request.json(), b"")
    return web.json_response({})


async def generate(request: web.Request) -> web.Response:
    generate_request("m", "", await request.json())
    return web.json_response({})


async def posted(path: str, handler: web.Handler, body: str) -> tuple[int, str]:
    """The status and error of `body` posted as JSON to `path` served by `handler` alone."""
    async with (
        serving_route(path, handler) as port,
        aiohttp.ClientSession() as session,
        session.post(
            f"http://127.0.0.1:{port}{path}",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        ) as answer,
    ):
        return answer.status, (await answer.json()).get("error", "")


@pytest.mark.parametrize(
    ("path", "handler", "body"),
    [
        # A lone surrogate is valid JSON, but no UTF-8 string (nor protobuf field) holds it.
        (INFER, infer, '{"id": "\\ud800", "inputs": [{"name": "text", "datatype": "BYTES", '
         '"shape": [1], "data": ["hi"]}]}'),
        (INFER, infer, '{"inputs": [{"name": "\\ud800", "datatype": "BYTES", "shape": [1], '
         '"data": ["hi"]}]}'),
        (GENERATE, generate, '{"text_input": "hi", "id": "\\udfff"}'),
        (GENERATE, generate, '{"text_input": "hi", "parameters": {"timeout": "\\ud800"}}'),
    ],
)  # fmt: skip
async def test_a_lone_surrogate_in_any_string_is_a_bad_request(
    path: str, handler: web.Handler, body: str
) -> None:
    status, error = await posted(path, handler, body)
    assert status == 400 and "surrogate" in error, error


async def test_a_body_its_content_encoding_does_not_decode_is_a_bad_request() -> None:
    async with (
        serving_route(INFER, infer) as port,
        aiohttp.ClientSession(auto_decompress=False) as session,
        session.post(
            f"http://127.0.0.1:{port}{INFER}",
            data=b'{"inputs": []}',  # not gzip
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        ) as answer,
    ):
        assert answer.status == 400, await answer.text()
        assert "could not be read" in (await answer.json())["error"]


@pytest.mark.parametrize("request_id", ["null", "7", '{"a": 1}'])
@pytest.mark.parametrize("path", [INFER, GENERATE])
async def test_an_id_that_is_no_string_is_a_bad_request_on_both_paths(
    path: str, request_id: str
) -> None:
    """`/infer` refused it; `/generate` wrote it as Python does (`null` answered as id
    "None")."""
    handler = infer if path == INFER else generate
    body = (
        f'{{"id": {request_id}, "inputs": [{{"name": "text", "datatype": "BYTES", '
        f'"shape": [1], "data": ["hi"]}}]}}'
        if path == INFER
        else f'{{"text_input": "hi", "id": {request_id}}}'
    )
    assert await posted(path, handler, body) == (400, "id must be a string")
