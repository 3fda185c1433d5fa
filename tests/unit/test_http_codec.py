"""The HTTP APIs' pure conversions: KServe v2 JSON and binary tensors <-> KServe messages,
SSE framing, errors as HTTP answers, OpenAI bodies and chat prompts."""

from __future__ import annotations

import json
import struct
from typing import Any

import grpc
import numpy as np
import pytest

from services.common.errors import (
    ExecutionFailed,
    InvalidInput,
    MessageTooLarge,
    NotFound,
    Overloaded,
    Unauthenticated,
    UpstreamError,
)
from services.gateway.http.codec import (
    HEADER_LENGTH,
    bytes_elements,
    header_request_id,
    infer_body,
    infer_response_body,
    output_data,
    split_body,
)
from services.gateway.http.errors import HttpError, http_error
from services.gateway.http.kserve_rest import generate_request
from services.gateway.http.openai_codec import (
    DEFAULT_MAX_TOKENS,
    ResponseShape,
    chat_request,
    completion_request,
)
from services.gateway.http.sse import sse_event
from services.pb.inference import grpc_service_pb2 as kserve

pytestmark = pytest.mark.unit


def test_json_tensors_become_raw_contents_in_wire_layout() -> None:
    body = {
        "id": "r1",
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3.5, 4]]},
            {"name": "t", "datatype": "BYTES", "shape": [2], "data": ["a", "héllo"]},
        ],
        "parameters": {"priority": 1, "timeout": 5000},
    }
    parsed = infer_body("m", "2", body, b"")
    request = parsed.request
    assert (request.model_name, request.model_version, request.id) == ("m", "2", "r1")
    assert np.frombuffer(request.raw_input_contents[0], "<f4").tolist() == [1, 2, 3.5, 4]
    assert (
        request.raw_input_contents[1]
        == struct.pack("<I", 1) + b"a" + struct.pack("<I", 6) + "héllo".encode()
    )
    assert request.parameters["priority"].int64_param == 1
    assert not parsed.is_binary("anything")


def test_binary_extension_splits_inputs_by_their_sizes() -> None:
    header = {
        "inputs": [
            {"name": "a", "datatype": "INT32", "shape": [2], "parameters": {"binary_data_size": 8}},
            {"name": "b", "datatype": "INT64", "shape": [1], "parameters": {"binary_data_size": 8}},
        ],
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "y", "parameters": {"binary_data": False}}],
    }
    raw_a, raw_b = np.array([7, 8], "<i4").tobytes(), np.array([9], "<i8").tobytes()
    encoded = json.dumps(header).encode()
    parsed_json, binary = split_body(encoded + raw_a + raw_b, str(len(encoded)))
    parsed = infer_body("m", "", parsed_json, binary)
    assert list(parsed.request.raw_input_contents) == [raw_a, raw_b]
    assert [o.name for o in parsed.request.outputs] == ["y"]
    assert not parsed.is_binary("y") and parsed.is_binary("z")
    assert "binary_data_output" not in parsed.request.parameters


