"""JSON log lines carry the trace and request ids of the call being handled."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from services.common.logs import JsonFormatter, LogConfig, TextFormatter, bound_request_id

pytestmark = pytest.mark.unit


def _line(formatter: logging.Formatter, message: str, *, exc: bool = False) -> dict:
    record = logging.LogRecord("svc.part", logging.WARNING, __file__, 1, message, (), None)
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            record.exc_info = sys.exc_info()
    return json.loads(formatter.format(record))


def test_a_line_outside_any_call_has_no_ids() -> None:
    line = _line(JsonFormatter("router"), 'a "quoted" naïve message')
    assert line["message"] == 'a "quoted" naïve message'
    assert (line["level"], line["logger"], line["tier"]) == ("warning", "svc.part", "router")
    assert line["ts"].endswith("+00:00") and "trace_id" not in line and "request_id" not in line


#: The span a call is handled in.
CALL_SPAN = NonRecordingSpan(
    SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0x00F067AA0BA902B7,
        is_remote=True,
        trace_flags=TraceFlags(1),
    )
)


def test_a_line_inside_a_call_carries_its_trace_and_request_ids() -> None:
    with (
        trace.use_span(CALL_SPAN),
        bound_request_id("req-42"),
    ):
        line = _line(JsonFormatter("gateway"), "inside", exc=True)
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert line["span_id"] == "00f067aa0ba902b7"
    assert line["request_id"] == "req-42"
    assert "RuntimeError: boom" in line["exc"]
    assert "request_id" not in _line(JsonFormatter("gateway"), "after")


def test_a_text_line_inside_a_call_carries_its_ids_on_its_first_line() -> None:
    """The text format had no ids at all: a line could not be joined to its call."""
    record = logging.LogRecord("svc.part", logging.WARNING, __file__, 1, "inside", (), None)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record.exc_info = sys.exc_info()
    with trace.use_span(CALL_SPAN), bound_request_id("req-42"):
        text = TextFormatter().format(record)
    first = text.splitlines()[0]
    assert first.endswith(
        "WARNING svc.part inside [trace_id=0af7651916cd43dd8448eb211c80319c request_id=req-42]"
    )
    assert "RuntimeError: boom" in text
    plain = logging.LogRecord("svc.part", logging.INFO, __file__, 1, "outside", (), None)
    assert TextFormatter().format(plain).endswith("INFO svc.part outside")


@pytest.mark.parametrize("kwargs", [{"level": "loud"}, {"format": "xml"}])
def test_bad_log_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="must be one of"):
        LogConfig(**kwargs)
