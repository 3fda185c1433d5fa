"""Tracing without a tracer provider: no span where none would record or carry anything (a
call of the stage, a multiplexed call, a batch), the caller's context still passed on, the
request id still on every log line."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from opentelemetry import trace

from services.common import multiplex_server, tracing
from services.common.errors import InvalidInput
from services.common.logs import JsonFormatter
from services.common.multiplex_server import CallContext, MultiplexServer
from services.common.tracing import (
    Tracing,
    batch_span,
    context_keys,
    current_traceparent,
    current_while,
    needs_span,
)
from services.gpu_worker.batching.types import BatchKey
from services.pb.inference.v1 import worker_pb2 as pb

pytestmark = pytest.mark.unit

METHOD = "/inference.v1.InferenceService/Predict"
CALLER = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"


@pytest.fixture(autouse=True)
def no_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a tier that found no exporter (the test process may have installed one)."""
    monkeypatch.setattr(tracing, "has_tracer_provider", lambda: False)


def _logged_request_id() -> str | None:
    record = logging.LogRecord("svc", logging.INFO, __file__, 1, "inside", (), None)
    return json.loads(JsonFormatter("gateway").format(record)).get("request_id")


def test_a_call_without_trace_context_gets_no_span_and_keeps_its_request_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_span(*args: object) -> None:
        raise AssertionError("a span was started")

    monkeypatch.setattr(tracing, "start_server_span", no_span)
    scope = Tracing().scope(METHOD, (("user-agent", "grpc-python"), ("x-request-id", "req-7")))
    assert scope is not None
    scope.enter()
    token = scope.attach()
    try:
        assert trace.get_current_span() is trace.INVALID_SPAN
        assert current_traceparent() == ""  # nothing to pass on downstream
        assert _logged_request_id() == "req-7"
    finally:
        scope.detach(token)
    scope.exit(grpc.StatusCode.OK, None)
    assert _logged_request_id() is None


def test_a_call_with_nothing_to_bind_or_log_runs_no_scope(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No span, no request id, no access line at the logger's level: the stage has nothing to
    do around the call, so it gives it no scope (whose every step would cost the call)."""
    with caplog.at_level(logging.INFO, logger=tracing.log.name):  # whatever pytest's level
        assert Tracing().scope(METHOD, (("user-agent", "grpc-python"),)) is None
    with caplog.at_level(logging.DEBUG, logger=tracing.log.name):
        scope = Tracing().scope(METHOD, (("user-agent", "grpc-python"),))
        assert scope is not None  # at debug level each call writes its access line
        scope.enter()
        scope.exit(grpc.StatusCode.NOT_FOUND, None)
    assert [r.getMessage().split()[:2] for r in caplog.records] == [
        ["inference.v1.InferenceService/Predict", "NOT_FOUND"]
    ]


def test_a_callers_trace_context_is_still_passed_on() -> None:
    scope = Tracing().scope(METHOD, (("traceparent", CALLER),))
    assert scope is not None
    scope.enter()
    token = scope.attach()
    try:
        # The call's (non-recording) span carries the caller's span context: its trace goes on.
        assert current_traceparent().split("-")[1] == CALLER.split("-")[1]
    finally:
        scope.detach(token)
    scope.exit(grpc.StatusCode.OK, None)
    assert current_traceparent() == ""


def test_probes_are_never_traced() -> None:
    assert Tracing().scope("/grpc.health.v1.Health/Check", ()) is None
    assert Tracing(untraced_methods=(METHOD,)).scope(METHOD, (("traceparent", CALLER),)) is None


def test_a_batch_gets_no_span_and_its_errors_pass_through() -> None:
    key = BatchKey("m", "1", "fingerprint", 16)
    with batch_span(key=key, close_reason="full", num_rows=2, requests=()) as span:
        assert span is trace.INVALID_SPAN
    with (
        pytest.raises(RuntimeError, match="model failed"),
        batch_span(key=key, close_reason="full", num_rows=2, requests=()),
    ):
        raise RuntimeError("model failed")


def test_a_call_needs_a_span_only_to_be_recorded_or_to_pass_on_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = context_keys()
    assert "traceparent" in keys  # the default propagators: W3C trace context and baggage
    assert not needs_span((("user-agent", "grpc-python"),), keys)
    assert needs_span((("user-agent", "grpc-python"), ("traceparent", CALLER)), keys)
    monkeypatch.setattr(tracing, "has_tracer_provider", lambda: True)
    assert needs_span((), keys)  # recorded once a provider is installed


class _CountedEnds(trace.NonRecordingSpan):
    def __init__(self, context: trace.SpanContext) -> None:
        super().__init__(context)
        self.num_ends = 0

    def end(self, end_time: int | None = None) -> None:
        self.num_ends += 1


def test_current_while_makes_a_span_current_and_leaves_its_end_to_the_caller() -> None:
    with current_while(None):
        assert trace.get_current_span() is trace.INVALID_SPAN
    span = _CountedEnds(
        trace.SpanContext(
            trace_id=int(CALLER.split("-")[1], 16),
            span_id=int(CALLER.split("-")[2], 16),
            is_remote=True,
            trace_flags=trace.TraceFlags(1),
        )
    )
    with current_while(span):
        assert current_traceparent() == CALLER
    assert trace.get_current_span() is trace.INVALID_SPAN
    assert span.num_ends == 0


Handler = Callable[[bytes, CallContext], object]


def _served(handler: Handler, calls: list[pb.MuxCall]) -> list[pb.MuxResult]:
    """`calls` sent on one stream to a MultiplexServer running `handler`: their results."""

    async def answer(request: bytes, context: CallContext) -> bytes:
        handler(request, context)
        return request

    async def run() -> list[pb.MuxResult]:
        server = MultiplexServer(answer, deserialize=bytes, serialize=bytes)

        async def requests() -> AsyncIterator[pb.InferStreamRequest]:
            yield pb.InferStreamRequest(calls=calls)

        results: list[pb.MuxResult] = []
        async for message in server.serve(requests()):
            results.extend(message.results)
        return sorted(results, key=lambda r: r.call_id)

    return asyncio.run(run())


def test_a_multiplexed_call_gets_a_span_only_to_pass_on_its_callers_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start_server_span = tracing.start_server_span
    seen: dict[bytes, str] = {}

    def record(request: bytes, context: CallContext) -> None:
        if request == b"bad":
            raise InvalidInput("bad request")
        seen[request] = current_traceparent()

    def spans_only_with_context(method: str, metadata: tuple[tuple[str, str], ...]) -> object:
        assert dict(metadata).get("traceparent") == CALLER, "a span without trace context"
        return start_server_span(method, metadata)

    monkeypatch.setattr(multiplex_server, "start_server_span", spans_only_with_context)
    results = _served(
        record,
        [
            pb.MuxCall(call_id=1, request=b"plain"),
            pb.MuxCall(call_id=2, request=b"traced", metadata={"traceparent": CALLER}),
            pb.MuxCall(call_id=3, request=b"bad"),
        ],
    )
    assert [r.code for r in results] == [0, 0, grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    assert seen[b"plain"] == ""
    assert seen[b"traced"].split("-")[1] == CALLER.split("-")[1]
