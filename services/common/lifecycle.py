"""Process plumbing every tier shares: health + reflection, stop signals, metrics listener,
ready file."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import io
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from services.common.interceptors import ServerCalls, Stage
from services.common.loop_lag import LoopLag
from services.common.pending_calls import MAX_PENDING_CALLS, pending_call_options
from services.common.processes import shares_ports
from services.common.settings import Setting, unusable_port

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: Largest message between tiers (the internal tiers' default receive cap, and what internal
#: clients accept): routers and workers carry whole batches and multiplexed streams. The public
#: gateway receives far less (its own `max_message_bytes`). An oversized message gets
#: RESOURCE_EXHAUSTED from grpc before any handler runs.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Let clients' keepalive pings through however quiet a stream is (gRPC's defaults treat a ping
#: more often than every 5 min without data as abuse and close the connection). Tiers keep
#: long-lived streams to each other and ping them to notice a peer that vanished silently.
#: Internal servers only: the public gateway keeps gRPC's defaults against ping floods.
PING_TOLERANCE = (
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
)


def limit_settings(defaults: Any) -> tuple[Setting, ...]:
    """The server limits every tier has, defaults read from the tier's config class (its
    `max_message_bytes` and `max_concurrent_rpcs`)."""
    return (
        Setting(
            "max_message_bytes",
            int,
            defaults.max_message_bytes,
            "largest request message the gRPC server receives; larger ones get "
            "RESOURCE_EXHAUSTED before any parsing",
            "bytes",
        ),
        Setting(
            "max_concurrent_rpcs",
            int,
            defaults.max_concurrent_rpcs,
            "most calls (streams included) served at once; past it a call gets "
            "RESOURCE_EXHAUSTED; 0 means no limit",
            "calls",
        ),
    )


#: Connections' age (clients re-resolve) and the grace after it, past any call's deadline.
CONNECTION_AGE_MS, CONNECTION_AGE_GRACE_MS = 300_000, 600_000  # 30 s cut longer generations


def check_limits(
    max_message_bytes: int, max_concurrent_rpcs: int, max_pending_calls: int = 0
) -> None:
    """ValueError unless the limits are usable (a config's validation calls this)."""
    if not 1024 <= max_message_bytes < 2**31:  # grpc takes it as a C int
        raise ValueError(f"max_message_bytes must be in [1024, 2**31), got {max_message_bytes}")
    if max_concurrent_rpcs < 0:
        raise ValueError(
            f"max_concurrent_rpcs must be >= 0 (0: no limit), got {max_concurrent_rpcs}"
        )
    if not 0 <= max_pending_calls <= MAX_PENDING_CALLS:
        raise ValueError(
            f"max_pending_calls must be in [0, {MAX_PENDING_CALLS}] (0: grpc's default), got "
            f"{max_pending_calls}"
        )


def check_internal_limits(max_message_bytes: int, max_concurrent_rpcs: int) -> None:
    """`check_limits` for a tier its peers send whole multiplexed streams (routers, workers):
    their messages carry up to MAX_MESSAGE_BYTES, and one past a lower limit ends the whole
    stream, failing every call it carries, small ones too."""
    check_limits(max_message_bytes, max_concurrent_rpcs)
    if max_message_bytes < MAX_MESSAGE_BYTES:
        raise ValueError(
            f"max_message_bytes must be at least {MAX_MESSAGE_BYTES} on an internal tier "
            f"(its peers' stream messages carry up to that), got {max_message_bytes}"
        )


def new_server(
    stages: Iterable[Stage] = (),
    *,
    is_internal: bool = False,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    max_concurrent_rpcs: int = 0,
    max_pending_calls: int = 0,
    door: grpc.aio.ServerInterceptor | None = None,
) -> grpc.aio.Server:
    """A grpc.aio server running `stages` (tracing, authentication) around every call, in
    that order, with error mapping outside them all (services.common.interceptors), so errors
    raised by a stage (authentication's refusal) are mapped too. Internal servers (router,
    worker) also allow the keepalive pings of their callers' streams.

    grpc itself answers RESOURCE_EXHAUSTED a message over `max_message_bytes` (before any
    parser sees it) and a call past `max_concurrent_rpcs` at once (0: no limit; a stream counts
    as one call for its whole life). The latter only once the interceptors have run (grpc finds
    a call's handler first), so such a call has passed the door and the stages: at the gateway,
    its tenant's request token is spent. `door` (services.common.door), when given, is the
    first interceptor: its refusals cost no stage.

    `max_pending_calls` (0: grpc's own 1,000 and 3,000) bounds the calls grpc's C core holds
    that no Python has picked up yet: past it, grpc drops arrivals with a chance that grows to
    one at twice it (`pending_call_options`), before any Python runs for them."""
    check_limits(max_message_bytes, max_concurrent_rpcs, max_pending_calls)
    server = grpc.aio.server(
        interceptors=[
            *([door] if door is not None else []),
            ServerCalls(stages),
        ],
        maximum_concurrent_rpcs=max_concurrent_rpcs or None,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_connection_age_ms", CONNECTION_AGE_MS),
            ("grpc.max_connection_age_grace_ms", CONNECTION_AGE_GRACE_MS),
            *(PING_TOLERANCE if is_internal else ()),
            *pending_call_options(max_pending_calls),
            ("grpc.so_reuseport", int(shares_ports())),
        ],
    )
    serve_registered_as_generic(server)
    return server


