"""The interceptor chain (error mapping, tracing, auth) over every handler shape, on a real
grpc.aio server on port 0: statuses, retry hints, spans and cleanup of abandoned streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.errors import Overloaded
from services.common.lifecycle import (
    NOT_SERVING,
    SERVING,
    add_health_and_reflection,
    new_server,
)
from services.common.tracing import Tracing
from services.gateway.auth import Authentication, KeyStore, Principal, current_principal, hash_key
from services.gateway.tenants import TenantPolicy
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

SERVICE = "test.Shapes"
KEY = (("authorization", "Bearer sesame"),)


def _is_traced() -> bytes:
    return b"traced" if trace.get_current_span().get_span_context().is_valid else b"untraced"


class Shapes:
    """One handler per call shape; each answers who called and whether its span is current."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.started = asyncio.Event()

    async def unary(self, request: bytes, context: Any) -> bytes:
        if request == b"bug":
            raise RuntimeError("the database password is hunter2")
        if request == b"cancelled inside":
            # An awaited future that something else cancelled: not the call's cancellation.
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            await future
        return current_principal().tenant.encode() + b" " + _is_traced()

    async def stream_unary(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        return b"+".join([r async for r in requests]) + b" " + _is_traced()

    async def unary_stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        try:
            yield current_principal().tenant.encode()
            yield _is_traced()
            if request == b"busy":
                raise Overloaded("queue is long", retry_after_s=0.25)
            if request == b"cancelled inside":
                future = asyncio.get_running_loop().create_future()
                future.cancel()
                await future
            if request == b"hang":
                self.started.set()
                await asyncio.Event().wait()
        finally:
            self.closed.set()

    async def stream_stream(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request + b" " + _is_traced()


@pytest.fixture
async def served() -> AsyncIterator[tuple[Shapes, grpc.aio.Channel]]:
    shapes = Shapes()
    keys = KeyStore({hash_key("sesame"): Principal("search", None, TenantPolicy("search"))})
    server = new_server([Tracing(), Authentication(keys)])
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(shapes.unary),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(shapes.stream_unary),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(shapes.unary_stream),
        "StreamStream": grpc.stream_stream_rpc_method_handler(shapes.stream_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield shapes, channel
    finally:
        await server.stop(None)


async def _requests(*messages: bytes) -> AsyncIterator[bytes]:
    for message in messages:
        yield message


def span_codes(exporter: InMemorySpanExporter, method: str) -> list[int]:
    return [
        s.attributes["rpc.grpc.status_code"]
        for s in exporter.get_finished_spans()
        if s.name == f"{SERVICE}/{method}" and s.attributes is not None
    ]


async def test_every_shape_is_authenticated_and_traced(
    served: tuple[Shapes, grpc.aio.Channel], spans: InMemorySpanExporter
) -> None:
    _, channel = served

    unary = await channel.unary_unary(f"/{SERVICE}/Unary")(b"", metadata=KEY)
    upload = await channel.stream_unary(f"/{SERVICE}/StreamUnary")(
        _requests(b"a", b"b"), metadata=KEY
    )
    download = [m async for m in channel.unary_stream(f"/{SERVICE}/UnaryStream")(b"", metadata=KEY)]
    both = [
        m
        async for m in channel.stream_stream(f"/{SERVICE}/StreamStream")(
            _requests(b"a", b"b"), metadata=KEY
        )
    ]

    assert unary == b"search traced"
    assert upload == b"a+b traced"
    assert download == [b"search", b"traced"]
    assert both == [b"a traced", b"b traced"]
    for method in ("Unary", "StreamUnary", "UnaryStream", "StreamStream"):
        assert span_codes(spans, method) == [grpc.StatusCode.OK.value[0]], method


@pytest.mark.parametrize("method", ["Unary", "StreamUnary", "UnaryStream", "StreamStream"])
async def test_s36_every_shape_refuses_a_caller_without_a_key(
    served: tuple[Shapes, grpc.aio.Channel], method: str
) -> None:
    _, channel = served
    calls = {
        "Unary": lambda: channel.unary_unary(f"/{SERVICE}/Unary")(b""),
        "StreamUnary": lambda: channel.stream_unary(f"/{SERVICE}/StreamUnary")(_requests(b"a")),
        "UnaryStream": lambda: channel.unary_stream(f"/{SERVICE}/UnaryStream")(b""),
        "StreamStream": lambda: channel.stream_stream(f"/{SERVICE}/StreamStream")(_requests()),
    }

    call = calls[method]()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        if hasattr(call, "__aiter__"):
            _ = [m async for m in call]
        else:
            await call

    assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_s19_a_stream_that_fails_midway_keeps_its_messages_status_and_retry_hint(
    served: tuple[Shapes, grpc.aio.Channel], spans: InMemorySpanExporter
) -> None:
    _, channel = served
    call = channel.unary_stream(f"/{SERVICE}/UnaryStream")(b"busy", metadata=KEY)
    received = []

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for message in call:
            received.append(message)

    assert received == [b"search", b"traced"]
    assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.details() == "queue is long"
    hints = [v for k, v in raised.value.trailing_metadata() or () if k == "retry-after-ms"]
    # 250 ms, jittered by RETRY_JITTER (25%) either way.
    assert len(hints) == 1 and 187 <= int(hints[0]) <= 313, hints
    assert span_codes(spans, "UnaryStream") == [grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]


async def test_a_bug_is_internal_and_its_details_stay_on_the_server(
    served: tuple[Shapes, grpc.aio.Channel], spans: InMemorySpanExporter
) -> None:
    _, channel = served

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"bug", metadata=KEY)

    assert raised.value.code() is grpc.StatusCode.INTERNAL
    assert raised.value.details() == "internal error"
    assert span_codes(spans, "Unary") == [grpc.StatusCode.INTERNAL.value[0]]


@pytest.mark.parametrize("method", ["Unary", "UnaryStream"])
async def test_a_cancellation_the_call_did_not_ask_for_is_answered_internal(
    served: tuple[Shapes, grpc.aio.Channel], spans: InMemorySpanExporter, method: str
) -> None:
    """A handler that raised CancelledError while its call was not cancelled (an awaited
    future cancelled by something else) is answered at once: its caller, who may have set no
    deadline, would otherwise wait for ever."""
    _, channel = served
    if method == "Unary":
        call = channel.unary_unary(f"/{SERVICE}/Unary")(b"cancelled inside", metadata=KEY)
    else:
        call = channel.unary_stream(f"/{SERVICE}/UnaryStream")(b"cancelled inside", metadata=KEY)

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        if method == "Unary":
            await asyncio.wait_for(call, timeout=30)
        else:
            await asyncio.wait_for(_drain(call), timeout=30)

    assert raised.value.code() is grpc.StatusCode.INTERNAL
    assert raised.value.details() == "internal error"
    assert span_codes(spans, method) == [grpc.StatusCode.INTERNAL.value[0]]


async def _drain(call: Any) -> list[bytes]:
    return [message async for message in call]


async def test_a_stream_the_caller_abandons_is_closed_and_its_span_ends_cancelled(
    served: tuple[Shapes, grpc.aio.Channel], spans: InMemorySpanExporter
) -> None:
    shapes, channel = served
    call = channel.unary_stream(f"/{SERVICE}/UnaryStream")(b"hang", metadata=KEY)
    await shapes.started.wait()

    call.cancel()

    await asyncio.wait_for(shapes.closed.wait(), timeout=30)
    # The span ends on the server's side of the cancel, which the test cannot await.
    codes = await eventually(
        lambda: span_codes(spans, "UnaryStream"), message="the span did not end"
    )
    assert codes == [grpc.StatusCode.CANCELLED.value[0]]


async def test_a_call_cut_off_by_its_deadline_ends_its_span_deadline_exceeded(
    served: tuple[Shapes, grpc.aio.Channel], spans: InMemorySpanExporter
) -> None:
    """As its caller was told, and as the counters count it: its span said CANCELLED, a
    caller gone away (review finding)."""
    _, channel = served
    call = channel.unary_stream(f"/{SERVICE}/UnaryStream")(b"hang", metadata=KEY, timeout=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    codes = await eventually(
        lambda: span_codes(spans, "UnaryStream"), message="the span did not end"
    )
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED.value[0]]


async def test_s33_health_watch_streams_through_the_interceptors() -> None:
    # grpcio's Watch is a coroutine writing with context.write, not an async generator; wrapped
    # as a generator it answered INTERNAL on every tier.
    server = new_server([Tracing(), Authentication(None)])
    servicer = await add_health_and_reflection(server, ["test.Shapes"], status=SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="test.Shapes"), timeout=10)
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            await servicer.set("test.Shapes", NOT_SERVING)
            second = await watch.read()
            assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
    finally:
        await server.stop(grace=None)


def _answer(text: bytes) -> grpc.RpcMethodHandler[bytes, bytes]:
    async def handler(request: bytes, context: Any) -> bytes:
        return text

    return grpc.unary_unary_rpc_method_handler(handler)


async def test_methods_given_as_registered_are_served_through_the_generic_handlers() -> None:
    # grpc.aio serves a registered method before any generic handler of the same name, and
    # waits on one pending request per registered method for every call it picks up; a
    # server of new_server serves them through its generic handlers instead, health aside.
    server = new_server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Both", {"Call": _answer(b"generic")}),)
    )
    server.add_registered_method_handlers("test.Both", {"Call": _answer(b"registered")})
    # A service given only as registered is still served, by a generic handler of its own.
    server.add_registered_method_handlers("test.Registered", {"Call": _answer(b"registered")})
    # Health stays registered (a queue of its own in grpc): its registered method answers.
    health = "grpc.health.v1.Health"
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(health, {"Check": _answer(b"generic")}),)
    )
    server.add_registered_method_handlers(health, {"Check": _answer(b"registered")})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await channel.unary_unary("/test.Both/Call")(b"", timeout=10) == b"generic"
            only = channel.unary_unary("/test.Registered/Call")
            assert await only(b"", timeout=10) == b"registered"
            check = channel.unary_unary(f"/{health}/Check")
            assert await check(b"", timeout=10) == b"registered"
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await channel.unary_unary("/test.Registered/Other")(b"", timeout=10)
            assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(grace=None)
