"""A worker's gRPC front (`--front-processes N`): the API-server half of vLLM's API-server /
engine split.

A worker with N fronts is N + 1 processes. The engine (`python -m services.gpu_worker`) owns
the models, the batcher, admission and the device; it serves gRPC only on a Unix socket of its
own, and starts N fronts (services.gpu_worker.fronts) bound to the worker's port with
SO_REUSEPORT, so the kernel spreads routers' connections over them. A front parses nothing:

- an InferStream (every bundle a router sends) is relayed as frames to the engine's link
  (services.common.frames, services.gpu_worker.engine_link): one Unix-socket connection per
  stream, each message's bytes passed on as they came;
- every other method of WorkerService (Infer, Generate, ListModels) is passed on as bytes to
  the engine's gRPC socket, with the caller's metadata and time left, and its status and
  trailers passed back;
- its health follows the engine's, asked twice a second over the engine's socket:
  NOT_SERVING while the engine loads, drains, has failed, cannot be reached or does not
  answer (a wedged engine). An engine that has not answered for ENGINE_LOST_S (stopped, or
  its event loop stuck) ends the streams relayed to it and the calls passed on to it
  UNAVAILABLE, and has new ones refused (marked not started) until it answers again: the
  router's keepalive pings reach the front, which answers them, so without this the calls on
  those streams waited for their deadlines instead of failing over.

A front dies with its engine (SIGTERM on the engine's exit). On SIGTERM a front turns
NOT_SERVING, sends its connections GOAWAY (a router's next streams land on another front),
tells each stream's router `closing` (the router half-closes once its calls are answered) and
stops once its streams and the calls it passed on (a generation's stream among them) have
ended, or after the drain grace.

    python -m services.gpu_worker.front --engine-dir DIR --engine-pid PID <worker settings>
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2

from services.common import event_loop
from services.common.beats import beat, beat_file
from services.common.channel_options import channel_options
from services.common.errors import NOT_STARTED_TRAILER
from services.common.lifecycle import (
    NOT_SERVING,
    SERVING,
    add_health_and_reflection,
    bound_stop,
    exit_stopped,
    new_server,
    set_serving,
    start_metrics,
    stop_event,
    write_ready_file,
)
from services.common.logs import configure_logging
from services.common.multiplex import STREAM_METHOD, found_no_connection
from services.common.processes import PR_SET_PDEATHSIG
from services.common.telemetry import tier_registry
from services.common.tls import add_port, start_health_listener
from services.gpu_worker.config import WorkerConfig, parse_config
from services.gpu_worker.stream_relay import (
    ENGINE_LOST_DETAILS,
    ENGINE_LOST_S,
    FrontMetrics,
    StreamRelay,
)
from services.pb.inference.v1 import worker_pb2 as pb

log = logging.getLogger("services.gpu_worker.front")

SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"]
#: The engine's sockets, in the directory it passes its fronts.
ENGINE_GRPC_SOCKET = "engine.sock"
ENGINE_LINK_SOCKET = "link.sock"
#: Metadata a front does not pass on: HTTP/2's and grpc's own, which the next call sets.
_OWN_METADATA = ("user-agent", "te", "content-type")
#: How often a front asks its engine's health, and how long it waits for the answer.
HEALTH_PERIOD_S = 0.5
HEALTH_TIMEOUT_S = 2.0


def engine_grpc_target(engine_dir: Path) -> str:
    return f"unix:{engine_dir / ENGINE_GRPC_SOCKET}"


def _forwarded(metadata: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(
        (key, value)
        for key, value in metadata or ()
        if not key.startswith((":", "grpc-")) and key not in _OWN_METADATA
    )


class Passthrough(grpc.GenericRpcHandler):
    """WorkerService, served by passing each call on to the engine: InferStream through the
    relay, the other methods as bytes over the engine's gRPC socket."""

    def __init__(
        self, channel: grpc.aio.Channel, relay: StreamRelay, metrics: FrontMetrics
    ) -> None:
        self._channel = channel
        self._relay = relay
        self._calls_total = metrics.calls_total
        #: The calls passed on to the engine and not yet ended.
        self._passed: set[grpc.aio.Call] = set()
        self._is_engine_lost = False
        self._handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        for method in SERVICE.methods:
            name = f"/{SERVICE.full_name}/{method.name}"
            if name == STREAM_METHOD:
                self._handlers[name] = grpc.stream_stream_rpc_method_handler(relay.relay)
            elif method.server_streaming:
                self._handlers[name] = grpc.unary_stream_rpc_method_handler(self._streamed(name))
            else:
                self._handlers[name] = grpc.unary_unary_rpc_method_handler(self._unary(name))

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        return self._handlers.get(handler_call_details.method)

    def set_engine_lost(self, is_lost: bool) -> None:
        """While the engine is lost (ENGINE_LOST_S unanswered), the calls passed on to it end
        UNAVAILABLE (their routers fail them over) and new ones are refused, marked not
        started, as the relay's streams are. Before, they waited for the front's keepalive to
        fail the engine's connection, and a new one for its deadline."""
        self._relay.set_engine_lost(is_lost)
        if is_lost and not self._is_engine_lost:
            for call in self._passed:
                call.cancel()
        self._is_engine_lost = is_lost

    async def _pass_on(self, context: grpc.aio.ServicerContext) -> None:
        """Refuses the call, marked not started, while the engine is lost."""
        if self._is_engine_lost:
            not_started = (NOT_STARTED_TRAILER,)
            await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_LOST_DETAILS, not_started)

    async def _cut(self, call: grpc.aio.Call, context: grpc.aio.ServicerContext) -> None:
        """Ends the caller's call UNAVAILABLE if `call` was cancelled because the engine was
        lost (not because the caller went away: then the handler's task is being cancelled)."""
        task = asyncio.current_task()
        if call.cancelled() and self._is_engine_lost and not (task and task.cancelling()):
            await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_LOST_DETAILS)

    def _unary(self, name: str) -> Callable[[bytes, grpc.aio.ServicerContext], Any]:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(name)

        counted = self._calls_total.labels(name)

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            counted.inc()
            await self._pass_on(context)
            passed = call(
                request,
                timeout=context.time_remaining(),
                metadata=_forwarded(context.invocation_metadata()),
            )
            self._passed.add(passed)
            try:
                return bytes(await passed)
            except grpc.aio.AioRpcError as error:
                await _pass_back(error, context)
                raise  # not reached: abort raises
            except asyncio.CancelledError:
                await self._cut(passed, context)
                raise
            finally:
                self._passed.discard(passed)

        return handle

    def _streamed(self, name: str) -> Callable[..., AsyncIterator[bytes]]:
        call: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = self._channel.unary_stream(name)

        counted = self._calls_total.labels(name)

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            counted.inc()
            await self._pass_on(context)
            responses = call(
                request,
                timeout=context.time_remaining(),
                metadata=_forwarded(context.invocation_metadata()),
            )
            self._passed.add(responses)
            try:
                async for response in responses:
                    yield bytes(response)
            except grpc.aio.AioRpcError as error:
                await _pass_back(error, context)
            except asyncio.CancelledError:
                await self._cut(responses, context)
                raise
            finally:  # the caller went away: so does the engine's call
                self._passed.discard(responses)
                responses.cancel()

        return handle


