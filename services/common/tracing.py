"""OpenTelemetry tracing for every tier: setup, the server stage, outgoing context, the
worker's batch span.

One request is one trace: each tier's server span is the child of its caller's (W3C
`traceparent` in gRPC metadata), and a worker batch span, a root of its own, links the requests
whose rows it ran. Nothing is exported unless the standard `OTEL_*` variables ask for it; until
`configure_tracing` installs a provider, the API's no-op tracer only passes the caller's
context through.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from services.common.logs import bind_request_id, unbind_request_id

log = logging.getLogger(__name__)

#: What the worker keeps of a request's span to link its batch to it.
TraceContext = SpanContext

#: Probes and tooling, not requests: tracing them would bury the requests.
_UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_tracer = trace.get_tracer(__name__)


# -- setup -------------------------------------------------------------------------------------


def configure_tracing(service_name: str, env: Mapping[str, str] | None = None) -> None:
    """Installs the process's tracer provider. Called once, from `__main__`.

    Exports only when asked: `OTEL_TRACES_EXPORTER` (otlp, console, none; comma-separated), or
    else an `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`. The exporter
    reads its own settings (endpoint, headers, timeout) and the provider its sampler
    (`OTEL_TRACES_SAMPLER`) from the same variables; `OTEL_SERVICE_NAME` overrides the tier's
    name, `OTEL_SDK_DISABLED=true` turns everything off. Without an exporter no provider is
    installed, so spans cost nothing."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing disabled (OTEL_SDK_DISABLED)")
        return
    exporters = _span_exporters(env)
    if not exporters:
        log.info("tracing off: set OTEL_EXPORTER_OTLP_ENDPOINT to export spans")
        return
    name = env.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing on as %s: %s", name, ", ".join(type(e).__name__ for e in exporters))


def _span_exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n]
    if not names and (
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        names = ["otlp"]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
            )
            if protocol != "grpc":
                log.warning("OTLP protocol %r is not installed here; exporting over grpc", protocol)
            # Imported only when used: the exporter pulls in the OTLP protobuf modules.
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name != "none":
            log.warning("OTEL_TRACES_EXPORTER %r is not supported (otlp, console, none)", name)
    return exporters


# -- context across calls ----------------------------------------------------------------------


