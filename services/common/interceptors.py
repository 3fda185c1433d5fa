"""Every call's error mapping, tracing and authentication, in one server interceptor.

A server's concerns around a call are `Stage`s (tracing, authentication), run by one
interceptor, `ServerCalls`, with error mapping built in: per call it builds one wrapped handler
whatever the number of stages, where a chain of interceptors built one per interceptor, each
with its own continuation coroutine and async context manager (together about half a bare
call's CPU, on the gateway's hot path). Per call, each stage may open a `Scope`:
- `enter` when the handler starts, in the call's own task, and `exit` with the status the call
  is answered with, in reverse order (before it is sent, unless the handler sent it itself
  with `context.abort`); a call whose handler never starts (its body never arrived) has
  neither;
- `attach` before each stretch of the handler's own work and `detach` after it: the whole of
  a unary-response handler, and each step of a streaming one up to its next message. Nothing
  attached is held across a `yield`: a stream abandoned mid-way is closed later, from another
  context, where a context token held over a yield could not be detached.
A stage refuses a call by raising a ServingError from `scope`, before the body is parsed; the
refusal is raised inside the call, so the scopes opened before it (its span) see it like any
other failed call.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

import grpc

from services.common.errors import ServingError
from services.common.grpc_errors import (
    HANDLER_FACTORIES,
    answerable,
    code_of,
    is_bug,
    lenient,
    parsed,
    parsed_each,
    status_of,
)
from services.common.telemetry import DEADLINE_SLACK_S

log = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, Any]]
Continuation = Callable[
    [grpc.HandlerCallDetails], Awaitable["grpc.RpcMethodHandler[Any, Any] | None"]
]


class Scope(Protocol):
    """What one stage does around one call (see the module docstring)."""

    def enter(self) -> None: ...
    def attach(self) -> object: ...
    def detach(self, token: object) -> None: ...
    def exit(self, code: grpc.StatusCode, error: BaseException | None) -> None: ...


class Stage(Protocol):
    """One concern of every call: `scope` is asked once per call, when it arrives."""

    def scope(self, method: str, metadata: Metadata) -> Scope | None:
        """The call's scope, or None when this stage has nothing to do for it; raises a
        ServingError to refuse the call."""


class _Method:
    """What every call of one method shares: its handler's behaviour, its shape, and how its
    requests are checked (a body that did not parse reaches the handler as InvalidInput)."""

    def __init__(self, handler: grpc.RpcMethodHandler[Any, Any]) -> None:
        behaviour = (
            handler.unary_unary or handler.unary_stream or handler.stream_unary
            or handler.stream_stream
        )  # fmt: skip
        if behaviour is None:
            # Fail closed: a handler this cannot wrap would run without auth or tracing.
            raise TypeError(f"method handler {handler!r} has no behaviour to wrap")
        self.source = handler
        self.behaviour: Callable[..., Any] = behaviour
        shape = (handler.request_streaming, handler.response_streaming)
        self.factory = HANDLER_FACTORIES[shape]
        # A refused call's handler never reads its requests, so grpc runs it at once, before
        # any body arrives: one a caller never sends holds no place (the door's, grpc's).
        self.refusing_factory = HANDLER_FACTORIES[(True, handler.response_streaming)]
        self.check: Callable[[Any], Any] = parsed_each if handler.request_streaming else parsed
        self.serialize = handler.response_serializer
        # A streaming handler that writes with `context.write` from a coroutine (grpcio's own
        # health Watch) is wrapped as a whole, like a unary-response one.
        self.wraps_whole = not handler.response_streaming or inspect.iscoroutinefunction(behaviour)
        parse = handler.request_deserializer
        self.deserialize = None if parse is None else lenient(parse)


def _unparsed(_body: bytes) -> None:
    """The request deserializer of a refused call: its body is never parsed."""
    return None


class ServerCalls(grpc.aio.ServerInterceptor):
    """Runs `stages` around every call and answers each call that raised with `status_of` its
    error (logging our bugs), so no handler calls `context.abort` itself."""

    def __init__(self, stages: Iterable[Stage] = ()) -> None:
        self._stages = tuple(stages)
        self._methods: dict[str, _Method] = {}

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None:
            return None
        name: str = details.method
        method = self._methods.get(name)
        if method is None or method.source is not handler:
            method = self._methods[name] = _Method(handler)
        metadata = details.invocation_metadata or ()
        scopes: list[Scope] = []
        refusal: ServingError | None = None
        for stage in self._stages:
            try:
                scope = stage.scope(name, metadata)
            except ServingError as error:
                refusal = error
                break
            if scope is not None:
                scopes.append(scope)
        wrap = _whole if method.wraps_whole else _streaming
        behaviour = wrap(name, method, tuple(scopes), refusal)
        if refusal is not None:  # answered at once, whether or not a body ever comes
            return method.refusing_factory(behaviour, _unparsed, method.serialize)
        return method.factory(behaviour, method.deserialize, method.serialize)


def _whole(
    name: str, method: _Method, scopes: tuple[Scope, ...], refusal: ServingError | None
) -> Callable[..., Awaitable[Any]]:
    behaviour, check = method.behaviour, method.check

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        for scope in scopes:
            scope.enter()
        code: grpc.StatusCode = grpc.StatusCode.OK
        error: BaseException | None = None
        answer: Exception | None = None
        tokens = _attach(scopes)
        try:
            if refusal is not None:
                raise refusal
            result = await behaviour(check(request), context)
            code = context.code() or grpc.StatusCode.OK
            return result
        except grpc.aio.AbortError as aborted:
            code, error = context.code() or grpc.StatusCode.UNKNOWN, aborted
            raise
        except BaseException as raised:
            code, error, answer = _failed(name, raised, context)
            raise
        finally:
            _detach(scopes, tokens)
            _exit(scopes, code, error)
            if answer is not None:
                await _answer(context, answer)

    return call


def _streaming(
    name: str, method: _Method, scopes: tuple[Scope, ...], refusal: ServingError | None
) -> Callable[..., AsyncIterator[Any]]:
    behaviour, check = method.behaviour, method.check

    async def call(
        request_or_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        for scope in scopes:
            scope.enter()
        code: grpc.StatusCode = grpc.StatusCode.OK
        error: BaseException | None = None
        answer: Exception | None = None
        is_abandoned = False
        try:
            if refusal is not None:
                raise refusal
            responses = behaviour(check(request_or_iterator), context)
            try:
                while True:
                    tokens = _attach(scopes)
                    try:
                        message = await anext(responses)
                    except StopAsyncIteration:
                        break
                    finally:
                        _detach(scopes, tokens)
                    try:
                        yield message
                    except GeneratorExit:
                        is_abandoned = True
                        raise
            finally:
                # Closed here, not left to the garbage collector: the handler's own cleanup
                # (freeing KV blocks, cancelling a downstream call) runs before the call ends.
                await responses.aclose()
            code = context.code() or grpc.StatusCode.OK
        except grpc.aio.AbortError as aborted:
            code, error = context.code() or grpc.StatusCode.UNKNOWN, aborted
            raise
        except BaseException as raised:
            # Attached again, so that a bug's log line carries the call's trace and request id.
            tokens = _attach(scopes)
            try:
                code, error, answer = _failed(name, raised, context, is_abandoned=is_abandoned)
            finally:
                _detach(scopes, tokens)
            raise
        finally:
            _exit(scopes, code, error)
            if answer is not None:
                await _answer(context, answer)

    return call


def _attach(scopes: tuple[Scope, ...]) -> list[object]:
    return [scope.attach() for scope in scopes]


def _detach(scopes: tuple[Scope, ...], tokens: list[object]) -> None:
    for scope, token in zip(reversed(scopes), reversed(tokens), strict=True):
        scope.detach(token)


def _failed(
    name: str,
    raised: BaseException,
    context: grpc.aio.ServicerContext[Any, Any],
    *,
    is_abandoned: bool = False,
) -> tuple[grpc.StatusCode, BaseException, Exception | None]:
    """The status code of a call whose handler raised `raised`, and the error to answer it
    with: `raised` itself when it is an error (logged with its stack when it is our bug); a
    cancellation the call did not ask for as our bug (`answerable`); none when the call itself
    was cancelled (its caller went away, or the server stopped), which grpc answers, nor for a
    stream its caller abandoned (closed at a `yield`, maybe later from another task: whatever
    its cleanup raises, the call is over). A call cancelled at its deadline is
    DEADLINE_EXCEEDED, as its caller was told and its counters count it: its span and access
    line said CANCELLED (review finding)."""
    if is_abandoned:
        return _cancelled_code(context), raised, None
    error = answerable(raised)
    if is_bug(error):
        log.error("unhandled error in %s", name, exc_info=raised)
    answer = error if isinstance(error, Exception) else None
    code = code_of(error)
    return _cancelled_code(context) if code == grpc.StatusCode.CANCELLED else code, raised, answer


def _cancelled_code(context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
    """CANCELLED, or DEADLINE_EXCEEDED for a call cancelled at its deadline (grpc cancels a
    handler then too; within DEADLINE_SLACK_S of it, as `given_up_by` judges it)."""
    left_s = context.time_remaining()
    if left_s is not None and left_s <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def _exit(scopes: tuple[Scope, ...], code: grpc.StatusCode, error: BaseException | None) -> None:
    for scope in reversed(scopes):
        scope.exit(code, error)


async def _answer(context: grpc.aio.ServicerContext[Any, Any], error: Exception) -> None:
    """Answers the call with `error`'s status (abort raises AbortError, which replaces the
    error being raised)."""
    status = status_of(error)
    await context.abort(status.code, status.message, trailing_metadata=status.trailers)
