"""The one place where errors become gRPC statuses: `status_of`, used by the server interceptor
here and by multiplexed calls (services.common.multiplex), so a call is answered alike on
either path."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import InvalidInput, ServingError
from services.common.interceptors import Step, no_step, wrap_handler

log = logging.getLogger(__name__)


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


def status_of(error: BaseException) -> Status:
    """The status a call that raised `error` is answered with: a `ServingError`'s own code,
    message and trailers; CANCELLED when the caller went away (the task was cancelled, or the
    response stream closed under the handler); INTERNAL for anything else."""
    if isinstance(error, ServingError):
        return Status(error.code, str(error), error.trailers())
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return _CANCELLED
    return _INTERNAL


def is_bug(error: BaseException) -> bool:
    """True when `error` is none the domain raises on purpose: log it with its stack."""
    return not isinstance(error, ServingError | asyncio.CancelledError | GeneratorExit)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Answers each call that raised with `status_of` its error (logging our bugs); the
    outermost interceptor, so no handler calls `context.abort` itself."""

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        return wrap_handler(
            _parsing_in_handler(handler), lambda context: _answering_errors(method, context)
        )


class _Undecodable:
    """A request body that did not parse. grpc parses bodies before any interceptor runs and
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


def _parsing_in_handler(
    handler: grpc.RpcMethodHandler[Any, Any],
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` whose requests are parsed leniently and checked inside its behaviour."""
    parse = handler.request_deserializer
    if parse is None:
        return handler

    def lenient(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError:
            return _UNDECODABLE

    behaviour: Callable[..., Any] | None = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    if behaviour is None:
        return handler  # wrap_handler refuses it
    check: Callable[[Any], Any] = _parsed_each if handler.request_streaming else _parsed

    def checked(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        # Raises (at call time) inside the error-mapping wrapper that wrap_handler adds.
        return behaviour(check(request), context)

    if inspect.iscoroutinefunction(behaviour):
        # Keeps a coroutine handler one (wrap_handler tells a streaming handler that writes
        # with context.write from an async generator by that).
        async def checked_coroutine(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> Any:
            return await behaviour(check(request), context)

        checked = checked_coroutine

    factory = HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(checked, lenient, handler.response_serializer)


def _parsed(request: Any) -> Any:
    if request is _UNDECODABLE:
        raise InvalidInput("request body does not parse as the method's request message")
    return request


async def _parsed_each(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _parsed(request)


@contextlib.asynccontextmanager
async def _answering_errors(
    method: str, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Step]:
    try:
        yield no_step
    except grpc.aio.AbortError:
        raise  # already answered (an inner interceptor aborted): its status stands
    except Exception as error:
        # Cancellation is not caught: grpc itself answers a call whose caller went away.
        if is_bug(error):
            log.exception("unhandled error in %s", method)
        status = status_of(error)
        await context.abort(status.code, status.message, trailing_metadata=status.trailers)
