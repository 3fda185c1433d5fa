"""KServe v2 REST bodies <-> the KServe gRPC messages the servicer already validates, so REST
and gRPC share every check after this point. Pure: bytes and dicts in, messages out.

JSON tensors carry `data` as a (possibly nested) row-major list; Triton's binary tensor
extension sends the JSON header first (its length in the `Inference-Header-Content-Length`
header) and then each input's bytes in order, each input's `parameters.binary_data_size` long
(BYTES elements as 4-byte little-endian lengths each followed by the bytes). Outputs come back
binary when the request's `binary_data_output` parameter or the output's `binary_data`
parameter asks for it.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np

from services.common.errors import ExecutionFailed, InvalidInput
from services.common.tensors import NUMPY_DTYPES
from services.gateway.model_inputs import check_num_inputs
from services.pb.inference import grpc_service_pb2 as kserve

P = ParamSpec("P")
R = TypeVar("R")

#: The header naming the JSON part's length in a binary-extension body.
HEADER_LENGTH = "Inference-Header-Content-Length"
#: Deepest nesting of a JSON `data` list (a tensor has few dimensions).
MAX_DATA_DEPTH = 16
#: Longest request id a call may carry (KServe's `id`, copied into every response) and
#: `X-Request-Id` echoed on an answer.
MAX_REQUEST_ID_CHARS = 256
_NUMBER_TYPES = (int, float)


@dataclass(frozen=True)
class InferBody:
    """One parsed infer request: the message for the servicer and how to send outputs."""

    request: kserve.ModelInferRequest
    #: Every output binary (`binary_data_output`), unless named in `json_outputs`.
    is_binary_default: bool
    #: Outputs asked for by name with their own `binary_data` choice.
    binary_by_output: dict[str, bool]

    def is_binary(self, name: str) -> bool:
        return self.binary_by_output.get(name, self.is_binary_default)


def client_strings(parse: Callable[P, R]) -> Callable[P, R]:
    """`parse`, whose body's strings are the client's: one no protobuf string holds (a lone
    surrogate escape such as "\\ud800", valid JSON) is INVALID_ARGUMENT, not a server error.
    So is a body nested so deep that writing a part of it again (as JSON, a few frames below
    where it parsed) passes Python's recursion limit (a 500 before: review finding)."""

    @functools.wraps(parse)
    def parsed(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return parse(*args, **kwargs)
        except UnicodeEncodeError as error:
            raise InvalidInput(
                "a string of the request is not valid Unicode (a lone surrogate such as \\ud800)"
            ) from error
        except RecursionError:
            raise InvalidInput("the request's JSON nests too deeply") from None

    return parsed


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON object and the binary part after it (empty without the header)."""
    if header_length is None:
        json_part, binary = body, b""
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise InvalidInput(f"{HEADER_LENGTH} is not an integer: {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise InvalidInput(f"{HEADER_LENGTH} {length} is outside the {len(body)}-byte body")
        json_part, binary = body[:length], body[length:]
    return parse_json_object(json_part), binary


def finite_json(value: Any, advice: str = "") -> str:
    """`value` as JSON; ExecutionFailed (500) where a model's output holds NaN or infinity,
    which JSON has no number for (Python would write bare `NaN`, which parsers refuse: a 200
    whose body does not parse). `advice`: how the caller could get such outputs."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        raise ExecutionFailed(
            f"the model's outputs hold NaN or infinity, which JSON cannot carry{advice}"
        ) from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object; InvalidInput otherwise."""
    try:
        parsed = json.loads(raw, parse_float=_finite_float)
    except (ValueError, RecursionError) as error:
        raise InvalidInput(f"request body is not JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise InvalidInput("request body must be a JSON object")
    return parsed


def infer_parameters(parameters: Any) -> dict[str, kserve.InferParameter]:
    """A JSON `parameters` object as InferParameters (bool, integer, float or string)."""
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise InvalidInput("parameters must be a JSON object")
    converted = {}
    for key, value in parameters.items():
        if isinstance(value, bool):
            converted[key] = kserve.InferParameter(bool_param=value)
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            converted[key] = kserve.InferParameter(int64_param=value)
        elif isinstance(value, float):
            converted[key] = kserve.InferParameter(double_param=value)
        elif isinstance(value, str):
            converted[key] = kserve.InferParameter(string_param=value)
        else:
            raise InvalidInput(f"parameter {key!r} must be a bool, integer, number or string")
    return converted


def _flatten(data: Any, depth: int = 0) -> Iterator[Any]:
    if depth > MAX_DATA_DEPTH:
        raise InvalidInput(f"tensor data nests deeper than {MAX_DATA_DEPTH} lists")
    for item in data:
        if isinstance(item, list):
            yield from _flatten(item, depth + 1)
        else:
            yield item


def json_object(value: Any, what: str) -> dict[str, Any]:
    """`value` when it is a JSON object (absent or null: an empty one); INVALID_ARGUMENT
    otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object")
    return value


