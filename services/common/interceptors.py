"""The one way a server interceptor wraps a method handler, whatever its shape.

An interceptor says what it does around one call as an async context manager (`Around`):
entered when the call starts, exited with the call's outcome (an exception, or none). The
context manager yields a `Step`, entered around each stretch of the handler's own work: the
whole of a unary-response handler, and each step of a streaming one up to its next message.
Nothing a step sets is held across a `yield`: a stream abandoned mid-way is closed later, from
another context, where a context token held over a yield could not be detached.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

import grpc

#: Entered around each stretch of the handler's own work (see the module docstring).
Step = Callable[[], AbstractContextManager[object]]
#: What an interceptor does around one call, given the call's context.
Around = Callable[[grpc.aio.ServicerContext[Any, Any]], AbstractAsyncContextManager[Step]]


def wrap_handler(
    handler: grpc.RpcMethodHandler[Any, Any], around: Around
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` with `around` wrapped about each of its calls; same shape and serializers.

    The grpc stubs type handlers as sync callables; under grpc.aio they are coroutine
    functions (unary response) or async generator functions (streaming response)."""
    deserialize, serialize = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _unary_response(handler.unary_unary, around), deserialize, serialize
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _unary_response(handler.stream_unary, around), deserialize, serialize
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _streaming_response(handler.unary_stream, around), deserialize, serialize
        )
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            _streaming_response(handler.stream_stream, around), deserialize, serialize
        )
    # Fail closed: a handler this cannot wrap would run without auth, tracing or mapping.
    raise TypeError(f"method handler {handler!r} has no behaviour to wrap")


def _unary_response(behaviour: Callable[..., Any], around: Around) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        async with around(context) as step:
            with step():
                return await behaviour(request, context)

    return wrapped


def _streaming_response(behaviour: Callable[..., Any], around: Around) -> Callable[..., Any]:
    """A streaming handler is an async generator, or a coroutine that sends its messages with
    `context.write` (grpcio's own health Watch): the latter is wrapped as a whole, like a
    unary-response handler, in the style grpc expects of it."""
    if inspect.iscoroutinefunction(behaviour):
        return _unary_response(behaviour, around)

    async def wrapped(
        request_or_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async with around(context) as step:
            responses = behaviour(request_or_iterator, context)
            try:
                while True:
                    with step():
                        try:
                            message = await anext(responses)
                        except StopAsyncIteration:
                            return
                    yield message
            finally:
                # Closed here, not left to the garbage collector: the handler's own cleanup
                # (freeing KV blocks, cancelling a downstream call) runs before the call ends.
                await responses.aclose()

    return wrapped


def no_step() -> AbstractContextManager[object]:
    """The `Step` of an interceptor that does nothing per step."""
    return contextlib.nullcontext()
