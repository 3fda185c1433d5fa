"""Forwards worker calls: choose a worker, reserve, call, retry elsewhere if it vanished.

Bodies travel as opaque bytes: routing needs only the model, version and row count, which the
gateway sends as metadata, so the router never parses or re-encodes a payload. Fixed-cost
calls reach each worker over one multiplexed stream (services.common.multiplex), whether
they arrived as unary calls or on a gateway's stream.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable

import grpc

from services.common.bundles import SliceCancels
from services.common.errors import DeadlineExceeded, Unavailable, UpstreamError, is_too_large
from services.common.grpc_errors import is_bug
from services.common.multiplex_server import CallContext
from services.common.priority import PriorityClass
from services.common.sparse_log import SparseLog
from services.common.telemetry import DEADLINE_SLACK_S, Outcome, given_up_by
from services.common.tls import ClientTls
from services.common.tracing import outgoing_metadata
from services.router.bundle_split import Bundle, Part, merge, plan, relay_cancels
from services.router.call_facts import CallFacts, LateCall, call_facts, part_facts
from services.router.caller_errors import for_caller, rejection
from services.router.metrics import RouterMetrics
from services.router.retry import GiveUp, GiveUpReason, decide_retry
from services.router.routing import Reject, RejectReason, RetryBudget, Route, RouteTable
from services.router.worker_links import WorkerLinks

log = logging.getLogger(__name__)
#: Retries and give-ups, at most once a period per worker (and reason).
_sparse = SparseLog(log)

GENERATE_METHOD = "/inference.v1.WorkerService/Generate"
#: Statuses that do not show a worker answering calls (see `Forwarder._note_outcome`).
_NO_ANSWER = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})


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
        tls: ClientTls | None = None,
    ) -> None:
        self._table = table
        self._budget = budget
        self._metrics = metrics
        metrics.retry_budget_tokens.set_function(lambda: budget.balance(time.monotonic()))
        self._default_timeout_s = default_timeout_s
        self._max_retries = max_retries
        # One long-lived channel per worker address: HTTP/2 multiplexes every call over it,
        # and one InferStream on it carries every fixed-cost call.
        self.links = WorkerLinks(tls or ClientTls())
        metrics.worker_links.set_function(lambda: len(self.links))

    async def close(self) -> None:
        await self.links.close()

    async def infer(self, body: bytes, context: grpc.aio.ServicerContext | CallContext) -> bytes:
        facts = self._facts(context, self._default_timeout_s)
        labels = (facts.name, facts.version)
        seconds = self._metrics.request_seconds_of[labels]
        given_up = given_up_by(facts.deadline_s, DEADLINE_SLACK_S)
        with Outcome(self._metrics.responses_total_of, labels, seconds, given_up=given_up):
            return await self._infer(body, facts, getattr(context, "slice_cancels", None))

    def _facts(
        self, context: grpc.aio.ServicerContext | CallContext, default_timeout_s: float | None
    ) -> CallFacts:
        """`call_facts`; a call late already is counted (DEADLINE_EXCEEDED) as every call
        answered is: refused before its outcome was entered, it was not, under overload
        above all (review finding)."""
        try:
            return call_facts(context, default_timeout_s)
        except LateCall as late:
            with Outcome(self._metrics.responses_total_of, late.labels):
                raise

    def _infer(
        self, body: bytes, facts: CallFacts, slice_cancels: SliceCancels | None
    ) -> Awaitable[bytes]:
        """`slice_cancels`: a bundle's slices whose callers stopped waiting, relayed to the
        worker. A bundle is routed, reserved and forwarded whole, as one call, unless no worker
        can take all of it in time: then in parts (services.router.bundle_split). Not itself a
        coroutine: the call awaits the one that sends it (no extra frame per request), and a
        refusal raises at once."""
        decision = self._decide(facts, frozenset())
        if isinstance(decision, Reject):
            bundle = None
            if self._may_split(facts, decision):
                bundle = Bundle.parse(body)
            if bundle is None:
                raise self._refused(facts, decision, retried=False)
            return self._split(bundle, facts, slice_cancels, decision)
        # Only a call sent on earns retries: under a flood most calls are refused here, and
        # counted they made the budget a fifth of the calls offered, not of those sent.
        self._budget.record_request(time.monotonic())
        return self._attempts(body, facts, slice_cancels, decision)

    def _may_split(self, facts: CallFacts, refusal: Reject) -> bool:
        """Whether a call refused whole may be split: refused for its deadline, of several
        rows, and some worker would take one row of it in time. Under overload no worker
        does, and the refusal costs one more pricing, not a parse and a plan."""
        if refusal.reason is not RejectReason.DEADLINE or facts.num_rows < 2:
            return False
        now_s = time.monotonic()
        return self._table.can_take(
            facts.name, facts.version, 1, facts.deadline_s - now_s, now_s,
            is_batch=facts.priority is PriorityClass.BATCH, tenant=facts.tenant,
            weight=facts.weight,
        )  # fmt: skip

    async def _attempts(
        self,
        body: bytes,
        facts: CallFacts,
        slice_cancels: SliceCancels | None,
        route: Route,
    ) -> bytes:
        """Sends a call on `route`, and again elsewhere while its failures allow a retry."""
        deadline_s = facts.deadline_s
        tried = {route.worker_id}
        failure: UpstreamError | None = None
        for attempt in range(self._max_retries + 1):
            if attempt:
                route = self._route(facts, tried, failure)
            sent_s = time.monotonic()
            try:
                response = await self.links.stream(route.address).call(
                    body,
                    metadata=outgoing_metadata(),
                    timeout_s=_timeout_s(deadline_s),
                    slice_cancels=slice_cancels,
                )
            except UpstreamError as error:
                failure = error
                self._note_outcome(route, sent_s, error)
                self._after_failure(error, route, attempt, facts)
            except asyncio.CancelledError:
                self._note_cancelled(route, sent_s, deadline_s)
                raise
            else:
                self._note_outcome(route, sent_s, None)
                return response
            finally:
                self._table.release(route.reservation_id)
        raise Unavailable("no worker answered")  # unreachable: the last failure raises

    async def _split(
        self,
        bundle: Bundle,
        facts: CallFacts,
        slice_cancels: SliceCancels | None,
        whole: Reject,
    ) -> bytes:
        """Routes a bundle in parts; answers as the whole bundle would have been answered. When
        no part can be routed, the bundle is refused whole, as it was refused at first."""

        routes: list[Route] = []

        def decide(part: Part) -> Route | Reject:
            decision = self._decide(part_facts(facts, part), frozenset())
            if isinstance(decision, Route):
                routes.append(decision)
            return decision

        try:
            decided = plan(bundle, decide)
        except BaseException:
            for route in routes:
                self._table.release(route.reservation_id)
            raise
        if not routes:
            raise self._refused(facts, whole, retried=False)
        self._metrics.split_bundles_total.labels(facts.name, facts.version).inc()
        now_s = time.monotonic()
        for _ in routes:  # each part sent may retry: each counts toward the retry budget
            self._budget.record_request(now_s)
        parts = [part for part, _ in decided]
        cancels, stop_relay = relay_cancels(slice_cancels or SliceCancels(), parts)

        async def answer(part: Part, decision: Route | Reject, part_cancels: SliceCancels) -> bytes:
            facts_of_part = part_facts(facts, part)
            if isinstance(decision, Reject):
                if facts_of_part.deadline_s <= time.monotonic():  # not an overload to retry
                    raise DeadlineExceeded("deadline exceeded before its part was routed")
                raise self._refused(facts_of_part, decision, retried=False)
            return await self._attempts(bundle.body(part), facts_of_part, part_cancels, decision)

        try:
            answers = await asyncio.gather(
                *(answer(p, d, c) for (p, d), c in zip(decided, cancels, strict=True)),
                return_exceptions=True,
            )
        finally:
            stop_relay()
            for route in routes:  # a part cancelled before it started never released its own
                self._table.release(route.reservation_id)
        for error in answers:
            if isinstance(error, BaseException) and is_bug(error):
                log.error("a part of a split bundle failed", exc_info=error)
        return merge(list(zip(parts, answers, strict=True)))

    async def generate(
        self, body: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[bytes, None]:
        """Forwards a generation stream. Retries elsewhere only before the first message:
        a stream that already delivered tokens is never silently replayed."""
        # No deadline from the caller: none here either (a stream may run long; the gateway
        # always sends one, the model's default_timeout_ms when its caller set none).
        facts = self._facts(context, None)
        name, version, deadline_s = facts.name, facts.version, facts.deadline_s
        given_up = given_up_by(deadline_s, DEADLINE_SLACK_S)
        with Outcome(self._metrics.responses_total_of, (name, version), given_up=given_up):
            tried: set[str] = set()
            failure: UpstreamError | None = None
            for attempt in range(self._max_retries + 1):
                route = self._route(facts, tried, failure)
                if attempt == 0:  # sent on (a refusal earns no retries: `_infer`)
                    self._budget.record_request(time.monotonic())
                sent_s = time.monotonic()
                call: grpc.aio.UnaryStreamCall[bytes, bytes] | None = None
                has_sent = False
                self.links.generation_started(route.address)
                try:  # from the reservation on: whatever fails, it is released
                    call = self.links.channel(route.address).unary_stream(
                        GENERATE_METHOD, _passthrough, _passthrough
                    )(body, timeout=_timeout_s(deadline_s), metadata=outgoing_metadata())
                    async for message in call:
                        if not has_sent:
                            self._note_outcome(route, sent_s, None)
                            # Its prompt is in: a sequence that decodes is no queued work (the
                            # worker's heartbeat counts prompts waiting for a first token).
                            self._table.release(route.reservation_id)
                        has_sent = True
                        yield message
                    return
                except grpc.aio.AioRpcError as error:
                    if has_sent:
                        raise UpstreamError.from_rpc_error(error) from None
                    failure = UpstreamError.from_rpc_error(error)
                    self._note_outcome(route, sent_s, failure)
                    self._after_failure(failure, route, attempt, facts)
                except asyncio.CancelledError:
                    if not has_sent:
                        self._note_cancelled(route, sent_s, deadline_s)
                    raise
                finally:
                    if call is not None:  # no-op once finished; stops the worker if our caller left
                        call.cancel()
                    self.links.generation_ended(route.address)
                    self._table.release(route.reservation_id)

    def _route(
        self, facts: CallFacts, tried: set[str], failure: UpstreamError | None = None
    ) -> Route:
        """A route, avoiding `tried` (the workers tried already, to which it adds its own);
        raises the refusal, or the last worker's NOT_FOUND (`failure`, as UNAVAILABLE:
        `for_caller`) when no other worker is left to try. Another worker that serves the version
        but is predicted past the deadline refuses it as overload (RESOURCE_EXHAUSTED with a
        hint), not NOT_FOUND: the version is served. With a `failure` it routes a retry, which
        spends its budget token once routed, or, without one left, gives the worker's failure
        to the caller before routing (a route the budget refused took a probation's probe)."""
        now_s, keep = time.monotonic(), self._keep(facts)
        if failure is not None and not self._budget.has_token(now_s, keep=keep):
            self._gave_up(facts, GiveUpReason.BUDGET_SPENT)
            raise for_caller(failure)
        decision = self._decide(facts, frozenset(tried))
        if isinstance(decision, Reject):
            if (
                failure is not None
                and failure.code == grpc.StatusCode.NOT_FOUND
                and decision.reason is not RejectReason.DEADLINE
            ):
                raise for_caller(failure)
            raise self._refused(facts, decision, retried=bool(tried))
        if failure is not None:
            spent = self._budget.try_spend(now_s, keep=keep)  # at now_s, none spent since
            assert spent, "the retry budget changed within one synchronous call"
            self._metrics.retries_total.labels(facts.name, facts.version).inc()
        tried.add(decision.worker_id)
        return decision

    def _decide(self, facts: CallFacts, tried: frozenset[str]) -> Route | Reject:
        name, version, now_s = facts.name, facts.version, time.monotonic()
        decision = self._table.route(
            name,
            version,
            facts.num_rows,
            facts.deadline_s - now_s,
            now_s,
            tried,
            is_batch=facts.priority is PriorityClass.BATCH,
            tenant=facts.tenant,
            weight=facts.weight,
        )
        if isinstance(decision, Route):
            self._metrics.routed_total_of[(name, version, decision.worker_id)].inc()
            self._metrics.predicted_wait_seconds_of[(name, version)].observe(decision.predicted_s)
        return decision

    def _refused(self, facts: CallFacts, decision: Reject, *, retried: bool) -> Exception:
        self._metrics.rejected_total_of[(facts.name, facts.version, decision.reason.value)].inc()
        return rejection(decision, retried=retried)

    def _note_outcome(self, route: Route, sent_s: float, error: UpstreamError | None) -> None:
        """Tells the timeout ejector (services.router.ejection) how a worker answered: any
        status but DEADLINE_EXCEEDED and UNAVAILABLE (ejected on its own) shows it answers,
        except a message past a size limit, which the link refuses before sending it: counted,
        a call too large lifted a wedged worker's ejection (review finding)."""
        now_s = time.monotonic()
        timeouts = self._table.timeouts
        if error is not None and is_too_large(error.code, str(error)):
            return
        if error is None or error.code not in _NO_ANSWER:
            timeouts.record_success(route.worker_id, now_s, sent_s)
        elif error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            waited_s = now_s - sent_s
            period_s = timeouts.record_timeout(
                route.worker_id, now_s, waited_s=waited_s, predicted_s=route.predicted_s
            )
            if period_s is not None:
                log.warning(
                    "worker %s ejected for %.0fs: its calls only time out (it is still routed "
                    "to while no other worker of its model version is routable)",
                    route.worker_id,
                    period_s,
                )
                self._metrics.ejections_total.labels(route.worker_id).inc()

    def _note_cancelled(self, route: Route, sent_s: float, deadline_s: float) -> None:
        """Our caller's deadline is the call's, and gRPC may cancel us on it before the call's
        own timer fires: a call cancelled at its deadline timed out there too."""
        if time.monotonic() >= deadline_s - DEADLINE_SLACK_S:
            timed_out = UpstreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
            self._note_outcome(route, sent_s, timed_out)

    def _gave_up(self, facts: CallFacts, reason: GiveUpReason) -> None:
        self._metrics.retries_given_up_total_of[(facts.name, facts.version, reason.value)].inc()

    def _keep(self, facts: CallFacts) -> float:
        """Retry tokens a retry of this call must leave (RetryBudget.batch_keep)."""
        return self._budget.batch_keep if facts.priority is PriorityClass.BATCH else 0.0

    def _after_failure(
        self,
        error: UpstreamError,
        route: Route,
        attempt: int,
        facts: CallFacts,
    ) -> None:
        """Returns to retry on another worker, or raises the error for our caller
        (services.router.retry says which). An UNAVAILABLE worker is ejected either way; one
        that answered NOT_FOUND (it unloaded the version since our snapshot) is only left."""
        is_unavailable = error.code == grpc.StatusCode.UNAVAILABLE
        now_s = time.monotonic()
        decision = decide_retry(
            is_worker_unavailable=is_unavailable or error.code == grpc.StatusCode.NOT_FOUND,
            attempt=attempt,
            max_retries=self._max_retries,
            deadline_s=facts.deadline_s,
            now_s=now_s,
            budget=self._budget,
            keep=self._keep(facts),
        )
        if is_unavailable:
            self._table.eject(route.worker_id, now_s)
        if isinstance(decision, GiveUp):
            if decision.reason is not GiveUpReason.ANSWERED:
                self._gave_up(facts, decision.reason)
            if is_unavailable:  # once a period per worker and reason: a fault fails every call
                reason = decision.reason.value
                _sparse.warning((route.worker_id, reason), "worker %s unavailable (%s); not "
                                "retried: %s", route.worker_id, error, reason)  # fmt: skip
            raise for_caller(error)
        _sparse.warning(
            route.worker_id,
            "worker %s could not serve it (%s); retrying elsewhere", route.worker_id, error,
        )  # fmt: skip


def _timeout_s(deadline_s: float) -> float | None:
    """A downstream call's gRPC timeout for an absolute deadline (None for none)."""
    return None if math.isinf(deadline_s) else max(0.0, deadline_s - time.monotonic())
