"""The server interceptor's answer rule (services.common.interceptors) for a stream its caller
abandoned: grpc closes the stream's generator at its `yield`, maybe later from another task,
and whatever the handler's cleanup raises then is never answered (the call is over). The
whole interceptor over real servers is tests/integration/test_interceptors.py; this one path
cannot be timed there, so the wrapped handler is driven here directly, with a context that
records what it is asked to answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc
import pytest

from services.common.interceptors import ServerCalls

pytestmark = pytest.mark.unit


class Details(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class Context:
    """The parts of a grpc.aio servicer context the wrapper uses."""

    def __init__(self) -> None:
        self.answered: list[grpc.StatusCode] = []

    def code(self) -> grpc.StatusCode | None:
        return None

    def time_remaining(self) -> float | None:
        return None  # no deadline

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata: Any = ()) -> None:
        self.answered.append(code)
        raise grpc.aio.AbortError()


async def _wrapped(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    async def continuation(_: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return handler

    wrapped = await ServerCalls().intercept_service(continuation, Details("/t.S/Stream", ()))
    assert wrapped is not None
    return wrapped


async def test_a_stream_closed_after_its_caller_left_is_not_answered() -> None:
    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        try:
            yield b"one"
            yield b"two"
        finally:
            # Cleanup that awaits something already cancelled (a downstream call torn down).
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            await future

    wrapped = await _wrapped(grpc.unary_stream_rpc_method_handler(stream))
    context = Context()
    messages = wrapped.unary_stream(b"", context)
    assert await anext(messages) == b"one"

    async def close_later() -> None:  # as asyncio's finalizer does, from a task of its own
        await messages.aclose()

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(close_later())

    assert context.answered == []


async def test_a_stream_whose_own_await_was_cancelled_is_answered_internal() -> None:
    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"one"
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        await future

    wrapped = await _wrapped(grpc.unary_stream_rpc_method_handler(stream))
    context = Context()

    with pytest.raises(grpc.aio.AbortError):
        _ = [message async for message in wrapped.unary_stream(b"", context)]

    assert context.answered == [grpc.StatusCode.INTERNAL]
