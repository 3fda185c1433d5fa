"""How a generation request's scalar inputs are read (services.gateway.kserve_generate
.generate_one): `stream` and `exclude_input_in_output` as one BOOL element each, and
`sampling_parameters`' `top_k` as vLLM's and Triton's vLLM backend's clients send it.

The predictor is a stand-in that records the GenerateCall it is given and answers it with one
final message: what is tested is the request's translation, not a worker's generation."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator

import pytest

from services.common.errors import InvalidInput
from services.gateway.auth import LOCAL_PRINCIPAL
from services.gateway.http.kserve_rest import generate_request
from services.gateway.kserve_generate import generate_one
from services.gateway.predictor import GenerateCall
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference.v1 import types_pb2 as api

pytestmark = pytest.mark.unit


class _Recording:
    """A predictor that records each call and answers it "!" as its final message."""

    def __init__(self) -> None:
        self.calls: list[GenerateCall] = []

    async def generate(self, call: GenerateCall) -> AsyncIterator[api.GenerateResponse]:
        self.calls.append(call)
        assert call.on_version is not None
        call.on_version("3")  # as the predictor tells the version it resolved
        yield api.GenerateResponse(
            text="!", finish_reason=api.FINISH_REASON_LENGTH, prompt_tokens=1, completion_tokens=1
        )


async def texts(request: kserve.ModelInferRequest, predictor: _Recording | None = None) -> str:
    """The request's answers' texts, joined."""
    got = generate_one(predictor or _Recording(), request, LOCAL_PRINCIPAL, 10.0)  # type: ignore[arg-type]
    answers = [response.infer_response async for response in got]
    return "".join(a.raw_output_contents[0][4:].decode() for a in answers)


def with_flag(
    raw: bytes | None = None, contents: list[bool] | None = None
) -> kserve.ModelInferRequest:
    """A request for "hi" whose `stream` input is `raw` (raw_input_contents) or `contents`."""
    request = kserve.ModelInferRequest(model_name="llm", id="r")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    flag = request.inputs.add(name="stream", datatype="BOOL", shape=[1])
    if raw is not None:
        request.raw_input_contents.extend([struct.pack("<I", 2) + b"hi", raw])
    else:
        request.inputs[0].contents.bytes_contents.append(b"hi")
        flag.contents.bool_contents.extend(contents or [])
    return request


@pytest.mark.parametrize(
    ("raw", "contents", "streamed"),
    [(b"\x01", None, True), (b"\x00", None, False), (None, [True], True), (None, [False], False)],
)
async def test_a_bool_input_of_one_element_is_read(
    raw: bytes | None, contents: list[bool] | None, streamed: bool
) -> None:
    # Not streamed, the answer carries the prompt before the text (exclude_input_in_output).
    assert await texts(with_flag(raw, contents)) == ("!" if streamed else "hi!")


@pytest.mark.parametrize(
    ("raw", "contents"), [(b"", None), (b"\x00\x00", None), (None, []), (None, [True, False])]
)
async def test_a_bool_input_of_another_size_is_refused(
    raw: bytes | None, contents: list[bool] | None
) -> None:
    """An empty raw element was read as false and two bytes as true, so a malformed flag
    chose streaming or not without a word (review finding)."""
    with pytest.raises(InvalidInput, match="stream"):
        await texts(with_flag(raw, contents))


@pytest.mark.parametrize("top_k", [-1, "-1", 0])
async def test_top_k_minus_one_asks_for_every_token(top_k: int | str) -> None:
    """vLLM's clients (and Triton's vLLM backend's) send -1 for "every token": it was refused
    as out of the wire's unsigned range."""
    predictor = _Recording()
    request = generate_request("llm", "", {"text_input": "hi", "parameters": {"top_k": top_k}})
    await texts(request, predictor)
    assert [call.sampling.top_k for call in predictor.calls] == [0]


@pytest.mark.parametrize("top_k", [-2, "-2", -(2**40)])
async def test_another_negative_top_k_is_refused_by_name(top_k: int | str) -> None:
    request = generate_request("llm", "", {"text_input": "hi", "parameters": {"top_k": top_k}})
    with pytest.raises(InvalidInput, match="top_k"):
        await texts(request)


@pytest.mark.parametrize("key", ["seed", "max_tokens"])
async def test_a_negative_count_as_text_is_refused_by_name(key: str) -> None:
    """Only top_k's "-1" is read as a negative number: "-5" for a seed is no count."""
    request = generate_request("llm", "", {"text_input": "hi", "parameters": {key: "-5"}})
    with pytest.raises(InvalidInput, match=key):
        await texts(request)


@pytest.mark.parametrize("asked", ["", "stable", "3"])
async def test_answers_name_the_version_that_served_not_the_one_asked(asked: str) -> None:
    """As ModelInfer's answers do: a canary's callers asking for no version, or a label, could
    not tell which version answered (review finding)."""
    request = with_flag(contents=[True])
    request.model_version = asked
    got = generate_one(_Recording(), request, LOCAL_PRINCIPAL, 10.0)  # type: ignore[arg-type]
    versions = [response.infer_response.model_version async for response in got]
    assert versions == ["3"]
