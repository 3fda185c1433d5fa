"""Server-sent events framing, as Triton's generate_stream and the OpenAI API send them."""

from __future__ import annotations

import json
from typing import Any

#: The OpenAI stream's last event.
DONE_EVENT = b"data: [DONE]\n\n"
#: Content type of an event stream.
SSE_CONTENT_TYPE = "text/event-stream"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One `data:` event holding `payload` as compact JSON (JSON never holds a raw newline, so
    one data line always suffices)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
