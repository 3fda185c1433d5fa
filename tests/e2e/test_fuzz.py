"""Scenarios 38 and 39 (docs/reliability.md): edge values, random bytes and fuzzed protobufs sent
to every public RPC of a running stack (and to the router's and worker's, which are reachable).

The methods come from the generated descriptors, not a hand list: a new RPC is fuzzed as soon as
it exists (and `test_s39_every_method_has_a_valid_seed` asks for a valid request to mutate).
Every answer must be OK or a documented status, never UNKNOWN or INTERNAL (a parse bug), and
arrive before its deadline (no hang); afterwards every tier is SERVING and answers normally.

Examples are derandomized (the same ones on every run); `FUZZ_EXAMPLES=2000` runs longer by hand.
"""

from __future__ import annotations

import asyncio
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor as pbd
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.registry_schema import route_metadata
from services.gateway.triton_info import UNIMPLEMENTED_RPCS
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.models import write_affine_model, write_minilm_repository
from tests.support.processes import REPO_ROOT, health_status
from tests.support.stack import Stack, start_stack

pytestmark = pytest.mark.e2e

#: Examples per fuzz test (each draws its method too); raise it by hand to fuzz longer.
NUM_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))
#: Every call must be answered within this; a DEADLINE_EXCEEDED is reported as a hang.
CALL_TIMEOUT_S = 20.0
#: Statuses the APIs document (inference.proto, worker.proto, the KServe v2 protocol).
DOCUMENTED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
FUZZ_SETTINGS = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    # `still_healthy` is meant to run once per test, around all its examples.
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

PUBLIC_SERVICES = (
    api.DESCRIPTOR.services_by_name["InferenceService"],
    kserve.DESCRIPTOR.services_by_name["GRPCInferenceService"],
)
INTERNAL_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"]


#: Admin RPCs that change what the fleet serves: fuzzing them in local mode (every caller is
#: admin) would unload the models the other targets need. tests/e2e/test_repository_control.py
#: covers their refusals and their effects.
STATE_CHANGING = frozenset({"RepositoryModelLoad", "RepositoryModelUnload"})
#: Every method fuzzed: all but those, and Triton's RPCs the gateway does not implement, which
#: answer UNIMPLEMENTED whatever they are sent (test_s39_unimplemented_rpcs_say_so).
_METHODS = {
    f"/{service.full_name}/{method.name}": method
    for service in (*PUBLIC_SERVICES, INTERNAL_SERVICE)
    for method in service.methods
    if method.name not in UNIMPLEMENTED_RPCS and method.name not in STATE_CHANGING
}


@dataclass(frozen=True)
class Target:
    """One method (`/package.Service/Method`) on one tier."""

    tier: str
    path: str

    @property
    def method(self) -> pbd.MethodDescriptor:
        return _METHODS[self.path]


TARGETS = [
    *(
        Target("gateway", p)
        for p, m in _METHODS.items()
        if m.containing_service != INTERNAL_SERVICE
    ),
    *(
        Target(t, p)
        for t in ("router", "worker")
        for p, m in _METHODS.items()
        if m.containing_service == INTERNAL_SERVICE
    ),
]


def _bytes_element(*texts: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(t)) + t for t in texts)


def _kserve_generate(prompt: bytes, sampling: bytes) -> kserve.ModelInferRequest:
    return kserve.ModelInferRequest(
        model_name="tiny-llama",
        id="fuzz",
        inputs=[
            kserve.ModelInferRequest.InferInputTensor(name=n, datatype=d, shape=[1])
            for n, d in (
                ("text_input", "BYTES"),
                ("stream", "BOOL"),
                ("sampling_parameters", "BYTES"),
            )
        ],
        raw_input_contents=[_bytes_element(prompt), b"\x01", _bytes_element(sampling)],
    )


