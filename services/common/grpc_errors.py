"""The one place where domain errors become gRPC statuses (a server interceptor)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services.common.errors import ServingError

log = logging.getLogger(__name__)


def _wrap_unary(behaviour: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behaviour(request, context)
        except ServingError as error:
            await context.abort(error.code, str(error), trailing_metadata=error.trailers())
        except Exception:
            # Anything else is our bug: log it with the stack, answer INTERNAL, keep serving.
            log.exception("unhandled error in %s", getattr(behaviour, "__qualname__", behaviour))
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    return wrapped


def _wrap_stream(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a handler that returns a response stream (unary-stream or stream-stream)."""

    async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for message in behaviour(request_or_iterator, context):
                yield message
        except ServingError as error:
            await context.abort(error.code, str(error), trailing_metadata=error.trailers())
        except Exception:
            log.exception("unhandled error in %s", getattr(behaviour, "__qualname__", behaviour))
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    return wrapped


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps `ServingError` subclasses raised by handlers to their gRPC status codes."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