@pytest.mark.parametrize(
    ("body", "binary", "message"),
    [
        ({"inputs": []}, b"", "non-empty"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]}, b"", "neither"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": ["x"]}]}, b"",
         "numbers"),
        ({"inputs": [{"name": "a", "datatype": "INT64", "shape": [1], "data": [2**70]}]}, b"",
         "fit"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [-1], "data": [1]}]}, b"",
         "shape"),
        ({"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": [1]}]}, b"",
         "strings"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}]}, b"xx",
         "belong to no input"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1],
                      "parameters": {"binary_data_size": 8}}]}, b"xxxx", "runs past"),
        ({"inputs": [{"name": "a", "datatype": "U8", "shape": [1], "data": [1]}]}, b"",
         "not supported"),
        # Each of these was a 500 (a ValueError, TypeError, AttributeError or
        # UnicodeEncodeError out of the codec, logged as our bug).
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "parameters": "x"}, b"", "parameters must be a JSON object"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "parameters": [1]}, b"", "parameters must be a JSON object"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "outputs": [{"name": "y", "parameters": [1]}]}, b"", "must be a JSON object"),
        ({"inputs": [{"name": "a", "datatype": "INT32", "shape": [1], "data": [float("nan")]}]},
         b"", "integers"),
        ({"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": ["\ud800"]}]},
         b"", "lone surrogate"),
        # A 500 (a TypeError iterating it), then truncated to 1 and 0, then taken as 1 byte.
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "outputs": 5}, b"", "outputs must be a list"),
        ({"inputs": [{"name": "a", "datatype": "INT32", "shape": [2], "data": [1.9, -0.7]}]},
         b"", "must be integers"),
        ({"inputs": [{"name": "a", "datatype": "INT64", "shape": [1], "data": [2.0]}]},
         b"", "must be integers"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1],
                      "parameters": {"binary_data_size": True}}]}, b"x", "runs past"),
        # Out of the type's range: numpy 1.x wrapped it (3e9 ran as -1294967296); numpy 2,
        # which pyproject now requires, raises, and the codec refuses it.
        ({"inputs": [{"name": "a", "datatype": "INT32", "shape": [1], "data": [3_000_000_000]}]},
         b"", "does not fit INT32"),
        ({"inputs": [{"name": "a", "datatype": "INT64", "shape": [1], "data": [2**63]}]},
         b"", "does not fit INT64"),
        # A float past the type's range became infinity without a word (review finding).
        ({"inputs": [{"name": "a", "datatype": "FP16", "shape": [2], "data": [1, 70000]}]},
         b"", "does not fit FP16"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [-1e300]}]},
         b"", "does not fit FP32"),
    ],
)  # fmt: skip
def test_malformed_infer_bodies_are_invalid_input(body: dict, binary: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        infer_body("m", "", body, binary)


def test_floats_within_range_and_infinities_sent_are_kept() -> None:
    """Only a finite value that overflows its type is refused: JSON as Python reads it may
    carry `Infinity`, which the model gets as it was sent."""
    body = {"inputs": [{"name": "a", "datatype": "FP16", "shape": [3],
                        "data": [65504, float("-inf"), 1e-9]}]}  # fmt: skip
    raw = infer_body("m", "", body, b"").request.raw_input_contents[0]
    assert np.frombuffer(raw, "<f2").tolist() == [65504.0, float("-inf"), 0.0]


def test_split_body_checks_the_header_length() -> None:
    with pytest.raises(InvalidInput, match="outside"):
        split_body(b"{}", "10")
    with pytest.raises(InvalidInput, match="not JSON"):
        split_body(b"{nope", None)
    # A number past a float's range: Python read it as infinity, taken as sent (review).
    with pytest.raises(InvalidInput, match="past a float's range"):
        split_body(b'{"inputs": [{"data": [1e400]}]}', None)
    assert split_body(b'{"x": [Infinity, 1e300]}', None)[0]["x"] == [float("inf"), 1e300]
    with pytest.raises(InvalidInput, match="object"):
        split_body(b"[1]", None)


def _response() -> kserve.ModelInferResponse:
    return kserve.ModelInferResponse(
        model_name="m",
        model_version="1",
        id="r",
        outputs=[
            kserve.ModelInferResponse.InferOutputTensor(name="y", datatype="FP32", shape=[1, 2]),
            kserve.ModelInferResponse.InferOutputTensor(name="t", datatype="BYTES", shape=[1]),
        ],
        raw_output_contents=[np.array([1.5, -2], "<f4").tobytes(), bytes_elements([b"ok"])],
    )


def test_outputs_go_back_as_json_or_binary_as_asked() -> None:
    as_json = infer_body("m", "", {"inputs": [{"name": "a", "datatype": "FP32", "shape": [1],
                                               "data": [1]}]}, b"")  # fmt: skip
    body, header_length = infer_response_body(_response(), as_json)
    assert header_length is None
    outputs = json.loads(body)["outputs"]
    assert outputs[0]["data"] == [1.5, -2.0] and outputs[1]["data"] == ["ok"]
    binary_choice = infer_body(
        "m", "", {"inputs": as_json_inputs(), "parameters": {"binary_data_output": True}}, b""
    )
    body, header_length = infer_response_body(_response(), binary_choice)
    assert header_length is not None
    header = json.loads(body[:header_length])
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert sizes == [8, 6] and len(body) == header_length + 14
    assert output_data("FP32", body[header_length : header_length + 8]) == [1.5, -2.0]
    assert HEADER_LENGTH == "Inference-Header-Content-Length"


def as_json_inputs() -> list[dict]:
    return [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}]