_AFFINE_ROW = np.arange(4, dtype="<f4")
_SAMPLING = pb.SamplingParameters(max_tokens=4, ignore_eos=True)
#: A valid request per method (the fuzzer's mutation material): every one answers OK.
SEEDS: dict[str, Message] = {
    "/inference.v1.InferenceService/Predict": api.PredictRequest(
        model_name="minilm", inputs=[api.PredictInput(text="hello world")]
    ),
    "/inference.v1.InferenceService/Generate": api.GenerateRequest(
        model_name="tiny-llama", prompt="Once upon a time", sampling=_SAMPLING
    ),
    "/inference.v1.InferenceService/ListModels": api.ListModelsRequest(),
    "/inference.v1.InferenceService/GetModel": api.GetModelRequest(model_name="minilm"),
    "/inference.GRPCInferenceService/ServerLive": kserve.ServerLiveRequest(),
    "/inference.GRPCInferenceService/ServerReady": kserve.ServerReadyRequest(),
    "/inference.GRPCInferenceService/ModelReady": kserve.ModelReadyRequest(name="minilm"),
    "/inference.GRPCInferenceService/ServerMetadata": kserve.ServerMetadataRequest(),
    "/inference.GRPCInferenceService/ModelMetadata": kserve.ModelMetadataRequest(name="affine"),
    "/inference.GRPCInferenceService/ModelConfig": kserve.ModelConfigRequest(name="affine"),
    "/inference.GRPCInferenceService/ModelStatistics": kserve.ModelStatisticsRequest(name="minilm"),
    "/inference.GRPCInferenceService/RepositoryIndex": kserve.RepositoryIndexRequest(),
    "/inference.GRPCInferenceService/ModelInfer": kserve.ModelInferRequest(
        model_name="affine",
        inputs=[
            kserve.ModelInferRequest.InferInputTensor(
                name="x",
                datatype="FP32",
                shape=[2, 4],
                contents=kserve.InferTensorContents(fp32_contents=[1, 2, 3, 4, 5, 6, 7, 8]),
            )
        ],
    ),
    "/inference.GRPCInferenceService/ModelStreamInfer": _kserve_generate(
        b"Hello", b'{"max_tokens": 4, "ignore_eos": true}'
    ),
    "/inference.v1.WorkerService/Infer": pb.InferRequest(
        model_name="affine",
        model_version="1",
        inputs=[
            pb.ModelInput(
                tensor=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=_AFFINE_ROW.tobytes())
            )
        ],
    ),
    "/inference.v1.WorkerService/InferStream": pb.InferStreamRequest(),
    "/inference.v1.WorkerService/ListModels": pb.ListWorkerModelsRequest(),
    "/inference.v1.WorkerService/Generate": pb.WorkerGenerateRequest(
        model_name="tiny-llama", model_version="1", text="Once upon a time", sampling=_SAMPLING
    ),
}
SEEDS["/inference.v1.WorkerService/InferStream"] = pb.InferStreamRequest(
    calls=[
        pb.MuxCall(
            call_id=1,
            request=SEEDS["/inference.v1.WorkerService/Infer"].SerializeToString(),
            metadata=dict(route_metadata("affine", "1", 1)),
            timeout_us=10_000_000,
        )
    ]
)


# --- calling any method with raw bytes --------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    code: grpc.StatusCode
    details: str
    #: Statuses carried inside OK responses (KServe stream errors, multiplexed call results).
    in_band: tuple[str, ...]


def _in_band(method: pbd.MethodDescriptor, payload: bytes) -> list[str]:
    output = method.output_type.full_name
    if output == kserve.ModelStreamInferResponse.DESCRIPTOR.full_name:
        message = kserve.ModelStreamInferResponse.FromString(payload).error_message
        return [message.split(":", 1)[0]] if message else []
    if output == pb.InferStreamResponse.DESCRIPTOR.full_name:
        results = pb.InferStreamResponse.FromString(payload).results
        return [_CODE_NAMES.get(r.code, f"code {r.code}") for r in results if r.code]
    return []


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _metadata(target: Target) -> tuple[tuple[str, str], ...]:
    # The router routes by metadata (the gateway sets it); without it every body is refused
    # before it is forwarded, and the worker behind would never see the fuzz.
    if target.tier != "router":
        return ()
    if target.method.name == "Generate":
        return route_metadata("tiny-llama", "1", 4)
    return route_metadata("affine", "1", 1)


