"""Generation over the Open Inference Protocol's `ModelStreamInfer`, called the way Triton's LLM
backends are: a decoupled model with inputs `text_input` (BYTES), `stream` (BOOL),
`sampling_parameters` (BYTES, JSON such as {"max_tokens": 16, "temperature": 0}) and
`exclude_input_in_output` (BOOL); output `text_output` (BYTES). Every response carries the
`triton_final_response` parameter; the final one also carries finish_reason and token counts.
Each response echoes its request's id. The stream itself, whose requests run concurrently, is
served by services.gateway.kserve_infer.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import AsyncGenerator
from typing import Any

from services.common.errors import ExecutionFailed, InvalidInput
from services.common.pb_conversions import finish_reason_from_pb
from services.common.templated_text import TemplatedText
from services.gateway.auth import Principal
from services.gateway.http.codec import (
    MAX_REQUEST_ID_CHARS,
    NO_CLASSIFICATION,
    check_tensor_count,
    is_json_int,
)
from services.gateway.predictor import GenerateCall, Predictor
from services.gateway.triton_info import GENERATION_OPTIONAL_INPUTS, request_parameters
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference.v1 import worker_pb2 as pb

_SAMPLING_KEYS = {
    "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos",
}  # fmt: skip


#: Largest `sampling_parameters` JSON accepted (a handful of numbers and stop strings).
MAX_SAMPLING_JSON_BYTES = 16 * 1024


def check_request_id(request_id: str) -> None:
    """Refuses a caller's request id past MAX_REQUEST_ID_CHARS (it is copied into every
    response, the slice sent downstream and the logs)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidInput(
            f"request id of {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}"
        )


def check_inputs(request: kserve.ModelInferRequest) -> None:
    """At most MAX_TENSORS inputs and outputs, one tensor per name, and its data in exactly one
    place: `raw_input_contents` (one entry per input) or each tensor's `contents`, never
    both; no output asks for classification."""
    check_request_id(request.id)
    inputs, outputs = request.inputs, request.outputs  # each read of a field builds a wrapper
    check_tensor_count(len(inputs), "inputs")
    check_tensor_count(len(outputs), "outputs")
    if outputs and any("classification" in o.parameters for o in outputs):
        raise InvalidInput(NO_CLASSIFICATION)
    if len(inputs) > 1:  # a set, not a Counter: this runs for every request
        names = [tensor.name for tensor in inputs]
        if len(set(names)) != len(names):
            duplicates = sorted({name for name in names if names.count(name) > 1})
            raise InvalidInput(f"input(s) {duplicates} given more than once")
    raw = request.raw_input_contents
    if not raw:
        return
    if len(raw) != len(inputs):
        raise InvalidInput(
            f"{len(raw)} raw_input_contents for {len(inputs)} inputs; give one per input"
        )
    if any(tensor.HasField("contents") for tensor in inputs):
        raise InvalidInput("raw_input_contents and contents are exclusive; use one")


#: What a generation request may carry: its inputs (the module's), its one output and the
#: request parameters read; anything else is refused by name, not dropped without a word (a
#: `max_tokens` tensor, a misspelt input or a `temperature` parameter ran with the defaults:
#: review finding). tritonclient's streams send `triton_enable_empty_final_response` when
#: asked: taken, the last response always says it is the last (`triton_final_response`).
GENERATE_INPUTS = ("text_input", *(spec.name for spec in GENERATION_OPTIONAL_INPUTS))
GENERATE_OUTPUT = "text_output"
GENERATE_PARAMETERS = ("priority", "timeout", "triton_enable_empty_final_response")


def check_generate_fields(request: kserve.ModelInferRequest) -> None:
    """INVALID_ARGUMENT naming an input, output or request parameter a generation model does
    not take (GENERATE_INPUTS, GENERATE_OUTPUT, GENERATE_PARAMETERS)."""
    taking = (
        ("input", [t.name for t in request.inputs], GENERATE_INPUTS),
        ("output", [o.name for o in request.outputs], (GENERATE_OUTPUT,)),
        ("parameter", list(request.parameters), GENERATE_PARAMETERS),
    )
    for kind, names, known in taking:
        unknown = sorted(name[:64] for name in names if name not in known)
        if unknown:
            raise InvalidInput(
                f"{kind}(s) {unknown[:8]} not taken by a generation model: its {kind}s are "
                f"{list(known)}; sampling settings (max_tokens, temperature, ...) go in "
                "sampling_parameters, a JSON object"
            )


def _input(
    request: kserve.ModelInferRequest, name: str
) -> tuple[int, kserve.ModelInferRequest.InferInputTensor] | None:
    for index, tensor in enumerate(request.inputs):
        if tensor.name == name:
            return index, tensor
    return None