#: Services a server keeps registered: grpc gives each registered method a queue of its own, so
#: health probes are picked up however many model calls wait (and are never among the calls
#: `pending_call_options` drops); a few more futures in grpc.aio's wait, not 35.
KEPT_REGISTERED = frozenset({health_pb2.DESCRIPTOR.services_by_name["Health"].full_name})


def serve_registered_as_generic(server: grpc.aio.Server) -> None:
    """Has `server` serve the methods it is given as pre-registered through generic handlers
    instead (the generated `add_*_to_server`, health and reflection give every service both
    ways), all but KEPT_REGISTERED's.

    grpc.aio's server keeps one request for the next call pending per registered method, and
    for every call it picks up waits on all of them again (`asyncio.wait` over one future per
    method, each given and taken back a done-callback): with the gateway's 35 methods, 23% of
    the Python and builtin calls its process made under 64 closed-loop callers (counted with
    `sys.setprofile`), and 27-75 us of server CPU per call, 4-12% (`bench.registered_methods`).
    With generic handlers there is one pending request for them all, whatever the methods.
    Calls are picked up one at a time either way; grpc's pending-call bound
    (`pending_call_options`) then counts the calls waiting at the process. The methods become a
    generic handler added after those already given, so where a generic handler of the same
    name was given first (as the generated code does), it answers, as a registered method
    would have; a catch-all generic handler given earlier answers them too."""
    add_registered = server.add_registered_method_handlers

    def add_registered_method_handlers(
        service_name: str, method_handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        if service_name in KEPT_REGISTERED:
            add_registered(service_name, method_handlers)
            return
        generic = grpc.method_handlers_generic_handler(service_name, dict(method_handlers))
        server.add_generic_rpc_handlers((generic,))

    server.add_registered_method_handlers = add_registered_method_handlers  # type: ignore[method-assign]


async def add_health_and_reflection(
    server: grpc.aio.Server, service_names: Iterable[str], *, status: int = NOT_SERVING
) -> health.aio.HealthServicer:
    """Registers grpc.health.v1 (overall "" and each service set to `status`) and reflection."""
    names = tuple(service_names)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *names):
        await servicer.set(name, status)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((*names, health_name, reflection.SERVICE_NAME), server)
    return servicer


async def set_serving(
    servicer: health.aio.HealthServicer, names: Iterable[str], status: int
) -> None:
    for name in ("", *names):
        await servicer.set(name, status)