def call_raw(channels: dict[str, grpc.Channel], target: Target, body: bytes) -> Answer:
    """Sends `body` as the request (identity serializers) and collects the outcome."""
    channel, method = channels[target.tier], target.method
    kwargs = {"timeout": CALL_TIMEOUT_S, "metadata": _metadata(target)}
    payloads: list[bytes] = []
    try:
        if method.client_streaming and method.server_streaming:
            payloads = list(channel.stream_stream(target.path)(iter([body]), **kwargs))
        elif method.client_streaming:
            payloads = [channel.stream_unary(target.path)(iter([body]), **kwargs)]
        elif method.server_streaming:
            payloads = list(channel.unary_stream(target.path)(body, **kwargs))
        else:
            payloads = [channel.unary_unary(target.path)(body, **kwargs)]
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    in_band = tuple(status for p in payloads for status in _in_band(method, p))
    return Answer(code, details, in_band)


def assert_documented(target: Target, body: bytes, answer: Answer) -> None:
    where = f"{target!r} answered {answer.code.name} ({answer.details!r}) to {body[:200]!r}"
    assert answer.code != grpc.StatusCode.DEADLINE_EXCEEDED, f"hang: {where}"
    assert answer.code in DOCUMENTED, where
    bad = [s for s in answer.in_band if s not in {c.name for c in DOCUMENTED}]
    assert not bad, f"{where}; in-band statuses {bad}"


# --- strategies built from the message descriptors --------------------------------------------

F = pbd.FieldDescriptor
_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
_INT_EDGES = [0, 1, -1, 2, 4, 8, 384, 511, 512, 513, 2**31 - 1, -(2**31), 2**32 - 1, 2**32]
_INT_EDGES += [2**61, 2**62, 2**63 - 1, -(2**63), 2**64 - 1]
#: Names and values the services look up: near misses of real ones, blanks, dtypes, JSON.
_STRING_EDGES = [
    "", " ", "\t", "\n", "\x00", "minilm", "tiny-llama", "affine", "MINILM", " minilm", "minilm ",
    "1", "01", "0", "-1", "2", "99999999999999999999", "1.5", "stable", "canary", "Stable",
    "x" * 300, "../../etc/passwd", "é", "\U0001f600", "FP32", "FP16", "INT32", "INT64", "BYTES",
    "BOOL", "UINT8", "FP64", "BF16", "fp32", "x", "y", "text", "embedding", "text_input",
    "stream", "sampling_parameters", "exclude_input_in_output", "text_output",
]  # fmt: skip
_JSON_EDGES = [
    b"{}", b"[]", b"null", b"nan", b'{"max_tokens": 1e999}', b'{"max_tokens": -1}',
    b'{"max_tokens": 100000000000000000000}', b'{"temperature": NaN}', b'{"top_p": Infinity}',
    b'{"seed": -5}', b'{"stop": 5}', b'{"stop": [[]]}', b'{"stop_token_ids": [-1]}',
    b'{"stop_token_ids": [4294967296]}', b'{"max_tokens": 4, "stop": ""}', b"[" * 5000,
    b'{"max_tokens": "4"}', b'{"max_tokens": true}', b'{"bogus": 1}', b"\xff\xfe",
]  # fmt: skip
_BYTES_EDGES = [
    b"", b"\x00", b"\x01", b"\xff" * 4, _bytes_element(b"hello"), _bytes_element(b""),
    _bytes_element(b"\xff\xfe"), struct.pack("<I", 2**32 - 1), _bytes_element(b"a", b"b"),
    np.array([np.nan, np.inf, -np.inf, 1], "<f4").tobytes(), _AFFINE_ROW.tobytes(),
    np.arange(8, dtype="<f4").tobytes(), np.arange(4, dtype="<i4").tobytes(),
    *_JSON_EDGES, *(_bytes_element(j) for j in _JSON_EDGES),
]  # fmt: skip