def _scalar_bytes(request: kserve.ModelInferRequest, name: str) -> bytes | None:
    found = _input(request, name)
    if found is None:
        return None
    index, tensor = found
    # Each dimension 1, not a product of 1: a product of a huge shape is slow to compute.
    if tensor.datatype != "BYTES" or any(d != 1 for d in tensor.shape):
        raise InvalidInput(f"input {name} must be BYTES with one element")
    if request.raw_input_contents:
        raw = request.raw_input_contents[index]
        if len(raw) < 4 or struct.unpack_from("<I", raw)[0] != len(raw) - 4:
            raise InvalidInput(f"input {name}: malformed BYTES element")
        return raw[4:]
    if len(tensor.contents.bytes_contents) != 1:
        raise InvalidInput(f"input {name} must hold one element")
    return tensor.contents.bytes_contents[0]


def _scalar_bool(request: kserve.ModelInferRequest, name: str) -> bool:
    found = _input(request, name)
    if found is None:
        return False
    index, tensor = found
    if tensor.datatype != "BOOL" or any(d != 1 for d in tensor.shape):
        raise InvalidInput(f"input {name} must be BOOL with one element")
    # One element: one byte raw, one value in contents (an empty one read as false and two
    # bytes as true, a malformed flag chose streaming or not without a word).
    if request.raw_input_contents:
        raw = request.raw_input_contents[index]
        if len(raw) != 1:
            raise InvalidInput(f"input {name}: a BOOL element is one byte, got {len(raw)}")
        return raw != b"\x00"
    if len(tensor.contents.bool_contents) != 1:
        raise InvalidInput(f"input {name} must hold one element")
    return tensor.contents.bool_contents[0]


def _sampling(raw: bytes | None) -> pb.SamplingParameters:
    if not raw:
        return pb.SamplingParameters()
    if len(raw) > MAX_SAMPLING_JSON_BYTES:
        raise InvalidInput(
            f"sampling_parameters is {len(raw)} bytes; at most {MAX_SAMPLING_JSON_BYTES}"
        )
    try:
        options = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise InvalidInput(f"sampling_parameters is not JSON: {error}") from error
    if not isinstance(options, dict):
        raise InvalidInput("sampling_parameters must be a JSON object")
    unknown = sorted(set(options) - _SAMPLING_KEYS)
    if unknown:
        raise InvalidInput(
            f"unknown sampling_parameters {unknown}; known: {sorted(_SAMPLING_KEYS)}"
        )
    options = _typed(options)
    # The wire's zero means "the default": an explicit 0 is refused, not read as that.
    for key in ("max_tokens", "top_p"):
        if key in options and options[key] <= 0:
            raise InvalidInput(f"sampling_parameters: {key} must be > 0, got {options[key]}")
    # vLLM's -1 (its clients', and Triton's vLLM backend's) for every token is the wire's 0.
    if options.get("top_k") == -1:
        options["top_k"] = 0
    elif options.get("top_k", 0) < 0:
        raise InvalidInput(
            f"sampling_parameters: top_k must be >= 1, or -1 or 0 for every token, got "
            f"{options['top_k']}"
        )
    stop = options.get("stop", [])
    try:
        return pb.SamplingParameters(
            max_tokens=options.get("max_tokens", 0),
            temperature=float(options.get("temperature", 0.0)),
            top_k=options.get("top_k", 0),
            top_p=float(options.get("top_p", 0.0)),
            seed=options.get("seed"),
            stop=[stop] if isinstance(stop, str) else stop,
            stop_token_ids=options.get("stop_token_ids", []),
            ignore_eos=options.get("ignore_eos", False),
        )
    # Negative into unsigned, inf or 1e999 into an int.
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidInput(f"sampling_parameters: {error}") from error


