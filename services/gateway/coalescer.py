"""Coalesces concurrent calls for one model version into bundles (services.common.bundles).

Under load, a gateway process holds many calls for the same model version at once; sent one
by one, each costs the router and the worker a whole internal call (a task, a span, a
metadata map, protobuf messages, a routing decision and a reservation). Here the calls that
arrive while others of their kind are in flight travel together: one downstream call, one
routing decision, the rows as packed columns, and one status per caller's slice.

When a bundle leaves follows the streams' write linger (services.common.write_linger): at
light load a call leaves in this turn of the event loop, with whatever calls that same turn
made (no timer: no added latency); under load, a bundle waits up to `linger_s` (1 ms) for
more, and leaves at once when it holds the model's max batch rows. Then the bundle clock
(services.gateway.bundle_clock): while a bundle of its key is downstream and not answered, a
ready bundle keeps gathering calls until one is answered, and then while calls wait to be
picked up by this process (at most its hold, and only while the key's time downstream is
short), so bundles grow with the load. Both count the key's calls in
flight, and those waiting to be picked up by this process (its door's measured pickup delay).

Each caller keeps its own deadline (its slice's deadline is sent as an offset from the
bundle's, which is the latest slice's), its own status and retry hint, and its own
cancellation: a caller that stops waiting has its slice dropped before the bundle leaves, or
withdrawn downstream after (SliceCancels, relayed by the router to the worker).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.bundles import SliceCancels, pack_token_rows
from services.common.errors import UpstreamError
from services.common.moving_average import MovingAverage
from services.common.registry_schema import route_metadata
from services.common.tensors import stack_rows, tensor_to_pb
from services.common.tracing import outgoing_metadata
from services.common.write_linger import DEFAULT_LINGER, LingerConfig, WriteLinger
from services.gateway.bundle_clock import DEFAULT_CLOCK, BundleClock
from services.gateway.bundle_parts import (
    Answered,
    Bundle,
    BundleKey,
    CallerSlice,
    Prepare,
    answer,
    closing,
    fail,
    prepared,
    unsent,
)
from services.gateway.call_rows import MAX_BUNDLE_BYTES
from services.gateway.metrics import GatewayMetrics
from services.pb.inference.v1 import worker_pb2 as pb

#: Sends one bundle (its bytes, metadata, absolute deadline on time.monotonic(), and the
#: slices whose callers stop waiting) and returns the answer's bytes, or raises UpstreamError.
Send = Callable[[bytes, Sequence[tuple[str, str]], float, SliceCancels], Awaitable[bytes]]


#: Weight of a bundle's time downstream in its key's moving average.
DOWNSTREAM_WEIGHT = 0.2


@dataclass
class _KeyState:
    """What the coalescer follows for one bundle key (a few keys per model version)."""

    linger: WriteLinger
    #: The bundle being filled, if any.
    open: Bundle | None = None
    #: Callers' slices sent or waiting, not answered yet.
    in_flight: int = 0
    #: Bundles sent, not answered yet.
    out: int = 0
    #: The bundles' times downstream, seconds (the worker's own, else the round trip).
    downstream: MovingAverage = field(default_factory=lambda: MovingAverage(DOWNSTREAM_WEIGHT))
    #: Done when a bundle out ends, True if it was answered: what a held bundle waits on.
    answered: asyncio.Future[bool] | None = None


def _is_idle(state: _KeyState) -> bool:
    return state.open is None and state.in_flight == 0 and state.out == 0


class Coalescer:
    def __init__(
        self,
        send: Send,
        metrics: GatewayMetrics,
        pickup_delay_s: Callable[[], float],
        linger: LingerConfig = DEFAULT_LINGER,
        clock: BundleClock = DEFAULT_CLOCK,
        is_stale: Callable[[BundleKey], bool] = lambda key: False,
    ) -> None:
        """`is_stale`: whether a key's model version is no longer current (forgotten,
        served by no live worker, or with another fingerprint): its state is dropped once
        idle (`_forget_stale`), and made again should the version come back."""
        self._send = send
        self._is_stale = is_stale
        self._metrics = metrics
        self._linger_config = linger
        self._clock = clock
        self._pickup_delay_s = pickup_delay_s
        self._keys: dict[BundleKey, _KeyState] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def call(
        self,
        key: BundleKey,
        rows: Sequence[Any],
        piece: pb.Slice,
        *,
        deadline_s: float,
        max_rows: int,
        prepare: Prepare | None = None,
        on_unsent: Callable[[], None] | None = None,
    ) -> Answered:
        """The outputs of `rows`, sent in a bundle with whatever calls of `key` are ready;
        raises UpstreamError with the slice's own status, DEADLINE_EXCEEDED at `deadline_s`.
        `prepare`: what makes rows of the values in `rows`, once per bundle (the same for
        every call of `key`); None: `rows` are rows. `on_unsent`: called once if the call
        stops waiting (its deadline, or cancelled) before its slice left this process."""
        loop = asyncio.get_running_loop()
        state = self._keys.get(key)
        if state is None:
            self._forget_stale()
            state = self._keys[key] = _KeyState(WriteLinger(self._linger_config))
        state.linger.arrived(time.monotonic())
        bundle = state.open
        # Its tensors' bytes (texts' are a few token ids a row) and its slice's own fields,
        # whose request id is the caller's: one caller's long id must not take its
        # bundle-mates past the call's limit.
        num_bytes = sum(getattr(row, "nbytes", 0) for row in rows) + piece.ByteSize()
        entry = CallerSlice(
            rows, piece, deadline_s, loop.create_future(), num_bytes, on_unsent=on_unsent
        )
        if bundle is not None and (
            bundle.rows + len(rows) > max_rows
            or bundle.num_bytes + entry.num_bytes > MAX_BUNDLE_BYTES
        ):
            self._leave(bundle)  # full: these rows start the next one
            bundle = None
        if bundle is None:
            bundle = state.open = Bundle(key, prepare)
            self._spawn(self._leave_when_ready(bundle, state, max_rows))
        bundle.slices.append(entry)
        entry.bundle = bundle
        bundle.rows += len(rows)
        bundle.num_bytes += entry.num_bytes
        state.in_flight += 1
        # A timer, not asyncio.timeout: the same deadline for a fraction of its cost per call.
        timer = loop.call_later(max(0.0, deadline_s - time.monotonic()), self._expire, entry)
        try:
            if bundle.rows >= max_rows:
                self._leave(bundle)
            return Answered(await entry.future, entry.rows)
        except asyncio.CancelledError:
            self._withdraw(entry)
            raise
        finally:
            timer.cancel()
            state.in_flight -= 1
            entry.bundle = None  # no cycle left for the garbage collector: freed as it ends

    @property
    def num_keys(self) -> int:
        """Bundle keys whose state is kept."""
        return len(self._keys)

    def _forget_stale(self) -> None:
        """Drops the state of stale keys with nothing open, in flight or out (nothing refers
        to it then). A new key looks, so the keys kept are about those in use: each version a
        rollout retires leaves a few."""
        for key in [k for k, state in self._keys.items() if _is_idle(state) and self._is_stale(k)]:
            del self._keys[key]

    def _expire(self, entry: CallerSlice) -> None:
        """The caller's deadline passed before its answer: DEADLINE_EXCEEDED, slice withdrawn."""
        if not entry.future.done():
            is_sent = entry.bundle is not None and entry.bundle.is_sent
            why = "router: deadline exceeded" if is_sent else (
                "gateway: deadline exceeded before the call was sent"
            )  # fmt: skip
            expired = UpstreamError(grpc.StatusCode.DEADLINE_EXCEEDED, why, ran_nothing=not is_sent)
            entry.future.set_exception(expired)
            self._withdraw(entry)

    async def close(self) -> None:
        """Stops: every caller still waiting is answered UNAVAILABLE (not run here); those of
        bundles not sent yet are told (`on_unsent`: their rows go back to their tenants)."""
        for state in self._keys.values():
            if state.open is not None:
                unsent = state.open.slices
                fail(unsent, closing())
                state.open = None
                for entry in unsent:
                    if entry.on_unsent is not None:
                        entry.on_unsent()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(
        self, coroutine: Coroutine[None, None, None], context: contextvars.Context | None = None
    ) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _withdraw(self, entry: CallerSlice) -> None:
        """The caller of `entry` stopped waiting: drop its slice, or have it withdrawn (once:
        its deadline and its cancellation may both come)."""
        bundle = entry.bundle
        if bundle is None:
            return
        if not bundle.is_sent:
            if entry in bundle.slices:
                bundle.slices.remove(entry)
                bundle.rows -= len(entry.rows)
                bundle.num_bytes -= entry.num_bytes
                if entry.on_unsent is not None:
                    entry.on_unsent()
        elif entry.index is not None:
            bundle.cancels.cancel(entry.index)
            if len(bundle.cancels.cancelled) >= len(bundle.slices) and bundle.task is not None:
                # No caller waits for it: its call is cancelled downstream whole (its rows
                # withdrawn), and a resend it waits to make is not made.
                bundle.task.cancel()

    async def _leave_when_ready(self, bundle: Bundle, state: _KeyState, max_rows: int) -> None:
        # Calls made in this turn of the event loop leave together; under load, also those of
        # the next `linger_s`, and then those until an answer and those waiting to be picked
        # up then (see the module's docstring).
        await asyncio.sleep(0)
        if bundle.is_sent:
            return
        delay_s = state.linger.delay_s(bundle.rows, self._in_flight(state))
        if delay_s > 0 and bundle.rows < max_rows:
            await asyncio.sleep(delay_s)
        if not bundle.is_sent and bundle.slices:
            time_left_s = min(s.deadline_s for s in bundle.slices) - time.monotonic()
            in_flight = self._in_flight(state)  # after the linger: calls came and went
            hold_s = self._clock.hold_s(state.out, in_flight, time_left_s, state.downstream.mean)
            if hold_s > 0:  # until an answer, or until it leaves full (`call`)
                loop = asyncio.get_running_loop()
                bundle.held_from, bundle.left = time.monotonic(), loop.create_future()
                if state.answered is None:
                    state.answered = loop.create_future()
                answered = state.answered
                await asyncio.wait(
                    (answered, bundle.left), timeout=hold_s, return_when=asyncio.FIRST_COMPLETED
                )
                # Answered: the calls already waiting at this process's door join it first (a
                # failed bundle ends the hold at once, as before: the next may go elsewhere).
                held_s = time.monotonic() - bundle.held_from
                gather_s = self._clock.gather_s(self._pickup_delay_s(), held_s, hold_s)
                was_answered = answered.done() and answered.result()
                if was_answered and gather_s > 0 and not bundle.left.done():
                    await asyncio.wait((bundle.left,), timeout=gather_s)
        self._leave(bundle)

    def _in_flight(self, state: _KeyState) -> float:
        """The key's calls here, and those waiting to be picked up (the module's docstring)."""
        return state.in_flight + state.linger.expected_calls(self._pickup_delay_s())

    def _bundle_done(self, bundle: Bundle) -> None:
        """Its send task ended (answered, failed, or cancelled, even before it started): a
        caller not answered yet hears UNAVAILABLE, and a bundle held for it may leave."""
        fail(bundle.slices, closing())
        bundle.task = None  # a cancelled task's error holds its frame, and so the bundle
        state = self._keys[bundle.key]
        state.out -= 1
        answered, state.answered = state.answered, None
        if answered is not None and not answered.done():
            answered.set_result(bundle.is_answered)

    def _leave(self, bundle: Bundle) -> None:
        if bundle.is_sent:
            return
        bundle.is_sent = True
        if bundle.left is not None:  # it was held
            if bundle.slices and bundle.held_from is not None:
                held_s = time.monotonic() - bundle.held_from
                self._metrics.bundle_hold_seconds_of[(bundle.key.model,)].observe(held_s)
            if not bundle.left.done():
                bundle.left.set_result(None)
        state = self._keys[bundle.key]
        if state.open is bundle:
            state.open = None
        try:
            bundle.slices = prepared(bundle)
        except Exception as error:  # a bug in preparing: every caller hears of it now
            for entry in bundle.slices:
                if not entry.future.done():
                    unsent(entry)
            fail(bundle.slices, error)
            return
        for index, entry in enumerate(bundle.slices):
            entry.index = index
        if bundle.slices:
            state.out += 1
            # In its first caller's context, whoever made it leave: a caller whose rows
            # overfilled it sent it under their own trace, which it did not carry (telemetry
            # review). A copy: a slice sent again is sent in the same caller's context, which
            # the task that sent it first may still have entered.
            context = bundle.slices[0].context.copy()
            task = bundle.task = self._spawn(self._send_bundle(bundle), context)
            task.add_done_callback(lambda _: self._bundle_done(bundle))

    async def _send_bundle(self, bundle: Bundle) -> None:
        slices = bundle.slices
        downstream = self._keys[bundle.key].downstream
        sent_s = time.monotonic()
        try:
            request, route = self._request(bundle)
            try:
                payload = await self._send(
                    request.SerializeToString(),
                    outgoing_metadata(route),
                    max(s.deadline_s for s in slices),
                    bundle.cancels,
                )
                response = pb.InferResponse.FromString(payload)
            except asyncio.CancelledError:  # its callers left, or the gateway closes: the
                downstream.observe_at_least(time.monotonic() - sent_s)  # time so far is a floor
                raise
            except BaseException:  # a failure's round trip counts: a stalled downstream
                downstream.observe(time.monotonic() - sent_s)  # stops the holds
                raise
            # The worker's own time, not the round trip, which also counts how late this
            # process's loop read the answer (services.gateway.bundle_clock).
            worker_s = response.worker_us / 1e6
            downstream.observe(worker_s if worker_s > 0 else time.monotonic() - sent_s)
            again = answer(slices, response)
            bundle.is_answered = True
        except Exception as error:  # the whole bundle failed: each caller gets the status
            fail(slices, error)
            return
        # Cancelled (the gateway is closing): `_bundle_done` answers the callers.
        if again:
            self._send_again(bundle, again)

    def _send_again(self, bundle: Bundle, entries: list[CallerSlice]) -> None:
        """Sends `entries` of `bundle` once more, as a bundle of their own (bundle_parts.answer:
        refused unstarted, their bundle-mates served)."""
        bundle.slices = [s for s in bundle.slices if s not in entries]  # not failed when done
        again = Bundle(bundle.key, None, slices=entries)
        for entry in entries:
            entry.bundle, entry.index, entry.is_resent = again, None, True
            again.rows += len(entry.rows)
            again.num_bytes += entry.num_bytes
        self._metrics.router_retries_total.labels("predict").inc()
        self._leave(again)

    def _request(self, bundle: Bundle) -> tuple[pb.InferRequest, tuple[tuple[str, str], ...]]:
        """The bundle's request and its routing metadata."""
        key, slices = bundle.key, bundle.slices
        deadline_s = max(s.deadline_s for s in slices)
        request = pb.InferRequest(
            model_name=key.model, model_version=key.version, fingerprint=key.fingerprint
        )
        tenants = set()
        for entry in slices:
            entry.piece.rows = len(entry.rows)
            entry.piece.earlier_us = round((deadline_s - entry.deadline_s) * 1e6)
            tenants.add((entry.piece.tenant, entry.piece.tenant_weight))
        request.slices.extend(s.piece for s in slices)
        rows = [row for s in slices for row in s.rows]
        if key.is_text:
            request.packed.token_ids, request.packed.row_lengths = pack_token_rows(rows)
        else:
            request.packed.tensor.CopyFrom(tensor_to_pb(stack_rows(rows)))
        # One tenant: routing prices its fair share as for a lone call; several: as shared.
        tenant, weight = next(iter(tenants)) if len(tenants) == 1 else ("", 1.0)
        route = route_metadata(
            key.model, key.version, len(rows), key.priority, tenant=tenant, weight=weight
        )
        self._metrics.bundle_slices_of[(key.model,)].observe(len(slices))
        return request, route