async def _pass_back(error: grpc.aio.AioRpcError, context: grpc.aio.ServicerContext) -> None:
    """Ends the call as the engine ended it: its code, message and trailers; marked not
    started where it never reached the engine (its socket refused: not up yet, or just gone),
    as a stream is (stream_relay), so that the router sends it to another worker at once."""
    trailers = _forwarded(error.trailing_metadata())
    if found_no_connection(error) and NOT_STARTED_TRAILER not in trailers:
        trailers += (NOT_STARTED_TRAILER,)
    await context.abort(error.code(), error.details() or "", trailers)


_HEALTH_REQUEST = health_pb2.HealthCheckRequest(service=SERVICE.full_name)


def engine_health(channel: grpc.aio.Channel) -> Callable[[], Awaitable[int | None]]:
    """Asks the engine its health for WorkerService, once a call (None: out of reach, or no
    answer within HEALTH_TIMEOUT_S); the method is made once, not per poll."""
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )

    async def ask() -> int | None:
        try:
            return int((await check(_HEALTH_REQUEST, timeout=HEALTH_TIMEOUT_S)).status)
        except grpc.aio.AioRpcError as error:
            log.debug("the engine's health is out of reach: %s", error.code())
            return None

    return ask


async def follow_engine_health(
    channel: grpc.aio.Channel,
    servicer: health.aio.HealthServicer,
    on_first_serving: Callable[[], None],
    on_engine_lost: Callable[[bool], None] = lambda _: None,
) -> None:
    """Mirrors the engine's health for WorkerService until cancelled, asking every
    HEALTH_PERIOD_S: NOT_SERVING while the engine cannot be reached or does not answer
    within HEALTH_TIMEOUT_S (a wedged engine fails its fronts' probes, as it would its own).
    `on_engine_lost(True)` once it has not answered for ENGINE_LOST_S, (False) once it does."""
    names = (SERVICE.full_name,)
    ask_health = engine_health(channel)
    saw_serving = False
    answered_s = time.monotonic()
    while True:
        asked_s = time.monotonic()
        status = await ask_health()
        if status is None:
            status = NOT_SERVING
        else:
            answered_s = asked_s
        on_engine_lost(time.monotonic() - answered_s >= ENGINE_LOST_S)
        await set_serving(servicer, names, status)
        if status == SERVING and not saw_serving:
            try:  # its failure (a full disk) must not end the following: tried again next poll
                on_first_serving()
                saw_serving = True
            except OSError as error:
                log.warning("could not say the engine is serving: %s", error)
        await asyncio.sleep(HEALTH_PERIOD_S)