def outgoing_metadata(extra: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """`extra` plus the current trace context (`traceparent`, `tracestate`), for a client call
    made while serving a request: the callee's span becomes a child of ours."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return (*extra, *carrier.items())


def current_traceparent() -> str:
    """The current span's W3C `traceparent`, or "" when it is not traced."""
    if not trace.get_current_span().get_span_context().is_valid:
        return ""  # tracing off: no span to name (and no propagator worth calling)
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def span_context_of(traceparent: str) -> TraceContext | None:
    """The span a W3C `traceparent` names (None when empty): work done later on behalf of one
    caller of a bundle (its batch) links to that caller's trace."""
    if not traceparent:
        return None
    extracted = propagate.extract({"traceparent": traceparent})
    return trace.get_current_span(extracted).get_span_context()


def current_span_context() -> TraceContext:
    """The current request's span, for linking work done later on its behalf (a batch)."""
    return trace.get_current_span().get_span_context()


class BatchKeyLike(Protocol):
    # Read-only properties, so that a named tuple (BatchKey) satisfies the protocol.
    @property
    def model(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def bucket(self) -> int:
        """Padded length class (tokens) or shape class of the batch."""


@contextlib.contextmanager
def batch_span(
    *, key: BatchKeyLike, close_reason: str, num_rows: int, requests: Iterable[TraceContext]
) -> Iterator[trace.Span]:
    """A span around one batch's execution, linked to each request that has rows in it. It is
    a root: a batch serves many traces, so it belongs to none of them."""
    if not has_tracer_provider():  # nothing would be recorded (about 20 us a batch for nothing)
        yield trace.INVALID_SPAN
        return
    # A request with several rows in the batch is linked once.
    unique = {(c.trace_id, c.span_id): c for c in requests if c.is_valid}
    links = [Link(c) for c in unique.values()]
    with _tracer.start_as_current_span(
        "batch",
        context=otel_context.Context(),
        links=links,
        attributes={
            "inference.model": key.model,
            "inference.model_version": key.version,
            "inference.batch.bucket": key.bucket,
            "inference.batch.size": num_rows,
            "inference.batch.close_reason": close_reason,
        },
    ) as span:
        yield span


# -- the server stage --------------------------------------------------------------------------


class Tracing:
    """The tracing stage of every call (services.common.interceptors): each runs in a SERVER
    span named after its method ("package.Service/Method"), the child of the caller's span
    when the call's metadata carries one, ending with the call's gRPC status (the domain
    error's, before it is answered). The caller's `x-request-id` is bound to the log lines
    written inside the handler, and at debug level each call ends with one access line
    (method, status, milliseconds).

    While no tracer provider is installed (`configure_tracing` found no exporter), a call that
    carries no trace context gets no span: the API's span would record nothing and pass on no
    context, yet cost more than the rest of the stage (about 8 us of each gateway call). One
    that also brings no request id, below debug level, gets no scope at all."""

    def __init__(self, untraced_methods: Iterable[str] = ()) -> None:
        #: Full method paths ("/package.Service/Method") polled by other tiers, not requests.
        self._untraced = frozenset(untraced_methods)
        self._context_keys = context_keys()

    def scope(self, method: str, metadata: Sequence[tuple[str, Any]]) -> _Call | None:
        if method.startswith(_UNTRACED_PREFIXES) or method in self._untraced:
            return None
        if needs_span(metadata, self._context_keys):
            return _TracedCall(method, metadata)
        if log.isEnabledFor(logging.DEBUG) or any(key == REQUEST_ID_KEY for key, _ in metadata):
            return _Call(method, metadata)
        # No request id to bind, no access line to write: no scope for the call to run at all.
        # A scope that does nothing still costs a served gateway call about 15 us of grpc.aio's
        # per-call path (`python -m bench.server_calls`, against 3 us timed in a loop alone).
        return None


def has_tracer_provider() -> bool:
    """Whether a tracer provider is installed, so that spans can be recorded; until one is,
    the API's spans only carry a caller's context along."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def context_keys() -> frozenset[str]:
    """The metadata keys the installed propagators read (W3C: traceparent, tracestate,
    baggage)."""
    return frozenset(propagate.get_global_textmap().fields)


def needs_span(metadata: Iterable[tuple[str, Any]], keys: frozenset[str]) -> bool:
    """Whether a call with `metadata` is served in a span: one can be recorded (a tracer
    provider is installed), or its caller sent trace context (`keys`: `context_keys()`) to
    pass on. Otherwise the API's span would record nothing and pass on nothing."""
    return has_tracer_provider() or any(key in keys for key, _ in metadata)


def current_while(span: trace.Span | None) -> contextlib.AbstractContextManager[object]:
    """`span` made current for the enclosed code; nothing when None. Never ends it: its
    caller does."""
    if span is None:
        return contextlib.nullcontext()
    return trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    )


class _Call:
    """One call's request id, bound to the log lines written while the call is attached, and
    its access line at debug level: all a call without a span needs (see Tracing)."""

    __slots__ = ("_metadata", "_method", "_request_id", "_started_s")

    def __init__(self, method: str, metadata: Sequence[tuple[str, Any]]) -> None:
        self._method = method
        self._metadata = metadata
        self._request_id = ""
        self._started_s = 0.0

    def enter(self) -> None:
        self._request_id = next((str(v) for k, v in self._metadata if k == REQUEST_ID_KEY), "")
        self._started_s = time.perf_counter()

    def attach(self) -> object:
        return bind_request_id(self._request_id) if self._request_id else None

    def detach(self, token: object) -> None:
        if token is not None:
            unbind_request_id(cast("contextvars.Token[str]", token))

    def exit(self, code: grpc.StatusCode, error: BaseException | None) -> None:
        if log.isEnabledFor(logging.DEBUG):
            elapsed_ms = (time.perf_counter() - self._started_s) * 1e3
            token = self.attach()
            try:
                log.debug("%s %s %.1f ms", self._method.lstrip("/"), code.name, elapsed_ms)
            finally:
                self.detach(token)


class _TracedCall(_Call):
    """One call's span, started when its handler starts (a call whose handler never runs, its
    body never received, has none); current only while attached (see
    services.common.interceptors)."""

    __slots__ = ("_active", "_span")

    def enter(self) -> None:
        self._span = start_server_span(self._method, self._metadata)
        self._active = trace.set_span_in_context(self._span)
        super().enter()

    def attach(self) -> tuple[object, object]:
        return otel_context.attach(self._active), super().attach()

    def detach(self, token: object) -> None:
        span_token, request_token = cast(
            "tuple[contextvars.Token[otel_context.Context], object]", token
        )
        super().detach(request_token)
        otel_context.detach(span_token)

    def exit(self, code: grpc.StatusCode, error: BaseException | None) -> None:
        super().exit(code, error)
        end_server_span(self._span, code, "" if error is None else str(error), error)


def start_server_span(method: str, metadata: Iterable[tuple[str, Any]]) -> trace.Span:
    """A SERVER span for one call of `method` ("/package.Service/Method"), the child of the
    caller's span when `metadata` carries its W3C context. End it with `end_server_span`."""
    parent = propagate.extract({k: v for k, v in metadata if isinstance(v, str)})
    service, _, name = method.lstrip("/").rpartition("/")
    return _tracer.start_span(
        method.lstrip("/"),
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
    )


def end_server_span(
    span: trace.Span,
    code: grpc.StatusCode,
    message: str = "",
    error: BaseException | None = None,
) -> None:
    """Ends a call's span with the status it was answered with (and, for INTERNAL, the stack
    of `error`: a bug or a model failure)."""
    if error is not None and code is grpc.StatusCode.INTERNAL:
        span.record_exception(error)
    _set_status(span, code, message)
    span.end()


#: Metadata key of the caller's request id; it is bound to every log line of the call.
REQUEST_ID_KEY = "x-request-id"


def _set_status(span: trace.Span, code: grpc.StatusCode, message: str) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}" if message else None))