def _scalars(field: pbd.FieldDescriptor) -> st.SearchStrategy[object]:
    kind = field.type
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        edges = [v for v in _INT_EDGES if low <= v <= high]
        return st.one_of(st.sampled_from(edges), st.integers(low, high))
    if kind in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        width = 32 if kind == F.TYPE_FLOAT else 64
        edges = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, 0.005, 1.0, 3.4e38]
        return st.one_of(st.sampled_from(edges), st.floats(width=width))
    if kind == F.TYPE_BOOL:
        return st.booleans()
    if kind == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    if kind == F.TYPE_STRING:
        return st.one_of(st.sampled_from(_STRING_EDGES), st.text(max_size=40))
    if kind == F.TYPE_BYTES:
        return st.one_of(st.sampled_from(_BYTES_EDGES), st.binary(max_size=64))
    raise AssertionError(f"field {field.full_name} of unhandled type {kind}")


def _values(field: pbd.FieldDescriptor, depth: int) -> st.SearchStrategy[object]:
    """A value for `field` (a list for repeated ones, a dict for maps)."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        return st.dictionaries(_scalars(key), _values(value, depth + 1), max_size=3)
    if field.message_type is not None:
        one = messages(field.message_type, depth + 1)
    else:
        one = _scalars(field)
    if not field.is_repeated:
        return one
    if depth > 0:  # large lists nested in large lists would multiply into billions of values
        return st.lists(one, max_size=4)
    # Few elements mostly; now and then one value repeated into a large list.
    return st.one_of(
        st.lists(one, max_size=4),
        st.tuples(one, st.sampled_from([300, 3000])).map(lambda pair: [pair[0]] * pair[1]),
    )


def _assign(message: Message, field: pbd.FieldDescriptor, value: object) -> None:
    message.ClearField(field.name)
    target = getattr(message, field.name)
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, Message):
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif isinstance(value, list):
        if field.message_type is not None:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif isinstance(value, Message):
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


def messages(descriptor: pbd.Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `descriptor` with any subset of fields set to random or edge values."""
    message_class = GetMessageClass(descriptor)
    fields = [f for f in descriptor.fields if depth < 3 or f.message_type is None]

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = message_class()
        for field in fields:
            if draw(st.booleans()):
                _assign(message, field, draw(_values(field, depth)))
        return message

    return build()


def _field_slots(message: Message) -> list[tuple[Message, pbd.FieldDescriptor]]:
    """Every (message, field) reachable through the fields set in `message`."""
    slots = [(message, field) for field in message.DESCRIPTOR.fields]
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        for child in value if field.is_repeated else [value]:
            slots.extend(_field_slots(child))
    return slots


@st.composite
def mutated(draw: st.DrawFn, seed: Message) -> Message:
    """`seed` with one to three fields, anywhere in it, replaced by random or edge values."""
    message = type(seed)()
    message.CopyFrom(seed)
    for _ in range(draw(st.integers(1, 3))):
        slots = _field_slots(message)
        if not slots:
            break
        owner, field = draw(st.sampled_from(slots))
        _assign(owner, field, draw(_values(field, depth=0)))
    return message