def utf8(text: str, what: str) -> bytes:
    """`text` in UTF-8; INVALID_ARGUMENT for text that has none (JSON's lone surrogates,
    such as "\\ud800")."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        raise InvalidInput(f"{what} is not valid Unicode (a lone surrogate)") from None


def bytes_elements(elements: list[bytes]) -> bytes:
    """BYTES elements in the wire framing: each a 4-byte little-endian length, then bytes."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def is_json_int(value: Any) -> bool:
    """A JSON integer (not `true` or `false`, which Python counts as ints)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_float(text: str) -> float:
    """A JSON number as a float; ValueError (the body is refused) past a float's range: Python
    read `1e400` as infinity, taken as sent. A literal `Infinity` stays what it says."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:32]} is past a float's range")
    return value


def json_tensor_bytes(name: str, datatype: str, data: Any) -> bytes:
    """A JSON tensor's `data` as raw bytes in the wire layout of `datatype`."""
    if not isinstance(data, list):
        raise InvalidInput(f"input {name}: data must be a list")
    flat = list(_flatten(data))
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise InvalidInput(f"input {name}: BYTES data must be strings")
        return bytes_elements([utf8(v, f"input {name}") for v in flat])
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is None:
        raise InvalidInput(f"input {name}: datatype {datatype!r} is not supported")
    if not all(isinstance(v, _NUMBER_TYPES) and not isinstance(v, bool) for v in flat):
        raise InvalidInput(f"input {name}: {datatype} data must be numbers")
    if dtype.kind in "iu" and not all(isinstance(v, int) for v in flat):
        # numpy would cut 1.9 to 1 without a word; Triton refuses it too.
        raise InvalidInput(f"input {name}: {datatype} data must be integers")
    try:
        with np.errstate(over="ignore"):  # a float past its type's range: refused below
            values = np.asarray(flat, dtype=dtype)
    except (OverflowError, ValueError):  # too big, or NaN/infinity for an integer type
        raise InvalidInput(f"input {name}: a value does not fit {datatype}") from None
    # A float past the type's range (70000 in FP16, 1e300 in FP32) became infinity without a
    # word, where an integer past it is refused: refused alike (an infinity sent is kept).
    infinite = np.isinf(values) if dtype.kind == "f" else None
    if (
        infinite is not None
        and infinite.any()  # only then is `flat` read again, as float64
        and np.isfinite(np.asarray(flat, dtype=np.float64)[infinite]).any()
    ):
        raise InvalidInput(f"input {name}: a value does not fit {datatype}")
    return values.tobytes()


def _input_tensor(
    tensor: Any, binary: bytes, offset: int
) -> tuple[kserve.ModelInferRequest.InferInputTensor, bytes, int]:
    """One input as (its metadata, its raw bytes, the binary offset after it)."""
    if not isinstance(tensor, dict):
        raise InvalidInput("each input must be a JSON object")
    name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise InvalidInput("each input needs a name and a datatype")
    if not isinstance(shape, list) or not all(is_json_int(d) and 0 <= d < 2**63 for d in shape):
        raise InvalidInput(f"input {name}: shape must be a list of non-negative integers")
    parameters = tensor.get("parameters") or {}
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        if not is_json_int(size) or size < 0 or offset + size > len(binary):
            raise InvalidInput(f"input {name}: binary_data_size {size} runs past the body")
        raw, offset = binary[offset : offset + size], offset + size
    elif "data" in tensor:
        raw = json_tensor_bytes(name, datatype, tensor["data"])
    else:
        raise InvalidInput(f"input {name} has neither data nor binary_data_size")
    message = kserve.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    return message, raw, offset


#: Most tensors a KServe request may name, inputs or outputs: a model takes one input and
#: gives one output, a generation a few inputs (a request of a million empty ones is refused
#: before any is looked at).
MAX_TENSORS = 16
#: Triton's classification extension (top-k "score:index" strings for an output), not served:
#: ignored, a stock client would parse the full tensor as if it were its answer.
NO_CLASSIFICATION = "the classification extension is not supported: ask for the output itself"