def test_generate_body_becomes_the_decoupled_models_inputs() -> None:
    body = {"text_input": "hi", "parameters": {"max_tokens": 3, "stream": True, "priority": 2}}
    request = generate_request("llm", "", body)
    names = [t.name for t in request.inputs]
    assert names == ["text_input", "sampling_parameters", "stream", "exclude_input_in_output"]
    sampling = json.loads(request.raw_input_contents[1][4:])
    assert sampling == {"max_tokens": 3}
    assert request.raw_input_contents[2] == b"\x01" and request.raw_input_contents[3] == b"\x00"
    assert request.parameters["priority"].int64_param == 2
    with pytest.raises(InvalidInput, match="text_input"):
        generate_request("llm", "", {"parameters": {}})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text_input": "hi", "parameters": "abc"}, "parameters must be a JSON object"),
        ({"text_input": "hi", "parameters": 5}, "parameters must be a JSON object"),
        ({"text_input": "\ud800"}, "lone surrogate"),
    ],
)
def test_malformed_generate_bodies_are_invalid_input(body: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        generate_request("m", "", body)


def test_a_body_nested_too_deep_to_write_again_is_invalid_input() -> None:
    """It parsed a few frames above the recursion limit, and its options, written again as
    JSON a few frames deeper, passed it: a 500 (review finding)."""
    stop: Any = "end"
    for _ in range(5000):
        stop = [stop]
    with pytest.raises(InvalidInput, match="nests too deeply"):
        generate_request("m", "", {"text_input": "hi", "stop": stop})


def test_a_size_limit_or_a_model_failure_is_answered_as_one_not_to_send_again() -> None:
    """A message past a size limit is RESOURCE_EXHAUSTED in grpc's words, and went out as a
    429 rate_limit_error: OpenAI's client sent it twice more (after the model had run), and
    throttling clients took it for load (review finding). It is a 413 now, without a retry
    hint; it and a model raising on its input (INTERNAL, the same on every try) tell OpenAI's
    clients, which retry every 5xx, not to."""
    too_large = http_error(MessageTooLarge("message larger than max (5000000 vs. 4194304)"))
    assert too_large.status == 413 and too_large.headers == {"x-should-retry": "false"}
    upstream = UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max (9)")
    assert http_error(upstream).status == 413
    failed = http_error(ExecutionFailed("model failed on this input: boom"))
    assert failed.status == 500 and failed.headers == {"x-should-retry": "false"}
    # Load is still a 429 to send again after its hint, and UNAVAILABLE a 503 to send again.
    assert "x-should-retry" not in http_error(Overloaded("busy", retry_after_s=0.1)).headers
    assert http_error(UpstreamError(grpc.StatusCode.UNAVAILABLE, "gone")).headers == {}


def test_sse_events_are_one_data_line_each() -> None:
    assert sse_event({"a": "x\ny"}) == b'data: {"a":"x\\ny"}\n\n'


def test_errors_map_to_http_statuses_with_retry_after() -> None:
    refused = http_error(Overloaded("slow down", retry_after_s=1.2))
    # 1.2 s jittered by 25% either way (0.9-1.5 s), in HTTP's whole seconds rounded up.
    assert refused.status == 429 and refused.headers["Retry-After"] in {"1", "2"}
    assert set(refused.headers) == {"Retry-After", "retry-after-ms"}
    assert 900 <= int(refused.headers["retry-after-ms"]) <= 1500
    # The hint's jitter reaches the caller: whole seconds alone would send every caller
    # refused in one flood back together.
    hints = {
        http_error(Overloaded("x", retry_after_s=0.5)).headers["retry-after-ms"] for _ in range(50)
    }
    assert len(hints) > 5
    assert json.loads(refused.kserve_body()) == {"error": "slow down"}
    unauthenticated = http_error(Unauthenticated("no key"))
    assert unauthenticated.status == 401
    assert unauthenticated.headers == {"WWW-Authenticate": "Bearer"}
    assert http_error(NotFound("gone")).status == 404
    # Dropped further down, safe to send again: a status stock clients retry (not 499).
    assert http_error(UpstreamError(grpc.StatusCode.CANCELLED, "dropped")).status == 503
    bug = http_error(ZeroDivisionError("secret detail"))
    assert bug.status == 500 and bug.message == "internal error"
    assert json.loads(http_error(InvalidInput("bad")).openai_body())["error"]["type"] == (
        "invalid_request_error"
    )
    # Other 4xx answered by the HTTP layer itself (too large, too slow, wrong method) are the
    # request's fault too; a 5xx is the server's.
    for status, kind in ((413, "invalid_request_error"), (408, "invalid_request_error"),
                         (405, "invalid_request_error"), (503, "server_error")):  # fmt: skip
        body = json.loads(HttpError(status, "x", {}).openai_body())
        assert body["error"] == {"message": "x", "type": kind, "param": None, "code": None}
    # OpenAI's `code` is a string or null: an integer failed typed clients' decoding (review).
    for status, code in ((401, "invalid_api_key"), (404, "model_not_found"),
                         (429, "rate_limit_exceeded")):  # fmt: skip
        assert json.loads(HttpError(status, "x", {}).openai_body())["error"]["code"] == code


def test_completion_request_defaults_and_refusals() -> None:
    parsed = completion_request({"model": "m", "prompt": ["p"], "stop": ".", "seed": 3})
    assert parsed.prompt == "p" and not parsed.is_streaming
    assert parsed.sampling == {
        "max_tokens": DEFAULT_MAX_TOKENS, "stop": ".", "seed": 3, "temperature": 1.0
    }  # fmt: skip
    with pytest.raises(InvalidInput, match="tools"):
        completion_request({"model": "m", "prompt": "p", "tools": []})
    with pytest.raises(InvalidInput, match="prompt"):
        completion_request({"model": "m", "prompt": ["a", "b"]})
    chat = chat_request({"model": "m", "messages": [{"role": "user", "content": "q"}],
                         "max_completion_tokens": 4, "stream": True,
                         "stream_options": {"include_usage": True}}, None)  # fmt: skip
    assert chat.sampling["max_tokens"] == 4 and chat.is_streaming and chat.include_usage


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ({"stream": "true"}, "stream must be a boolean"),
        ({"stream": 1}, "stream must be a boolean"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage must be"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
         "text, a string"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text, a string"),
    ],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_refused_not_read_as_something_else(
    field: dict[str, Any], message: str
) -> None:
    """`"stream": "true"` was read as false and answered whole; a text part's object was
    sent to the model as its `str()` (HTTP surface review). Null stays the default."""
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], **field}
    with pytest.raises(InvalidInput, match=message):
        chat_request(body, None)
    parts = [{"role": "user", "content": [{"type": "text", "text": "q"}]}]
    accepted = chat_request({"model": "m", "messages": parts, "stream": None}, None)
    assert not accepted.is_streaming