def _typed(options: dict[str, Any]) -> dict[str, Any]:
    """Each sampling parameter at its type. A number may come as a JSON number or as a string
    of one (Triton's vLLM backend's clients send `"0.1"`), and `ignore_eos` as `"true"` or
    `"false"`; nothing else is converted: `2.7`, `"2.7"` or `true` for a count are refused, as
    a mapping for the stop strings."""
    typed: dict[str, Any] = {}
    for key, value in options.items():
        if key in ("max_tokens", "top_k", "seed"):
            # Twenty digits hold any count; int() refuses 4,301 (ValueError).
            # And top_k's "-1" (vLLM's every token); a negative seed or max_tokens as text is
            # refused as not a count, by name.
            sign = "-" if key == "top_k" else ""
            digits = value.removeprefix(sign) if isinstance(value, str) else ""
            if digits.isascii() and digits.isdigit() and len(digits) <= 20:
                value = int(value)
            valid = is_json_int(value)
        elif key in ("temperature", "top_p"):
            if isinstance(value, str):
                value = _float_text(value)
            valid = isinstance(value, int | float) and not isinstance(value, bool)
        elif key == "ignore_eos":
            value = (
                {"true": True, "false": False}.get(value, value)
                if isinstance(value, str)
                else value
            )
            valid = isinstance(value, bool)
        elif key == "stop":
            valid = isinstance(value, str) or (
                isinstance(value, list) and all(isinstance(v, str) for v in value)
            )
        else:  # stop_token_ids
            valid = isinstance(value, list) and all(is_json_int(v) for v in value)
        if not valid:
            raise InvalidInput(f"sampling_parameters: {key} has the wrong type: {value!r}")
        typed[key] = value
    return typed


def _float_text(text: str) -> float | str:
    """The number a string spells (finite), or the string itself (refused by the caller)."""
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def _response(
    request: kserve.ModelInferRequest,
    version: str,
    text: str,
    *,
    is_final: bool,
    **extra: str | int,
) -> kserve.ModelStreamInferResponse:
    encoded = text.encode()
    parameters = {"triton_final_response": kserve.InferParameter(bool_param=is_final)}
    for key, value in extra.items():
        parameters[key] = (
            kserve.InferParameter(string_param=value)
            if isinstance(value, str)
            else kserve.InferParameter(int64_param=value)
        )
    return kserve.ModelStreamInferResponse(
        infer_response=kserve.ModelInferResponse(
            model_name=request.model_name,
            model_version=version,
            id=request.id,
            parameters=parameters,
            outputs=[
                kserve.ModelInferResponse.InferOutputTensor(
                    name="text_output", datatype="BYTES", shape=[1]
                )
            ],
            raw_output_contents=[struct.pack("<I", len(encoded)) + encoded],
        )
    )


async def generate_one(
    predictor: Predictor,
    request: kserve.ModelInferRequest,
    principal: Principal,
    timeout_s: float | None,
    templated: TemplatedText | None = None,
    *,
    fills_context: bool = False,
) -> AsyncGenerator[kserve.ModelStreamInferResponse, None]:
    """One generation request (inputs as the module describes), its responses as they come;
    errors raise (ServingError). Shared by ModelStreamInfer and the REST generate endpoints.
    `templated`: the chat template's rendering `text_input` holds (the OpenAI chat API's);
    `fills_context`: without max_tokens the reply may fill the context (GenerateCall's)."""
    check_inputs(request)
    check_generate_fields(request)
    prompt_bytes = _scalar_bytes(request, "text_input")
    if prompt_bytes is None:
        raise InvalidInput("input text_input (BYTES) is required")
    try:
        prompt = prompt_bytes.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidInput("text_input must be UTF-8") from error
    is_streaming = _scalar_bool(request, "stream")
    include_prompt = not is_streaming and not _scalar_bool(request, "exclude_input_in_output")
    options = request_parameters(request.parameters)
    served: list[str] = []
    call = GenerateCall(
        model_name=request.model_name,
        version_spec=request.model_version,
        prompt=prompt,
        sampling=_sampling(_scalar_bytes(request, "sampling_parameters")),
        principal=principal,
        request_id=request.id,
        timeout_s=options.deadline_s(timeout_s),
        priority=options.priority,
        templated=templated,
        fills_context=fills_context,
        # Its answers name the version that serves it, as ModelInfer's do, not the label or
        # "" asked for (a canary's callers could not tell which answered: review finding).
        on_version=served.append,
    )
    collected = [prompt] if include_prompt else []
    is_finished = False
    async with contextlib.aclosing(predictor.generate(call)) as messages:  # closed with ours
        async for message in messages:
            finish_reason = finish_reason_from_pb(message.finish_reason)
            if finish_reason is None:
                if is_streaming:
                    yield _response(request, served[-1], message.text, is_final=False)
                else:
                    collected.append(message.text)
                continue
            text = message.text if is_streaming else "".join([*collected, message.text])
            is_finished = True
            yield _response(
                request,
                served[-1],
                text,
                is_final=True,
                finish_reason=finish_reason,
                prompt_tokens=message.prompt_tokens,
                completion_tokens=message.completion_tokens,
            )
    if not is_finished:
        # A worker's stream that ended OK with no final message: a 200 of nothing (`{}` on
        # KServe's /generate), or a bug's 500 on OpenAI's routes (review finding).
        raise ExecutionFailed("the generation ended without its final response")
