"""The door of a tier's gRPC server: a concurrency limit that refuses before any work is done.

The door is the first interceptor (before error mapping, tracing and auth). For each guarded
method (the ones that run models), a call past the process's limit, or any while the limit
sheds a standing queue (services.common.concurrency_limit), is answered
RESOURCE_EXHAUSTED from a handler built once: its body is never parsed, no span, no
authentication, no exception; only grpc's own per-call cost remains, about one bare echo call
(`bench/fabric`'s echo-calls), where serving the call costs three to four.

The limit adapts to the delay of the queue in front of the process (services.common.
concurrency_limit says why that queue and why a limit): every `probe_interval_s` the door sends
a probe call to its own server through a Unix socket (a file in a 0700 directory), on the
busiest guarded method, and times it. The probe waits in the same queue as every call (the
server takes its methods, health's aside, through its generic handlers, so grpc keeps one
queue of calls not yet picked up for them all, whatever the listener: lifecycle.
serve_registered_as_generic), is recognised by a per-process secret in its metadata and
answered at the door at once. A probe still unanswered at the next tick reports the time it
has waited so far (once past the target), so a queue growing without bound is seen while it
grows.

At the limit, and while shedding, the door refuses by caller: a call is refused only if its
caller (`caller` of its metadata; at the gateway the tenant of its key, one caller for all
missing and unknown keys: services.gateway.auth.door_caller) sent at least an equal share of
the guarded calls that reached the door lately (`CallerShares`: this and the previous half
second). What a flood costs a process is its calls' arrival, however soon each is refused, so
shares count arrivals, not calls in flight (a victim's slow, served calls would outnumber a
flood's quickly refused ones). A tenant flooding the gateway, even one its quota refuses a
moment later, then cannot make the door refuse a tenant sending less; a single caller's flood
is limited as a whole.

Refusals carry `retry-after-ms`: the queue's recent drain time, at least the interval over
which it is judged, jittered (services.common.errors.RETRY_JITTER) so that refused callers do
not come back in step.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.caller_shares import CallerShares, caller_of
from services.common.concurrency_limit import QueueDelayLimit
from services.common.door_config import DoorConfig
from services.common.door_handlers import MethodShape, answer_probe, handler
from services.common.errors import Overloaded, retry_after_trailer
from services.common.interceptors import Metadata
from services.common.lifecycle import cancel_and_wait
from services.common.loop_lag import LAG_BUCKETS
from services.common.telemetry import Children, MetricFactory

log = logging.getLogger(__name__)

#: Metadata key of the door's own probe calls; the value is a per-process secret, so a caller
#: cannot pass the door as a probe.
PROBE_KEY = "x-fabric-door-probe"
#: The least window the process's CPU share is measured over, seconds.
_MIN_CPU_WINDOW_S = 0.01
#: Probes in a row that do not reach the door's server (UNAVAILABLE: it stops, or cannot be
#: connected to) after which the limit returns to rest: nothing measures it meanwhile.
UNREACHED_PROBES_TO_REST = 10
#: How grpc ends a probe it dropped or refused before any handler ran.
_GRPC_REFUSALS = (grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _is_token(value: Any, token: str) -> bool:
    """Whether the probe key's `value` is the door's `token`, in constant time (the caller sets
    it; `==` stops at the first character that differs, a timing a guesser could read)."""
    return isinstance(value, str) and value.isascii() and secrets.compare_digest(value, token)


class _DoorMetrics:
    def __init__(self, registry: CollectorRegistry, door: Door) -> None:
        factory = MetricFactory(registry)
        self.refused = factory.counter(
            names.DOOR_REFUSED_TOTAL,
            "Calls refused at the door: past the process's concurrency limit, or while it "
            "sheds a standing queue.",
            ("method",),
        )
        factory.gauge(
            names.DOOR_LIMIT, "The process's concurrency limit for guarded calls now."
        ).set_function(lambda: door.limit.limit)
        factory.gauge(
            names.DOOR_SHEDDING,
            "1 while the door sheds: the queue in front of the process stood past "
            "--door-shed-factor targets with calls in flight short of the limit, and calls over "
            "their caller's share are refused whatever is in flight.",
        ).set_function(lambda: int(door.limit.is_shedding))
        factory.gauge(
            names.DOOR_IN_FLIGHT, "Guarded calls in flight in this process now."
        ).set_function(lambda: door.num_in_flight)
        self.queue_delay = factory.histogram(
            names.DOOR_QUEUE_DELAY_SECONDS,
            "Each measured wait in the queue in front of this process (a probe's, the probe "
            "timer's own lateness, or for a probe grpc dropped the last wait and at least twice "
            "the target), seconds.",
            buckets=LAG_BUCKETS,
        )
        self.probes_dropped = factory.counter(
            names.DOOR_PROBES_DROPPED_TOTAL,
            "Probes grpc dropped unseen (code CANCELLED: the calls waiting to be "
            "picked up were past --max-pending-calls) or refused (RESOURCE_EXHAUSTED: every "
            "--max-concurrent-rpcs slot held), as callers' calls were then: one probe at a "
            "time, on the busiest guarded method.",
            ("code",),
        )
        self.refused_of = Children(self.refused)  # per refused call: looked up once


class Door(grpc.aio.ServerInterceptor):
    """Refuses guarded calls past the concurrency limit; probes the queue to adapt it."""

    def __init__(
        self,
        methods: Mapping[str, MethodShape],
        config: DoorConfig,
        registry: CollectorRegistry,
        *,
        rng: random.Random | None = None,
        caller: Callable[[Metadata], str] = caller_of,
    ) -> None:
        self.config = config
        self._caller_of = caller
        #: The tightest SLO of the guarded models, which the target derives from (None: none
        #: known; `follow_slo` sets it).
        self._tightest_slo_s: float | None = None
        self._is_following = False
        self.limit = QueueDelayLimit(config.limit(config.target_for(None)))
        self.num_in_flight = 0
        self._shares = CallerShares(config.share_window_s)
        self._peak_in_flight = 0
        guarded = {m: shape for m, shape in methods.items() if not shape.shed_only}
        self._refusers = {m: handler(shape, self._refuse) for m, shape in methods.items()}
        self._probe_answers = {m: handler(shape, answer_probe) for m, shape in guarded.items()}
        self._calls_by_method = dict.fromkeys(guarded, 0)
        self._shed_only = frozenset(methods.keys() - guarded.keys())
        #: The method whose probe measures calls that `enter` (they come in another way) and
        #: those of shed-only methods.
        self._outside_method = next(iter(guarded))
        self._token = secrets.token_hex(16)
        self._rng = rng or random.Random()
        self._metrics = _DoorMetrics(registry, self)
        self._socket_dir: str | None = None
        self._address = ""
        self._probe_task: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None  # the probe call in flight, if any
        self._probe_started_s = 0.0
        #: Probes in a row that did not reach the server (UNAVAILABLE).
        self._unreached = 0
        self._channel: grpc.aio.Channel | None = None
        #: The process's CPU seconds at the last measurement, and when it was taken.
        self._cpu_s, self._cpu_at_s = time.process_time(), 0.0
        self._busy_share = 1.0

    @property
    def target_s(self) -> float:
        """The queue-delay target now, seconds."""
        return self.config.target_for(self._tightest_slo_s)

    def pickup_delay_s(self) -> float:
        """How long calls wait to be picked up by this process, as last measured, seconds (0
        once the door stopped: nothing measures it any more)."""
        return self.limit.last_delay_s if self._probe_task is not None else 0.0

    def follow_slo(self, tightest_slo_s: float | None) -> None:
        """The tightest SLO of the models whose calls the door guards, seconds (None: none):
        the target follows it unless the config sets one."""
        if self._is_following and tightest_slo_s == self._tightest_slo_s:
            return
        self._is_following = True
        self._tightest_slo_s = tightest_slo_s
        self.limit.retarget(self.target_s)
        log.info("the door's queue-delay target is %.0f ms", self.target_s * 1000)

    def listen(self, server: grpc.aio.Server) -> None:
        """Adds the probe's listener to `server`; call before the server starts. A socket file
        in a directory only this user may enter (mkdtemp makes it 0700): the listener serves
        without TLS, so no one else may reach it."""
        self._socket_dir = tempfile.mkdtemp(prefix="inference-door-")
        self._address = f"unix:{self._socket_dir}/probe.sock"
        server.add_insecure_port(self._address)

    def start(self) -> None:
        """Starts probing (on the running loop), once the server has started."""
        self._channel = grpc.aio.insecure_channel(self._address)
        self._cpu_s, self._cpu_at_s = time.process_time(), time.monotonic()
        self._probe_task = asyncio.create_task(self._probe_loop(), name="door-probe")

    async def stop(self) -> None:
        await cancel_and_wait(self._probe_task, "the door's probe loop")
        await cancel_and_wait(self._probe, "the door's probe call")
        self._probe_task = self._probe = None
        self.limit.stop_shedding()  # nothing measures the queue any more
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        refuser = self._refusers.get(method)
        if refuser is None:
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        if method in self._shed_only:
            if self._sheds(metadata, method):
                return refuser
            return await continuation(handler_call_details)
        for key, value in metadata:
            if key == PROBE_KEY and _is_token(value, self._token):
                return self._probe_answers[method]
        self._calls_by_method[method] += 1
        if not self._admits(metadata, method):
            return refuser
        task = asyncio.current_task()
        assert task is not None  # grpc runs every call's interceptors inside the call's task
        task.add_done_callback(lambda _: self.leave())
        return await continuation(handler_call_details)

    def enter(self, metadata: Metadata, label: str) -> Overloaded | None:
        """A guarded call that reached the process another way than this server (the gateway's
        HTTP front, on the same event loop), presenting `metadata` (lower-cased header names):
        None if admitted, counted in flight until `leave`; else the refusal to answer it with,
        counted under `label`. It counts as an arrival on the first guarded method, so a load
        that comes only this way is probed too: the probe then measures how long the loop
        they share takes to pick up a call."""
        self._calls_by_method[self._outside_method] += 1
        return None if self._admits(metadata, label) else self._overloaded()

    def shed(self, metadata: Metadata, label: str) -> Overloaded | None:
        """A long-lived call (MethodShape.shed_only: a generation) that reached the process
        another way than this server, as `enter`'s: None if it passes (not counted in
        flight: no `leave`), else the refusal to answer it with, counted under `label`."""
        return self._overloaded() if self._sheds(metadata, label) else None

    def _sheds(self, metadata: Metadata, label: str) -> bool:
        """Whether the door sheds a shed-only call now (counted under `label` if so): an
        arrival, counted for the probe and in its caller's share."""
        self._calls_by_method[self._outside_method] += 1
        is_over_share = self._shares.arrived(self._caller_of(metadata))
        if self.limit.is_shedding and is_over_share:
            self._metrics.refused_of[(label,)].inc()
            return True
        return False

    def _overloaded(self) -> Overloaded:
        retry_after_s = self.limit.retry_after_s()
        return Overloaded(self._refusal_words(f"about {retry_after_s * 1000:.0f}"),
                          retry_after_s=retry_after_s)  # fmt: skip

    def leave(self) -> None:
        """Ends one admitted call."""
        self.num_in_flight -= 1

    def _admits(self, metadata: Metadata, label: str) -> bool:
        is_over_share = self._shares.arrived(self._caller_of(metadata))
        is_full = self.limit.is_shedding or self.num_in_flight >= self.limit.limit
        if is_full and is_over_share:
            self._metrics.refused_of[(label,)].inc()
            return False
        self.num_in_flight += 1
        self._peak_in_flight = max(self._peak_in_flight, self.num_in_flight)
        return True

    def _refusal_words(self, retry_after_ms: str) -> str:
        # Said when the answer is written, which may be a measurement after the call was
        # refused: whichever reason holds now (the limit's, or else the queue's).
        if self.num_in_flight >= self.limit.limit:
            why = f"this process has {self.num_in_flight} calls in flight, its limit"
        else:
            why = (
                f"calls wait about {self.limit.last_delay_s * 1000:.0f} ms to be picked up "
                f"here, past {self.limit.shed_delay_s * 1000:.0f} ms"
            )
        return (
            f"overloaded: {why}, and this caller sent at least its share of its calls; retry "
            f"after {retry_after_ms} ms"
        )

    def _refuse(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Sets the refusal on `context` (the call then ends with it, no exception raised)."""
        trailer = retry_after_trailer(self.limit.retry_after_s(), self._rng)
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details(self._refusal_words(trailer[1]))
        context.set_trailing_metadata((trailer,))

    async def _probe_loop(self) -> None:
        pause_s = 1.0
        while True:
            try:
                await self._probe_every_interval()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A door that stopped measuring must not keep a flood's limit, nor stay inert
                # for the process's life (it ended for good: review finding).
                log.exception("the door's probe loop failed; its limit returns to rest, and "
                              "it probes again in %.0f s", pause_s)  # fmt: skip
                self.limit = QueueDelayLimit(self.config.limit(self.target_s))
                self._shares = CallerShares(self.config.share_window_s)
                await asyncio.sleep(pause_s)
                pause_s = min(2 * pause_s, 30.0)

    async def _probe_every_interval(self) -> None:
        # time.monotonic(), not the loop's clock: uvloop's counts whole milliseconds.
        interval_s = self.config.probe_interval_s
        due_s = time.monotonic()
        while True:
            target_s = self.limit.config.target_s  # follows the SLO (follow_slo)
            due_s += interval_s
            await asyncio.sleep(max(0.0, due_s - time.monotonic()))
            now_s = time.monotonic()
            self._shares.roll(now_s)
            # A late timer is a stalled loop: whatever arrived meanwhile waited at least this.
            late_s = max(0.0, now_s - due_s)
            due_s = max(due_s, now_s - interval_s)  # after a stall, no burst of catch-up ticks
            if self._probe is not None and not self._probe.done():
                # Still waiting: the queue is at least this long, and growing. A wait still
                # within the target says nothing yet (the probe may be about to wait long).
                waited_s = max(late_s, now_s - self._probe_started_s)
                if waited_s > target_s:
                    self._measured(now_s, waited_s)
                continue
            method = max(self._calls_by_method, key=self._calls_by_method.__getitem__)
            if self._calls_by_method[method] == 0 and self.limit.last_delay_s <= target_s:
                # Idle: nothing reached the door and the last probe found no queue, so none
                # has formed since (a queue needs arrivals); only the timer is measured.
                self._measured(now_s, late_s)
                continue
            if late_s > target_s:
                self._measured(now_s, late_s)
            self._calls_by_method = dict.fromkeys(self._calls_by_method, 0)
            self._probe_started_s = now_s
            self._probe = asyncio.create_task(self._send_probe(method, now_s))

    async def _send_probe(self, method: str, started_s: float) -> None:
        assert self._channel is not None
        is_dropped = False
        try:
            call = self._channel.unary_unary(
                method, request_serializer=bytes, response_deserializer=bytes
            )
            await call(b"", metadata=((PROBE_KEY, self._token),))
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.UNAVAILABLE:
                # The server is stopping, or the probe could not reach it: nothing measured.
                self.limit.stop_shedding()
                self._unreached += 1
                if self._unreached == UNREACHED_PROBES_TO_REST:
                    # Unmeasured, a flood's limit would hold for as long as the probes fail.
                    log.warning(
                        "the door's last %d probes did not reach its server (UNAVAILABLE); "
                        "its limit returns to rest until one does",
                        self._unreached,
                    )
                    self.limit = QueueDelayLimit(self.config.limit(self.target_s))
                return
            # Dropped unseen (CANCELLED: past --max-pending-calls; the door stops before its
            # server, so not a stop): a queue over the target, however soon the drop came.
            # Refused by grpc (RESOURCE_EXHAUSTED: every --max-concurrent-rpcs slot held,
            # streams included): its wait is what it measured.
            is_dropped = error.code() is grpc.StatusCode.CANCELLED
            if error.code() in _GRPC_REFUSALS:
                self._metrics.probes_dropped.labels(error.code().name).inc()
            else:
                log.warning("door probe failed: %s", error.code().name)
        self._unreached = 0
        now_s = time.monotonic()
        delay_s = now_s - started_s
        self._measured(now_s, self.limit.dropped_probe_delay_s(delay_s) if is_dropped else delay_s)

    def _measured(self, now_s: float, delay_s: float) -> None:
        self._metrics.queue_delay.observe(delay_s)
        cpu_s = time.process_time()  # every thread of the process, grpc's included
        if now_s - self._cpu_at_s >= _MIN_CPU_WINDOW_S:
            # Over a shorter window (a tick's report and the probe's answer in one loop turn)
            # the share reads near 0 and passes for CPU starvation: the last one stands.
            self._busy_share = (cpu_s - self._cpu_s) / (now_s - self._cpu_at_s)
            self._cpu_s, self._cpu_at_s = cpu_s, now_s
        self.limit.update(now_s, delay_s, self._peak_in_flight, self._busy_share)
        self._peak_in_flight = self.num_in_flight