@pytest.mark.parametrize(
    "field",
    [
        {"logprobs": 1}, {"logprobs": True}, {"top_logprobs": 3}, {"echo": True},
        # 0 == False: accepted as the default and answered without the sampled token's log
        # probability, which completions' `logprobs: 0` asks for (review finding).
        {"logprobs": 0}, {"echo": 0},
        {"logit_bias": {"50256": -100}}, {"suffix": "end"}, {"frequency_penalty": 0.5},
        {"presence_penalty": -1}, {"best_of": 3}, {"response_format": {"type": "json_object"}},
    ],
)  # fmt: skip
def test_a_field_asking_for_what_is_not_generated_is_refused(field: dict[str, Any]) -> None:
    """Before, these were accepted whatever their value and answered without what they asked
    (no log probabilities, no echoed prompt, text where JSON was asked for)."""
    with pytest.raises(InvalidInput, match=next(iter(field))):
        completion_request({"model": "m", "prompt": "p", **field})


@pytest.mark.parametrize("n", [2, 0, True, "1"])
def test_more_than_one_choice_is_refused_and_true_is_not_one(n: Any) -> None:
    """`true == 1` in Python: `"n": true` was taken as one choice (review finding)."""
    with pytest.raises(InvalidInput, match="n must be 1"):
        completion_request({"model": "m", "prompt": "p", "n": n})
    assert completion_request({"model": "m", "prompt": "p", "n": 1}).sampling


def test_fields_at_their_defaults_or_null_are_accepted() -> None:
    defaults = {
        "logprobs": None, "top_logprobs": 0, "echo": False, "logit_bias": {}, "suffix": None,
        "frequency_penalty": 0, "presence_penalty": 0.0, "best_of": 1,
        "response_format": {"type": "text"}, "user": "u-1", "n": None,
        # What newer OpenAI SDKs send in place of `user`, and a billing tier: refused 400
        # before (review finding).
        "safety_identifier": "u-1", "prompt_cache_key": "k", "service_tier": "auto",
    }  # fmt: skip
    parsed = completion_request({"model": "m", "prompt": "p", **defaults})
    assert parsed.sampling == {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": 1.0}
    chat = chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "q"}], "logprobs": False}, None
    )
    assert chat.prompt.endswith("assistant:")


