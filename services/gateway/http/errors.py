"""Errors as HTTP answers: the gRPC status a call would get (services.common.grpc_errors,
the one mapping of errors to statuses) turned into an HTTP status and a JSON body."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import grpc
from aiohttp import web

from services.common.errors import RETRY_AFTER_MS_KEY, ServingError, is_too_large
from services.common.grpc_errors import status_of

#: gRPC codes to HTTP statuses (as KServe and grpc-gateway map them); others are 500. Not
#: CANCELLED to grpc-gateway's 499: a client that hung up is written nothing (its handler is
#: cancelled), so a CANCELLED answered here came from further down (a call dropped unseen
#: past --max-pending-calls, a tier stopping past its grace), which is safe to send again, and
#: stock clients (OpenAI's, tritonclient, TEI's) retry a 503, never a 499.
HTTP_STATUSES: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
#: The header OpenAI's clients read before retrying (they retry 408, 409, 429 and every 5xx).
NO_RETRY_HEADER = "x-should-retry"
#: OpenAI's error `type` for our statuses (its clients read `error.message` and the status);
#: any other 4xx (405, 408, 409, 413) is the request's: invalid_request_error, as OpenAI types
#: them; a 5xx is server_error.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 429: "rate_limit_error"}  # fmt: skip


#: OpenAI's error `code` for our statuses; null for the others, as OpenAI leaves it.
_OPENAI_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}


class AnsweredInBand(ServingError):
    """A stream's failure after its headers went out, answered inside the stream (which has
    ended). Raised past the stream's metrics, which count it with the failure's status; the
    error middleware then returns `response`, already sent, as it is."""

    def __init__(self, response: web.StreamResponse, error: Exception) -> None:
        status = status_of(error)
        super().__init__(status.message)
        self.code = status.code
        self.response = response


@dataclass(frozen=True)
class HttpError:
    """One error as an HTTP answer."""

    status: int
    message: str
    #: Headers to send (Retry-After on 429 when the refusal carries a hint).
    headers: dict[str, str]

    def kserve_body(self) -> bytes:
        """KServe's error body: {"error": "<message>"}."""
        return json.dumps({"error": self.message}).encode()

    def tei_body(self) -> bytes:
        """text-embeddings-inference's error body: {"error", "error_type"}."""
        if self.status == 429:
            kind = "Overloaded"
        elif self.status == 503:
            kind = "Unhealthy"
        elif self.status >= 500:
            kind = "Backend"
        else:
            kind = "Validation"
        return json.dumps({"error": self.message, "error_type": kind}).encode()

    def openai_body(self) -> bytes:
        """OpenAI's error body: {"error": {"message", "type", "param", "code"}}, `code` a
        string or null, as OpenAI's is (an integer there failed typed clients' decoding)."""
        default = "invalid_request_error" if self.status < 500 else "server_error"
        kind = _OPENAI_TYPES.get(self.status, default)
        code = _OPENAI_CODES.get(self.status)
        return json.dumps(
            {"error": {"message": self.message, "type": kind, "param": None, "code": code}}
        ).encode()


def http_error(error: BaseException) -> HttpError:
    """The HTTP answer to a call that raised `error` (a ServingError's own words; "internal
    error" for anything else, whose details stay in our logs)."""
    status = status_of(error)
    headers: dict[str, str] = {}
    for key, value in status.trailers:
        if key == RETRY_AFTER_MS_KEY:
            # Retry-After is whole seconds; round up so a client never comes back too early.
            headers["Retry-After"] = str(max(1, math.ceil(int(value) / 1000)))
            # And the hint itself, jittered to the millisecond (whole seconds would send every
            # caller refused in one flood back together): the header OpenAI's and Azure's
            # clients read before Retry-After.
            headers[RETRY_AFTER_MS_KEY] = value
    if is_too_large(status.code, status.message):
        # A message past a size limit, not load: sent again as it is, it fails alike, and as a
        # 429 stock clients sent it twice more (OpenAI's), or throttled themselves on it.
        code = 413
        headers.clear()
    else:
        code = HTTP_STATUSES.get(status.code, 500)
    if code == 401:  # RFC 9110: a 401 names the scheme it wants (an API key as a bearer token)
        headers["WWW-Authenticate"] = "Bearer"
    if code == 413 or status.code == grpc.StatusCode.INTERNAL:
        # OpenAI's clients send every 5xx again unless told not to: the model raising on an
        # input, or a size limit, fails the same way each time (its call ran twice more).
        headers[NO_RETRY_HEADER] = "false"
    return HttpError(code, status.message, headers)
