"""The one place where errors become gRPC statuses: `status_of`, used by the server interceptor
here and by multiplexed calls (services.common.multiplex), so a call is answered alike on
either path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.errors import ServingError
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
        return wrap_handler(handler, lambda context: _answering_errors(method, context))


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