def test_response_shapes_follow_openai() -> None:
    shape = ResponseShape("chatcmpl-1", "m", 7, is_chat=True)
    first = shape.chunk("", None, is_first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert shape.chunk("", "stop")["choices"][0]["delta"] == {}
    whole = shape.whole("hi", "length", 3, 2)
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    text = ResponseShape("cmpl-1", "m", 7, is_chat=False)
    assert text.usage_chunk(1, 1)["choices"] == []


def test_a_body_without_temperature_samples_at_openais_default() -> None:
    # Before, greedy (the internal default, 0): every call without one gave the same text.
    messages = [{"role": "user", "content": "q"}]
    assert chat_request({"model": "m", "messages": messages}, None).sampling["temperature"] == 1
    assert completion_request({"model": "m", "prompt": "p"}).sampling["temperature"] == 1
    greedy = completion_request({"model": "m", "prompt": "p", "temperature": 0})
    assert greedy.sampling["temperature"] == 0


def test_a_temperature_too_small_to_sample_at_is_greedy_not_refused() -> None:
    """OpenAI takes any temperature in [0, 2]; one under the sampler's least (0.01), which
    divides logits past floats, was refused INVALID_ARGUMENT to a stock client (review
    finding). It means greedy, as vLLM reads it; the least itself still samples."""
    for tiny in (0.001, 1e-9):
        body = {"model": "m", "prompt": "p", "temperature": tiny}
        assert completion_request(body).sampling["temperature"] == 0.0
    body = {"model": "m", "prompt": "p", "temperature": 0.01}
    assert completion_request(body).sampling["temperature"] == 0.01


def test_a_chat_body_without_max_tokens_leaves_it_to_the_context() -> None:
    messages = [{"role": "user", "content": "q"}]
    assert "max_tokens" not in chat_request({"model": "m", "messages": messages}, None).sampling
    limited = chat_request({"model": "m", "messages": messages, "max_completion_tokens": 9}, None)
    assert limited.sampling["max_tokens"] == 9
    # A completion keeps OpenAI's default of 16.
    completion = completion_request({"model": "m", "prompt": "p"})
    assert completion.sampling["max_tokens"] == DEFAULT_MAX_TOKENS


def test_a_generate_bodys_other_fields_are_its_models_parameters() -> None:
    """As Triton maps them to the model's inputs (TensorRT-LLM's example sends max_tokens at
    the top level): never dropped without a word; given twice, or unknown, refused."""
    request = generate_request("llm", "", {"text_input": "hi", "max_tokens": 20, "seed": 3})
    sampling = json.loads(request.raw_input_contents[1][4:])
    assert sampling == {"max_tokens": 20, "seed": 3}
    twice = {"text_input": "hi", "max_tokens": 2, "parameters": {"max_tokens": 3}}
    with pytest.raises(InvalidInput, match="max_tokens is given both"):
        generate_request("llm", "", twice)
    flags = generate_request("llm", "", {"text_input": "hi", "exclude_input_in_output": True})
    assert [i.name for i in flags.inputs][-1] == "exclude_input_in_output"
    assert flags.raw_input_contents[-1] == b"\x01"


def test_openai_sampling_edges_are_read_as_openai_means_them() -> None:
    """`top_p: 0` (OpenAI: keep only the likeliest token) and a negative `seed` (OpenAI's is
    any int64) were refused 400, naming sampling_parameters, which the caller never sent
    (review finding). They are greedy, and the seed folded into the wire's unsigned 64 bits:
    the same seed gives the same folded seed, so the same tokens."""
    sampling = completion_request({"model": "m", "prompt": "p", "top_p": 0}).sampling
    assert sampling["temperature"] == 0.0 and "top_p" not in sampling
    sampling = completion_request({"model": "m", "prompt": "p", "top_p": 0.5}).sampling
    assert sampling["top_p"] == 0.5 and sampling["temperature"] == 1
    assert completion_request({"model": "m", "prompt": "p", "seed": -1}).sampling["seed"] == (
        2**64 - 1
    )
    assert completion_request({"model": "m", "prompt": "p", "seed": 7}).sampling["seed"] == 7


def test_a_callers_request_id_header_is_taken_only_when_short_printable_ascii() -> None:
    """The OpenAI and embeddings routes call with the caller's X-Request-Id (before, none:
    the id the answer echoed never reached the call, its logs or its sticky version)."""
    assert header_request_id({"X-Request-Id": "req-42"}) == "req-42"
    assert header_request_id({}) == ""
    assert header_request_id({"X-Request-Id": "x" * 257}) == ""
    assert header_request_id({"X-Request-Id": "x" * 256}) == "x" * 256
    assert header_request_id({"X-Request-Id": "caf\u00e9"}) == ""
    assert header_request_id({"X-Request-Id": "a\nb"}) == ""