@st.composite
def byte_mutations(draw: st.DrawFn, body: bytes) -> bytes:
    """`body` with bits flipped, bytes overwritten or inserted, or cut short."""
    data = bytearray(body)
    for _ in range(draw(st.integers(1, 4))):
        operation = draw(st.sampled_from(["flip", "set", "insert", "truncate", "duplicate"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if operation == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif operation == "set" and data:
            data[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x1A]))
        elif operation == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif operation == "truncate":
            del data[at:]
        elif operation == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


def _nested(depth: int) -> bytes:
    """A length-delimited field 1 nested `depth` times (a recursion bomb for parsers)."""
    body = b""
    for _ in range(depth):
        body = b"\x0a" + _varint(len(body)) + body
    return body


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


#: Wire-level oddities hypothesis is unlikely to stumble on.
_WIRE_EDGES = [
    b"", b"\x00", b"\xff" * 16, _nested(200), _nested(2000), b"\x0b" * 500,
    b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 10, b"\x12\x05abc", b"\x0a\x02\xc3\x28",
    bytes(range(256)),
]  # fmt: skip


# --- the stack --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("fuzz")
    repository = write_minilm_repository(tmp / "repo", slo_p99_ms=30_000)
    write_affine_model(repository)
    (repository / "tiny-llama").symlink_to(REPO_ROOT / "models" / "tiny-llama")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GATEWAY_ALLOW_UNAUTHENTICATED", "true")
        stack = start_stack(tmp, model_repository=repository)
    yield stack
    assert stack.stop() == 0, stack.stop_report()


@pytest.fixture(scope="module")
def channels(stack: Stack) -> Iterator[dict[str, grpc.Channel]]:
    opened = {
        "gateway": grpc.insecure_channel(stack.gateway.address),
        "router": grpc.insecure_channel(stack.router.address),
        "worker": grpc.insecure_channel(stack.workers[0].address),
    }
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.fixture
def still_healthy(stack: Stack, channels: dict[str, grpc.Channel]) -> Iterator[None]:
    """After the test: every tier SERVING and every seed still answered OK."""
    yield
    for tier in (stack.gateway, stack.router, *stack.workers):
        assert _health(tier.address) == health_pb2.HealthCheckResponse.SERVING
    for target in TARGETS:
        answer = call_raw(channels, target, SEEDS[target.path].SerializeToString())
        assert (answer.code, answer.in_band) == (grpc.StatusCode.OK, ()), (target, answer)


def _health(address: str) -> int:
    return asyncio.run(health_status(address))


# --- scenario 39 ------------------------------------------------------------------------------


def test_s39_every_method_has_a_valid_seed(channels: dict[str, grpc.Channel]) -> None:
    assert {t.path for t in TARGETS} == set(SEEDS), "add a valid request for each new RPC"
    for target in TARGETS:
        answer = call_raw(channels, target, SEEDS[target.path].SerializeToString())
        assert (answer.code, answer.in_band) == (grpc.StatusCode.OK, ()), (target, answer)


def test_s39_unimplemented_rpcs_say_so(channels: dict[str, grpc.Channel]) -> None:
    for name in UNIMPLEMENTED_RPCS:
        path = f"/inference.GRPCInferenceService/{name}"
        with pytest.raises(grpc.RpcError) as refused:
            channels["gateway"].unary_unary(path)(b"", timeout=CALL_TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, name
        assert f"{name} is not implemented: " in (refused.value.details() or ""), name


@pytest.mark.parametrize("body", _WIRE_EDGES, ids=lambda b: f"{len(b)}B")
def test_s39_wire_oddities_get_documented_statuses(
    channels: dict[str, grpc.Channel], body: bytes
) -> None:
    for target in TARGETS:
        assert_documented(target, body, call_raw(channels, target, body))


@FUZZ_SETTINGS
@given(target=st.sampled_from(TARGETS), body=st.binary(max_size=256))
def test_s39_random_bytes_get_documented_statuses(
    channels: dict[str, grpc.Channel], still_healthy: None, target: Target, body: bytes
) -> None:
    assert_documented(target, body, call_raw(channels, target, body))


@FUZZ_SETTINGS
@given(data=st.data(), target=st.sampled_from(TARGETS))
def test_s39_fuzzed_messages_get_documented_statuses(
    channels: dict[str, grpc.Channel], still_healthy: None, data: st.DataObject, target: Target
) -> None:
    message = data.draw(messages(target.method.input_type), label="message")
    body = message.SerializeToString()
    assert_documented(target, body, call_raw(channels, target, body))


@FUZZ_SETTINGS
@given(data=st.data(), target=st.sampled_from(TARGETS))
def test_s39_mutated_valid_requests_get_documented_statuses(
    channels: dict[str, grpc.Channel], still_healthy: None, data: st.DataObject, target: Target
) -> None:
    message = data.draw(mutated(SEEDS[target.path]), label="message")
    body = message.SerializeToString()
    assert_documented(target, body, call_raw(channels, target, body))


@FUZZ_SETTINGS
@given(data=st.data(), target=st.sampled_from(TARGETS))
def test_s39_corrupted_valid_requests_get_documented_statuses(
    channels: dict[str, grpc.Channel], still_healthy: None, data: st.DataObject, target: Target
) -> None:
    body = data.draw(byte_mutations(SEEDS[target.path].SerializeToString()), label="body")
    assert_documented(target, body, call_raw(channels, target, body))


# --- scenario 38 ------------------------------------------------------------------------------


def _affine(*row: float, dtype: str = "<f4", shape: tuple[int, ...] = (4,)) -> api.PredictRequest:
    raw = np.array(row, dtype=dtype).tobytes()
    kind = pb.DATA_TYPE_FP32 if dtype == "<f4" else pb.DATA_TYPE_INT32
    tensor = pb.Tensor(dtype=kind, shape=list(shape), raw_data=raw)
    return api.PredictRequest(model_name="affine", inputs=[api.PredictInput(tensor=tensor)])


def _kserve_affine(values: list[float], *, datatype: str = "FP32", shape=(1, 4)) -> Message:
    tensor = kserve.ModelInferRequest.InferInputTensor(
        name="x",
        datatype=datatype,
        shape=list(shape),
        contents=kserve.InferTensorContents(fp32_contents=values),
    )
    return kserve.ModelInferRequest(model_name="affine", inputs=[tensor])


def _naming(request: Message, **fields: str) -> Message:
    """`request` with `fields` (a version, an id) set."""
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def _generate(**sampling: object) -> api.GenerateRequest:
    return api.GenerateRequest(
        model_name="tiny-llama", prompt="hi", sampling=pb.SamplingParameters(**sampling)
    )


PREDICT = "/inference.v1.InferenceService/Predict"
GENERATE = "/inference.v1.InferenceService/Generate"
GET_MODEL = "/inference.v1.InferenceService/GetModel"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
#: (method, request, expected status): each bad input scenario 38 names, with its answer.
EDGE_CASES = {
    "wrong dtype": (PREDICT, _affine(1, 2, 3, 4, dtype="<i4"), INVALID),
    "wrong shape": (PREDICT, _affine(1, 2, 3, 4, 5, shape=(5,)), INVALID),
    "shape and bytes disagree": (PREDICT, _affine(1, 2, 3, 4, shape=(2, 4)), INVALID),
    "NaN": (PREDICT, _affine(math.nan, 0, 0, 0), INVALID),
    "Inf": (PREDICT, _affine(0, -math.inf, 0, 0), INVALID),
    "no inputs": (PREDICT, api.PredictRequest(model_name="minilm"), INVALID),
    "input without payload": (
        PREDICT,
        api.PredictRequest(model_name="minilm", inputs=[api.PredictInput()]),
        INVALID,
    ),
    "empty name": (
        PREDICT,
        api.PredictRequest(model_name="", inputs=[api.PredictInput()]),
        INVALID,
    ),
    "blank name": (GET_MODEL, api.GetModelRequest(model_name=" "), INVALID),
    "unknown name": (GET_MODEL, api.GetModelRequest(model_name="nope"), NOT_FOUND),
    "negative version": (
        PREDICT,
        api.PredictRequest(model_name="minilm", model_version="-1", inputs=[api.PredictInput()]),
        INVALID,
    ),
    "huge max_tokens": (GENERATE, _generate(max_tokens=2**32 - 1), INVALID),
    "NaN temperature": (GENERATE, _generate(max_tokens=4, temperature=math.nan), INVALID),
    "Inf top_p": (GENERATE, _generate(max_tokens=4, top_p=math.inf), INVALID),
    "KServe NaN": (MODEL_INFER, _kserve_affine([math.nan, 0, 0, 0]), INVALID),
    "KServe wrong dtype": (MODEL_INFER, _kserve_affine([0, 0, 0, 0], datatype="FP16"), INVALID),
    "KServe wrong shape": (MODEL_INFER, _kserve_affine([0] * 5, shape=(1, 5)), INVALID),
    "KServe empty batch": (MODEL_INFER, _kserve_affine([], shape=(0, 4)), INVALID),
    "KServe overflowing shape": (MODEL_INFER, _kserve_affine([], shape=(2**62, 4)), INVALID),
    "KServe empty name": (MODEL_INFER, kserve.ModelInferRequest(model_name=""), INVALID),
    # Defects the fuzzer found (INTERNAL before the fix): a numpy shape product that wrapped
    # around to 0, and shapes numpy cannot reshape to.
    "overflowing shape": (PREDICT, _affine(shape=(2**62, 4)), INVALID),
    "thousands of dimensions": (PREDICT, _affine(shape=(28,) * 3000), INVALID),
    "65 dimensions, one of them 0": (PREDICT, _affine(shape=(28,) * 64 + (0,)), INVALID),
    # Defects a reading of the code found (INTERNAL before the fix): no elements, but one
    # dimension numpy cannot make; a version number past int()'s 4,300 digits; a request id
    # copied into every response of a stream, unbounded.
    "no elements, one huge dimension": (PREDICT, _affine(shape=(0, 2**62)), INVALID),
    "4,301-digit version": (
        PREDICT,
        _naming(_affine(1, 2, 3, 4), model_version="1" * 4301),
        INVALID,
    ),
    "KServe 4,301-digit version": (
        MODEL_INFER,
        _naming(_kserve_affine([0] * 4), model_version="1" * 4301),
        INVALID,
    ),
    "KServe request id of 257 characters": (
        MODEL_INFER,
        _naming(_kserve_affine([0] * 4), id="x" * 257),
        INVALID,
    ),
}


@pytest.mark.parametrize("case", EDGE_CASES)
def test_s38_edge_inputs_get_their_status(channels: dict[str, grpc.Channel], case: str) -> None:
    path, request, expected = EDGE_CASES[case]
    target = next(t for t in TARGETS if t.tier == "gateway" and t.path == path)
    answer = call_raw(channels, target, request.SerializeToString())
    assert answer.code == expected, answer


@pytest.mark.parametrize(
    "sampling",
    [
        b'{"max_tokens": 4294967296}',
        b'{"max_tokens": 1e999}',
        b'{"temperature": NaN}',
        b"[[",
        b'{"max_tokens": "' + b"1" * 4301 + b'"}',
    ],  # a count as a string past int()'s digits
    ids=["2**32", "1e999", "NaN", "not JSON", "4,301 digits"],
)
def test_s38_kserve_stream_refuses_bad_sampling_in_band(
    channels: dict[str, grpc.Channel], sampling: bytes
) -> None:
    target = next(t for t in TARGETS if t.path == STREAM_INFER)
    body = _kserve_generate(b"hi", sampling).SerializeToString()
    answer = call_raw(channels, target, body)
    assert (answer.code, answer.in_band) == (grpc.StatusCode.OK, ("INVALID_ARGUMENT",)), answer


# --- regressions: each defect the fuzzer found, with the exact input --------------------------

#: Bodies that do not parse: a string field holding invalid UTF-8, and a truncated varint.
UNDECODABLE = [b"\x0a\x02\xc3\x28", b"\x08\xff"]


@pytest.mark.parametrize("body", UNDECODABLE)
@pytest.mark.parametrize(
    "path", [PREDICT, GENERATE, MODEL_INFER, STREAM_INFER], ids=lambda p: p.rsplit("/", 1)[1]
)
def test_s39_a_body_that_does_not_parse_is_invalid_argument(
    channels: dict[str, grpc.Channel], path: str, body: bytes
) -> None:
    # Was UNKNOWN ("Unexpected DecodeError"), raised by grpc before any interceptor; on
    # ModelStreamInfer the stream then waited for a reader that had died, until the deadline.
    target = Target("gateway", path)
    answer = call_raw(channels, target, body)
    # A hang would end at the call's deadline (CALL_TIMEOUT_S) as DEADLINE_EXCEEDED.
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer


def test_s39_a_huge_scalar_shape_is_refused_at_once(channels: dict[str, grpc.Channel]) -> None:
    # Was an event loop blocked for about a minute: the product of 60,000 dimensions of 2**62
    # (Python integers growing to millions of digits) computed to check "one element".
    request = _kserve_generate(b"hi", b"{}")
    request.inputs[0].shape[:] = [2**62] * 60_000
    answer = call_raw(channels, Target("gateway", STREAM_INFER), request.SerializeToString())
    # A loop blocked for a minute would answer past the call's deadline (CALL_TIMEOUT_S):
    # DEADLINE_EXCEEDED, not the in-band refusal.
    assert (answer.code, answer.in_band) == (grpc.StatusCode.OK, ("INVALID_ARGUMENT",)), answer