def check_tensor_count(count: int, what: str) -> None:
    """Refuses a request naming more than MAX_TENSORS `what` ("inputs" or "outputs")."""
    if count > MAX_TENSORS:
        raise InvalidInput(f"{count} {what}: a request names at most {MAX_TENSORS}")


def header_request_id(headers: Mapping[str, str]) -> str:
    """The caller's `X-Request-Id` ("" without one, or with one past MAX_REQUEST_ID_CHARS or
    not printable ASCII): echoed on the answer, and the call's request id where its body has
    none (the OpenAI and embeddings routes), which logs, traces and sticky routing follow."""
    request_id = headers.get("X-Request-Id", "")
    is_taken = len(request_id) <= MAX_REQUEST_ID_CHARS and request_id.isascii()
    return request_id if is_taken and request_id.isprintable() else ""


def request_id_of(body: dict[str, Any]) -> str:
    """A REST body's `id` ("" without one); InvalidInput unless a string."""
    request_id = body.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput("id must be a string")
    return request_id


def check_rows_named(body: dict[str, Any], max_rows: int) -> None:
    """Refuses a REST infer body an input of which names more rows (its shape's first
    dimension) than `max_rows`, before any element is decoded; what else is wrong with the
    body `infer_body` says."""
    inputs = body.get("inputs")
    for tensor in inputs if isinstance(inputs, list) else ():
        shape = tensor.get("shape") if isinstance(tensor, dict) else None
        if isinstance(shape, list) and shape and is_json_int(shape[0]):
            check_num_inputs(shape[0], max_rows)


@client_strings
def infer_body(
    model_name: str, model_version: str, body: dict[str, Any], binary: bytes
) -> InferBody:
    """The ModelInferRequest of a REST infer body; every input's data goes in
    `raw_input_contents`, as tritonclient's gRPC client sends it."""
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("inputs must be a non-empty list")
    check_tensor_count(len(inputs), "inputs")
    request_id = request_id_of(body)
    parameters = dict(json_object(body.get("parameters"), "parameters"))
    is_binary_default = parameters.pop("binary_data_output", False) is True
    request = kserve.ModelInferRequest(
        model_name=model_name,
        model_version=model_version,
        id=request_id,
        parameters=infer_parameters(parameters),
    )
    offset = 0
    for tensor in inputs:
        message, raw, offset = _input_tensor(tensor, binary, offset)
        request.inputs.append(message)
        request.raw_input_contents.append(raw)
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} bytes of binary data belong to no input")
    outputs = body.get("outputs") or []
    if not isinstance(outputs, list):
        raise InvalidInput("outputs must be a list")
    check_tensor_count(len(outputs), "outputs")
    binary_by_output = {}
    for output in outputs:
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise InvalidInput("each output must be a JSON object with a name")
        request.outputs.add(name=output["name"])
        output_parameters = json_object(output.get("parameters"), "an output's parameters")
        if "classification" in output_parameters:
            raise InvalidInput(NO_CLASSIFICATION)
        choice = output_parameters.get("binary_data")
        binary_by_output[output["name"]] = choice is True or (choice is None and is_binary_default)
    return InferBody(request, is_binary_default, binary_by_output)


def decode_bytes_elements(raw: bytes) -> list[bytes]:
    """The elements of a length-prefixed BYTES buffer (our own responses: trusted framing)."""
    elements, offset = [], 0
    while offset + 4 <= len(raw):
        (length,) = struct.unpack_from("<I", raw, offset)
        elements.append(raw[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return elements


def output_data(datatype: str, raw: bytes) -> list[Any]:
    """An output's raw bytes as a flat JSON `data` list."""
    if datatype == "BYTES":
        return [e.decode("utf-8", errors="replace") for e in decode_bytes_elements(raw)]
    values: list[Any] = np.frombuffer(raw, dtype=NUMPY_DTYPES[datatype]).tolist()
    return values


def infer_response_body(
    response: kserve.ModelInferResponse, choice: InferBody
) -> tuple[bytes, int | None]:
    """The REST body of `response` and, when any output went binary, the JSON part's length
    (for the `Inference-Header-Content-Length` header)."""
    outputs, binary = [], []
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        output: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if choice.is_binary(tensor.name):
            output["parameters"] = {"binary_data_size": len(raw)}
            binary.append(raw)
        else:
            output["data"] = output_data(tensor.datatype, raw)
        outputs.append(output)
    header = finite_json(
        {
            "model_name": response.model_name,
            "model_version": response.model_version,
            "id": response.id,
            "outputs": outputs,
        },
        advice="; ask for them as binary data (the output's `binary_data` parameter)",
    ).encode()
    if not binary:
        return header, None
    return header + b"".join(binary), len(header)
