"""generate_one's translation of a worker's generation stream (services.gateway
.kserve_generate): a stream that ends with no final message is an error, not an empty answer.

The predictor here is a stand-in that yields what a worker's stream would: no real worker has
been seen to end a stream OK without its final message, so no real part produces the case."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.errors import ExecutionFailed
from services.gateway.auth import LOCAL_PRINCIPAL
from services.gateway.http.kserve_rest import generate_request
from services.gateway.kserve_generate import generate_one
from services.gateway.predictor import GenerateCall
from services.pb.inference.v1 import types_pb2 as api

pytestmark = pytest.mark.unit


class _Stream:
    """A predictor whose generation yields `messages`, then ends OK."""

    def __init__(self, *messages: api.GenerateResponse) -> None:
        self._messages = messages

    async def generate(self, call: GenerateCall) -> AsyncIterator[api.GenerateResponse]:
        assert call.on_version is not None
        call.on_version("1")  # as the predictor tells the version it resolved
        for message in self._messages:
            yield message


async def answers(predictor: _Stream, *, stream: bool) -> list[str]:
    request = generate_request("llm", "", {"text_input": "hi", "parameters": {"stream": stream}})
    got = generate_one(predictor, request, LOCAL_PRINCIPAL, 10.0)  # type: ignore[arg-type]
    return [response.infer_response.id async for response in got]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_generation_that_ends_without_its_final_message_fails(stream: bool) -> None:
    """It was a 200 of nothing (`{}`) on KServe's /generate, and a bug's 500 on OpenAI's
    routes (review finding)."""
    with pytest.raises(ExecutionFailed, match="without its final response"):
        await answers(_Stream(api.GenerateResponse(text="partial")), stream=stream)
    finished = api.GenerateResponse(text=".", finish_reason=api.FINISH_REASON_LENGTH)
    assert len(await answers(_Stream(finished), stream=stream)) == 1
