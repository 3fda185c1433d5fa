"""Process logging for every tier: one JSON object per line (or plain text for a terminal),
carrying the trace and request ids of the call being handled, so a log line and a trace find
each other.

Fields of a JSON line: `ts` (UTC, ISO 8601 with milliseconds), `level`, `logger`, `message`,
`tier`, and when known `trace_id` / `span_id` (the current OpenTelemetry span's, which is the
caller's `traceparent` even when no exporter is configured) and `request_id` (bound by the
code handling a request, see `bound_request_id`); `exc` holds a traceback.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from opentelemetry import trace

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("json", "text")
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


@dataclass(frozen=True)
class LogConfig:
    """How a process logs."""

    #: Lowest level written: debug, info, warning or error.
    level: str = "info"
    #: `json` (one object per line, for collectors) or `text` (for a terminal).
    format: str = "json"

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LEVELS)}; got {self.level!r}")
        if self.format not in FORMATS:
            raise ValueError(f"log format must be one of {', '.join(FORMATS)}; got {self.format!r}")


@contextlib.contextmanager
def bound_request_id(request_id: str) -> Iterator[None]:
    """Log lines written inside carry `request_id`."""
    token = bind_request_id(request_id)
    try:
        yield
    finally:
        unbind_request_id(token)


def bind_request_id(request_id: str) -> contextvars.Token[str]:
    """Log lines written from now on in this context carry `request_id`, until
    `unbind_request_id` with the token returned (`bound_request_id` as two calls)."""
    return _request_id.set(request_id)


def unbind_request_id(token: contextvars.Token[str]) -> None:
    _request_id.reset(token)


def _call_ids() -> dict[str, str]:
    """The trace, span and request ids of the call being handled (none outside a call)."""
    ids = {}
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        ids["trace_id"] = format(context.trace_id, "032x")
        ids["span_id"] = format(context.span_id, "016x")
    if request_id := _request_id.get():
        ids["request_id"] = request_id
    return ids


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the current trace and request ids."""

    def __init__(self, tier: str) -> None:
        super().__init__()
        self._tier = tier

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "tier": self._tier,
        }
        line.update(_call_ids())
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`time level logger message`, then the current trace and request ids when there are
    any: without them a text line could not be joined to the call it was about (review
    finding; JsonFormatter carries them as fields)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = [f"{k}={v}" for k, v in _call_ids().items() if k != "span_id"]
        if not ids:
            return text
        first, newline, rest = text.partition("\n")  # ids on the message's line, not a traceback's
        return f"{first} [{' '.join(ids)}]{newline}{rest}"


def configure_logging(tier: str, config: LogConfig | None = None) -> None:
    """Installs the process's one stderr handler (replacing any), at `config.level`."""
    config = config or LogConfig()
    handler = logging.StreamHandler(sys.stderr)
    if config.format == "json":
        handler.setFormatter(JsonFormatter(tier))
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(config.level.upper())
