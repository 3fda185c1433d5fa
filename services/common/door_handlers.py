"""The door's handlers (services.common.door): the methods it guards, and the answers it gives
without running a method: a refusal, a probe's answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.grpc_errors import HANDLER_FACTORIES


@dataclass(frozen=True)
class MethodShape:
    """Whether a method streams its responses (its requests, the door never reads), and
    whether the door only sheds its calls: refused over their caller's share while the queue
    stands, never at the limit, never counted in flight nor probed. For calls too long-lived
    for a concurrency limit (a generation's stream, a stream of inferences), whose arrivals
    still lengthen the queue the door measures: unguarded, a flood of them made the door shed
    the guarded methods' callers, the flood's own calls passing."""

    response_streaming: bool = False
    shed_only: bool = False


def handler(
    shape: MethodShape, answer: Callable[[grpc.aio.ServicerContext[Any, Any]], None]
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler answering as `shape` says that only calls `answer(context)`: no deserializer
    and no serializer (a unary answer is an empty message). It takes the request as a stream
    it never reads (a unary request crosses the wire as a stream of one message), so grpc.aio
    runs it without first waiting for the message: a door refusal cost 14% less of the
    server's CPU (`python -m bench.server_calls door-refusing`, side by side)."""

    async def stream(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        answer(context)
        return
        yield  # an async generator that sends no message

    async def unary(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        answer(context)
        return b""

    factory = HANDLER_FACTORIES[(True, shape.response_streaming)]
    return factory(stream if shape.response_streaming else unary)


def answer_probe(_: grpc.aio.ServicerContext[Any, Any]) -> None:
    """A probe's answer is OK and empty: what it measures is the wait before it."""
