"""Forwards worker calls: choose a worker, reserve, call, retry elsewhere if it vanished.

Bodies travel as opaque bytes: routing needs only the model, version and row count, which the
gateway sends as metadata, so the router never parses or re-encodes a payload.
"""

from __future__ import annotations

import logging
import time

import grpc

from services.common.errors import InvalidInput, NotFound, Overloaded, Unavailable, UpstreamError
from services.common.registry import parse_route_metadata
from services.router.metrics import RouterMetrics
from services.router.routing import Reject, RejectReason, RetryBudget, RouteTable

log = logging.getLogger(__name__)

INFER_METHOD = "/inference.v1.WorkerService/Infer"


def _passthrough(payload: bytes) -> bytes:
    return payload


class Forwarder:
    def __init__(
        self,
        table: RouteTable,
        budget: RetryBudget,
        metrics: RouterMetrics,
        *,
        default_timeout_s: float,
        max_retries: int,
    ) -> None:
        self._table = table
        self._budget = budget
        self._metrics = metrics
        self._default_timeout_s = default_timeout_s
        self._max_retries = max_retries
        # One long-lived channel per worker address: HTTP/2 multiplexes every call over it.
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _infer_callable(self, address: str) -> grpc.aio.UnaryUnaryMultiCallable:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(
                address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
            )
        return channel.unary_unary(
            INFER_METHOD, request_serializer=_passthrough, response_deserializer=_passthrough
        )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def infer(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        route_info = parse_route_metadata(dict(context.invocation_metadata() or ()))
        if route_info is None:
            raise InvalidInput("router calls need x-route-model, -version and -rows metadata")
        name, version, num_rows = route_info
        started_s = time.monotonic()
        remaining_s = context.time_remaining()
        deadline_s = started_s + (self._default_timeout_s if remaining_s is None else remaining_s)
        code = "OK"
        try:
            return await self._forward(body, name, version, num_rows, deadline_s)
        except Exception as error:
            code = getattr(error, "code", grpc.StatusCode.INTERNAL).name
            raise
        finally:
            self._metrics.responses_total.labels(name, version, code).inc()
            self._metrics.request_seconds.labels(name, version).observe(
                time.monotonic() - started_s
            )

    async def _forward(
        self, body: bytes, name: str, version: str, num_rows: int, deadline_s: float
    ) -> bytes:
        self._budget.record_request(time.monotonic())
        tried: set[str] = set()
        for attempt in range(self._max_retries + 1):
            now_s = time.monotonic()
            decision = self._table.route(
                name, version, num_rows, deadline_s - now_s, now_s, frozenset(tried)
            )
            if isinstance(decision, Reject):
                self._metrics.rejected_total.labels(name, version, decision.reason.value).inc()
                raise _rejection(decision, retried=bool(tried))
            tried.add(decision.worker_id)
            self._metrics.routed_total.labels(name, version, decision.worker_id).inc()
            self._metrics.predicted_wait_seconds.labels(name, version).observe(decision.predicted_s)
            try:
                call = self._infer_callable(decision.address)
                return await call(body, timeout=max(0.0, deadline_s - time.monotonic()))
            except grpc.aio.AioRpcError as error:
                # UNAVAILABLE: the worker is gone, draining or not ready; the request never
                # produced a result there and inference has no side effects, so another worker
                # may run it. Anything else is the request's own answer.
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise UpstreamError.from_rpc_error(error) from None
                self._table.eject(decision.worker_id, time.monotonic())
                can_retry = (
                    attempt < self._max_retries
                    and deadline_s > time.monotonic()
                    and self._budget.try_spend(time.monotonic())
                )
                log.warning(
                    "worker %s unavailable (%s)%s",
                    decision.worker_id,
                    error.details(),
                    "; retrying elsewhere" if can_retry else "",
                )
                if not can_retry:
                    raise UpstreamError.from_rpc_error(error) from None
                self._metrics.retries_total.labels(name, version).inc()
            finally:
                self._table.release(decision.reservation_id)
        raise Unavailable("no worker answered")  # unreachable: the loop returns or raises


def _rejection(decision: Reject, *, retried: bool) -> Exception:
    if decision.reason is RejectReason.DEADLINE:
        return Overloaded(decision.message, retry_after_s=decision.retry_after_s)
    if decision.reason is RejectReason.UNKNOWN_MODEL and not retried:
        return NotFound(decision.message)
    return Unavailable(decision.message)
