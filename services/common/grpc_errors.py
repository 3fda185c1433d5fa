"""The one place where errors become gRPC statuses: `status_of`, used by the server interceptor
(services.common.interceptors) and by multiplexed calls (services.common.multiplex), so a call
is answered alike on either path; and the lenient parsing that turns a body that does not
parse into InvalidInput."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import InvalidInput, ServingError


@dataclass(frozen=True)
class Status:
    """The status one call is answered with."""

    code: grpc.StatusCode
    #: What the caller reads: the domain error's own words, never a stack or internals.
    message: str
    #: Trailing metadata sent with the status (the retry hint of RESOURCE_EXHAUSTED).
    trailers: tuple[tuple[str, str], ...] = ()


#: Answer to any error that is not a ServingError: our bug, whose details stay in our logs.
_INTERNAL = Status(grpc.StatusCode.INTERNAL, "internal error")
#: Answer to a call whose caller went away (it is rarely read: nobody is waiting).
_CANCELLED = Status(grpc.StatusCode.CANCELLED, "cancelled by the caller")


#: Most UTF-8 bytes of a status message: grpc's clients refuse trailers past 8 KiB by default,
#: so a message echoing a caller's input whole (a name of 50,000 characters) turned its status
#: into their RESOURCE_EXHAUSTED (review finding); percent-encoded, this many stay under.
MAX_STATUS_MESSAGE_BYTES = 2_000


def bounded_message(message: str) -> str:
    """`message`, cut to MAX_STATUS_MESSAGE_BYTES (at a character's end) with a note."""
    if len(message) <= MAX_STATUS_MESSAGE_BYTES // 4:  # a character is 4 bytes at most
        return message
    # A lone surrogate (JSON may escape one into a caller's text the message echoes) has no
    # UTF-8: escaped, not raised, or the error's own answer failed (HTTP 500).
    encoded = message.encode(errors="backslashreplace")
    if len(encoded) <= MAX_STATUS_MESSAGE_BYTES:
        return message
    kept = encoded[:MAX_STATUS_MESSAGE_BYTES].decode(errors="ignore")
    return f"{kept}... ({len(encoded) - len(kept.encode())} bytes cut)"


#: A network address, as grpc's own errors name a peer ("ipv4:10.0.3.4:7001",
#: "ipv6:%5Bfd00::1%5D:7001", "unix:/run/w.sock", "DNS resolution failed for w.svc:7001") and
#: as ours name a worker's link ("10.0.3.4:7001"); not a version's "@1.2.3.4".
_ADDRESS = re.compile(
    r"\b(?:ipv4|ipv6|unix|unix-abstract|dns):[^\s,;]*[^\s,;:]"
    r"|(?<=resolution failed for )[^\s,;]*[^\s,;:]"
    r"|(?<![@\w.])\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?(?!\w|\.\d|:\d)"
    # Bracketed IPv6: not after a name or a bracket (a slice, `x[::2]`), and with "::", a hex
    # letter or a zone, or a port after it (not a time, `[12:30:45]`, or a range `[0:10:2]`).
    r"|(?<![\w\])])\[(?=[^\]]*(?:::|[A-Fa-f%]))(?:[0-9A-Fa-f]{0,4}:){2,}[0-9A-Fa-f.%]*\]"
    r"(?::\d+)?(?!\w)"
)


def without_addresses(message: str) -> str:
    """`message` with every network address in it replaced by "<address>". A status reaches
    callers outside the fabric (a downstream failure passes through every tier, in grpc's
    words: "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.3.4:7001: ..."),
    and where the tiers live inside the cluster is none of theirs (review finding); the tier
    that met the failure logs it whole."""
    if ":" not in message and "." not in message:
        return message
    return _ADDRESS.sub("<address>", message)


def code_of(error: BaseException) -> grpc.StatusCode:
    """The code `status_of(error)` has, without building its message (counting a call's
    outcome needs only the code)."""
    if isinstance(error, ServingError):
        return error.code
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


def status_of(error: BaseException) -> Status:
    """The status a call that raised `error` is answered with: a `ServingError`'s own code,
    message (bounded_message) and trailers; CANCELLED when the caller went away (the task was
    cancelled, or the response stream closed under the handler); INTERNAL for anything else. No
    message names a network address (`without_addresses`)."""
    if isinstance(error, ServingError):
        return Status(error.code, bounded_message(without_addresses(str(error))), error.trailers())
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return _CANCELLED
    return _INTERNAL


def answerable(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError in place of a CancelledError that the current task was not
    asked for (an awaited future something else cancelled): the call it interrupted still has
    a caller waiting, so it is answered as our bug (INTERNAL). The task's own cancellation
    (the caller went away, the server is stopping) stays as it is: no one is answered."""
    if isinstance(error, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is not None and not task.cancelling():
            return RuntimeError(f"a cancellation the call did not ask for ({error!r})")
    return error


def is_bug(error: BaseException) -> bool:
    """True when `error` is none the domain raises on purpose: log it with its stack."""
    return not isinstance(error, ServingError | asyncio.CancelledError | GeneratorExit)


class _Undecodable:
    """A request body that did not parse. grpc parses a body before its handler runs and
    answers a parse error UNKNOWN; parsed leniently, the failure reaches the handler instead,
    which raises InvalidInput on meeting it (INVALID_ARGUMENT, like every other bad input)."""


_UNDECODABLE = _Undecodable()

#: grpc's handler constructor for each (request_streaming, response_streaming) shape.
HANDLER_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`parse` that answers a body it cannot parse with a marker instead of raising; the
    handler's `parsed` (or `parsed_each`) raises InvalidInput on meeting it."""

    def parse_leniently(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError:
            return _UNDECODABLE

    return parse_leniently


def parsed(request: Any) -> Any:
    """`request`, or InvalidInput when its body did not parse (see `lenient`)."""
    if request is _UNDECODABLE:
        raise InvalidInput("request body does not parse as the method's request message")
    return request


async def parsed_each(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Each request of a stream, as `parsed`."""
    async for request in requests:
        yield parsed(request)