async def serve(config: WorkerConfig, engine_dir: Path) -> NoReturn:
    options = (*channel_options(), ("grpc.max_send_message_length", config.max_message_bytes))
    channel = grpc.aio.insecure_channel(engine_grpc_target(engine_dir), options=options)
    server = new_server(
        is_internal=True,
        max_message_bytes=config.max_message_bytes,
        max_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    registry = tier_registry("worker_front")
    metrics = FrontMetrics(registry)
    relay = StreamRelay(engine_dir / ENGINE_LINK_SOCKET, metrics)
    passthrough = Passthrough(channel, relay, metrics)
    server.add_generic_rpc_handlers((passthrough,))
    servicer = await add_health_and_reflection(server, (SERVICE.full_name,))
    # The engine's health before the port takes probes: a front restarted beside serving ones
    # said NOT_SERVING until its first poll, and a readiness probe it drew took the worker's
    # pod out of its Service (one failure does). At the first start the engine says
    # NOT_SERVING anyway: it waits for its fronts to listen.
    if await engine_health(channel)() == SERVING:
        await set_serving(servicer, (SERVICE.full_name,), SERVING)
    port = add_port(server, f"{config.host}:{config.grpc_port}", config.tls)
    await server.start()
    health_listener = await start_health_listener(servicer, config.host, config.tls, server)
    metrics_port = start_metrics(config.metrics_port, config.host, registry)
    stopping = stop_event()
    # Ready once listening, and said again once serving: the engine waits for the first before
    # it turns SERVING, and for the second before it reports the worker ready.
    write_ready_file(config.ready_file, port, metrics_port)
    loop = asyncio.get_running_loop()
    # The engine always names a ready file; a front started by hand may not (no engine beats).
    beating = None if config.ready_file is None else loop.create_task(
        beat(beat_file(config.ready_file))
    )  # fmt: skip
    following = loop.create_task(
        follow_engine_health(
            channel,
            servicer,
            lambda: write_ready_file(config.ready_file, port, metrics_port, serving=1),
            passthrough.set_engine_lost,
        )
    )
    log.info("worker front on %s:%d, metrics on %d", config.host, port, metrics_port)
    await stopping.wait()
    # Bounded, as every tier's stop: a front whose engine died (SIGTERM from the kernel) has
    # no engine to SIGKILL it past its wait, and an orphan outlived it (review finding).
    bound_stop(config.drain_grace_s + 1.0)
    following.cancel()
    if health_listener is not None:
        # First: the health port is shared (SO_REUSEPORT) with the other fronts, which still
        # serve, and a probe that lands here must not read this front's NOT_SERVING as the
        # worker's (a front stopped alone; a whole worker's stop has its engine NOT_SERVING).
        await health_listener.stop(grace=None)
    await servicer.enter_graceful_shutdown()
    # grpc's own stop first: it tells every connection GOAWAY at once, so that the streams a
    # router opens from now on land on another front (over a new connection) instead of this
    # one, and waits for the calls running here (relayed streams, calls passed on), at most
    # the drain grace and a second (what the engine ends at its own grace, a generation it
    # cuts UNAVAILABLE, reaches the caller with the engine's status, not cut here first).
    # Then each relayed stream's router is told `closing`.
    grace_s = config.drain_grace_s + 1.0
    server_stopped = asyncio.get_running_loop().create_task(server.stop(grace=grace_s))
    await asyncio.sleep(0)
    relay.stop()
    await server_stopped
    await channel.close()
    if beating is not None:
        beating.cancel()
    log.info("worker front stopped")
    exit_stopped(0)  # no interpreter teardown, which can block on grpc's threads


def die_with(engine_pid: int) -> None:
    """SIGTERM when the engine exits (the kernel ties it to the thread that started us: the
    engine's main thread); exits now if the engine is already gone. Set here, not in a
    `preexec_fn` as the gateway group's supervisor does: the engine runs threads (torch's,
    grpc's), and code between fork and exec in a threaded process may deadlock."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != engine_pid:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gpu_worker.front", add_help=False)
    parser.add_argument("--engine-dir", type=Path, required=True)
    parser.add_argument("--engine-pid", type=int, required=True)
    own, rest = parser.parse_known_args(argv)
    die_with(own.engine_pid)
    config = parse_config(rest)
    configure_logging("gpu_worker_front", config.logging)
    event_loop.run(serve(config, own.engine_dir), config.event_loop)


if __name__ == "__main__":
    main()