def stop_if_cancelled() -> None:
    """Raises CancelledError in a task that was told to stop while a library call swallowed
    the cancellation. On Python 3.11, `asyncio.wait_for` returns the result of an awaitable
    that completed as the cancel arrived (redis-py writes each command through it when a
    socket timeout is set), and a library may turn a cancel into an error of its own (redis-py
    raises its timeouts as RedisError). A loop that goes on to sleep and run another round
    would never stop (a gateway's stop once waited on its routing sync, and a worker's on its
    repository follower, until the stop bound killed it). Call it where such a loop catches,
    after a read that decides what it does next, and before it sleeps
    (`sleep_unless_stopped`)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(task: asyncio.Task[Any] | None, what: str) -> None:
    """Stops a background task (a sync loop, a follower) and waits until it has ended, so that
    nothing of it runs on once its owner goes on to close what it used. An error it had died
    of is logged, not raised: the owner's stop must go on. A cancel of the caller itself that
    arrives while it waits is raised once the task has ended (even should the task have
    swallowed it), never taken for the task's; one that came before (a cancelled stop's
    cleanup) is not raised again."""
    if task is None:
        return
    caller = asyncio.current_task()
    cancels_before = caller.cancelling() if caller is not None else 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:
        log.exception("%s had stopped on an error", what)
    if caller is not None and caller.cancelling() > cancels_before:
        raise asyncio.CancelledError


async def sleep_unless_stopped(seconds: float) -> None:
    """`asyncio.sleep` between the rounds of a loop that is stopped by cancelling it: a round
    that swallowed the cancellation (see `stop_if_cancelled`) ends the loop here."""
    stop_if_cancelled()
    await asyncio.sleep(seconds)


def stop_event() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, event.set)
    return event


#: How long a stopping tier may run past its drain grace (closing servers and clients) before
#: it is taken to be hung.
STOP_OVERRUN_S = 15.0


#: How long before `bound_stop`'s deadline the event loop's tasks are written out.
TASK_DUMP_LEAD_S = 1.0


def bound_stop(drain_grace_s: float) -> None:
    """Call on SIGTERM: if the process is still alive `drain_grace_s + STOP_OVERRUN_S` later,
    every thread's stack goes to stderr (the tier's log) and the process exits 1. A stop that
    hangs then ends on its own, well inside the orchestrator's kill deadline, and says where.

    Called from a running event loop, it also writes every asyncio task's stack just before:
    a stop awaiting something that never comes leaves the loop idle in `select`, which the
    threads' stacks show and the tasks' name."""
    deadline_s = drain_grace_s + STOP_OVERRUN_S
    faulthandler.dump_traceback_later(deadline_s, exit=True)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    loop.call_later(max(0.0, deadline_s - TASK_DUMP_LEAD_S), _write_task_stacks)


def _write_task_stacks() -> None:
    sys.stderr.write(f"stop overran: the event loop's tasks\n{task_stacks()}")
    sys.stderr.flush()


def task_stacks() -> str:
    """Every task of the running event loop with its coroutine and stack, as text."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        print(f"-- {task.get_name()}: {task.get_coro()}", file=out)
        try:
            task.print_stack(file=out)
        except Exception as error:
            # A dump must not break the report it is part of. Seen: a TypeError inside
            # linecache while a worker's stop overran.
            print(f"   (no stack: {error!r})", file=out)
    return out.getvalue()


def exit_stopped(code: int) -> NoReturn:
    """Ends a tier that has drained and closed: flushes the logs and exits without the
    interpreter's teardown. Nothing is left to finish, and that teardown can block on library
    threads (`asyncio.run` joins executor threads without a bound on 3.11; gRPC's pollers)."""
    faulthandler.cancel_dump_traceback_later()
    logging.shutdown()
    os._exit(code)


def start_metrics(port: int, host: str, registry: CollectorRegistry) -> int:
    """Serves `/metrics` from a background thread; returns the bound port (0 picks one). Called
    from a running event loop (every tier's process but the gateway group's supervisor), it
    also samples that loop's lag into `registry` (services.common.loop_lag)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no loop here: nothing to sample
    else:
        LoopLag(registry).start()
    try:
        http_server, _ = start_http_server(port, host, registry)
    except OSError as error:  # taken: one line and status 2 (startup_errors), not a traceback
        raise unusable_port("the metrics port", port, error) from None
    return int(http_server.server_port)


def write_ready_file(path: Path | None, grpc_port: int, metrics_port: int, **fields: int) -> None:
    """Writes {grpc_port, metrics_port, **fields}: other ports (the gateway's http_port), or
    flags (a worker front's `serving`)."""
    if path is not None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        ports = {"grpc_port": grpc_port, "metrics_port": metrics_port, **fields}
        tmp.write_text(json.dumps(ports))
        tmp.replace(path)  # atomic: readers never see a half-written file


def freeze_startup_heap() -> None:
    """Moves everything built at start-up (models, tokenizers, protobuf and grpc modules) out of
    the collector's view: it lives as long as the process, and a full collection would
    otherwise walk it while requests wait (tens of ms per collection, as latency spikes)."""
    gc.collect()
    gc.freeze()


async def drain_within(
    drains: Sequence[asyncio.Task[None]],
    grace_s: float,
    state: Callable[[str], str] = lambda name: "",
) -> None:
    """Waits up to `grace_s` for every drain; past it, cancels those left (their rows are
    answered UNAVAILABLE) and logs them by name, with `state(name)`, so a stop that overran
    says what it waited for. Cancelled itself, it cancels every drain and waits for their
    cancel paths. Every drain that failed is logged; the first is raised once all are done."""
    if not drains:
        return
    try:
        _, pending = await asyncio.wait(drains, timeout=grace_s)
    except asyncio.CancelledError:
        for task in drains:
            task.cancel()
        await asyncio.wait(drains)
        raise
    if pending:
        for task in pending:
            task.cancel()  # first: whatever `state` does, nothing is left running
        names = [t.get_name() + state(t.get_name()) for t in drains if t in pending]
        log.warning(
            "drain did not finish within %.1fs: still running %s", grace_s, ", ".join(names)
        )
        await asyncio.wait(pending)
    errors = [(t, e) for t in drains if not t.cancelled() and (e := t.exception()) is not None]
    for task, error in errors:
        log.error("%s failed; closing anyway", task.get_name(), exc_info=error)
    if errors:
        raise errors[0][1]
