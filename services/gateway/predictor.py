"""The fixed-cost request path both public APIs share: check, resolve, tokenize, forward."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from services.common.bundles import SliceCancels
from services.common.errors import InvalidInput, Overloaded, UpstreamError
from services.common.multiplex import MultiplexClient
from services.common.priority import PriorityClass
from services.common.registry_schema import route_metadata
from services.common.sampling import checked_sampling
from services.common.templated_text import TemplatedText
from services.common.tracing import current_traceparent, outgoing_metadata
from services.gateway import model_inputs
from services.gateway.admission import TenantAdmission, never_served
from services.gateway.auth import Principal
from services.gateway.bundle_clock import DEFAULT_CLOCK, BundleClock
from services.gateway.bundle_parts import BundleKey, deadline_class
from services.gateway.call_rows import check_call_rows, max_bundle_rows
from services.gateway.catalog import ModelCatalog, ResolvedModel
from services.gateway.coalescer import Coalescer
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_inputs import BundleTokenizers, PredictValue, checked_rows
from services.gateway.router_retry import (
    ROUTER_STREAMS,
    GiveUp,
    RouterRetryConfig,
    decide_resend,
)
from services.gateway.throttle import AdaptiveThrottle, ThrottleConfig, throttle_key
from services.gateway.triton_info import InferenceStatistics
from services.pb.inference.v1 import worker_pb2 as pb

GENERATE_METHOD = "/inference.v1.WorkerService/Generate"


@dataclass(slots=True)  # made per call: not frozen, whose fields are set at a call each
class PredictCall:
    model_name: str
    version_spec: str
    inputs: Sequence[PredictValue]
    principal: Principal
    request_id: str
    #: The client's remaining time, or None without a deadline.
    timeout_s: float | None
    #: The class the caller asked for; None: its tenant's default.
    priority: PriorityClass | None = None
    #: Text models: a text longer than the model takes is cut to its first tokens, not refused
    #: (None: as its config's `[embedding] truncate` says).
    truncate: bool | None = None
    #: Embedding models that L2-normalize: the outputs before normalization.
    unnormalized: bool = False


@dataclass(frozen=True)
class GenerateCall:
    model_name: str
    version_spec: str
    prompt: str
    sampling: pb.SamplingParameters
    principal: Principal
    request_id: str
    #: The client's remaining time for the whole stream, or None without a deadline.
    timeout_s: float | None
    #: The class the caller asked for; None: its tenant's default.
    priority: PriorityClass | None = None
    #: A chat prompt the model's template rendered (`prompt` is its text), its special tokens
    #: read as tokens; None: the prompt is all the caller's text.
    templated: TemplatedText | None = None
    #: No max_tokens (0) fills the context left (OpenAI's chat; the worker's limits), not 16.
    fills_context: bool = False
    #: Told the version number that serves it, once resolved (what its answers name).
    on_version: Callable[[str], None] | None = None


@dataclass(slots=True)  # made per call, as PredictCall
class PredictResult:
    model_name: str
    model_version: str
    outputs: list[np.ndarray]
    request_id: str
    #: Text models: the tokens of every input row, special tokens included (0 otherwise).
    num_tokens: int = 0


class Predictor:
    def __init__(
        self,
        catalog: ModelCatalog,
        router: grpc.aio.Channel,
        metrics: GatewayMetrics,
        *,
        max_inputs: int,
        throttle: ThrottleConfig,
        admission: TenantAdmission,
        rng: random.Random | None = None,
        retry: RouterRetryConfig | None = None,
        clock: BundleClock = DEFAULT_CLOCK,
        pickup_delay_s: Callable[[], float],
    ) -> None:
        self.catalog = catalog
        self.admission = admission
        self._metrics = metrics
        self._max_inputs = max_inputs
        self._throttle = AdaptiveThrottle(throttle)
        self._rng = rng or random.Random()
        self._retry = retry or RouterRetryConfig()
        #: Triton-style per-version tally of the Predict calls this gateway answered.
        self.statistics = InferenceStatistics()
        #: Set as the gateway stops: its open streams take no new requests (kserve_infer).
        self.draining = asyncio.Event()
        catalog.on_removed += (self.statistics.forget, metrics.inputs_total_of.remove_from)
        self._id_prefix = os.urandom(8).hex()
        self._ids = itertools.count()
        # Every fixed-cost request to the router travels on one multiplexed stream.
        self._router = MultiplexClient(router, "router", streams=ROUTER_STREAMS)
        # ... in bundles: concurrent calls for one model version share one downstream call.
        # Kept per version, as long as it is current (versions come and go).
        self._bundles = Coalescer(
            self._call_router, metrics, clock=clock, pickup_delay_s=pickup_delay_s,
            is_stale=lambda key: not catalog.is_current(key.model, key.version, key.fingerprint),
        )  # fmt: skip
        self.tokenizers = BundleTokenizers(catalog.is_current, metrics.tokenize_seconds.labels)
        self._generate = router.unary_stream(
            GENERATE_METHOD,
            request_serializer=pb.WorkerGenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )

    def _new_request_id(self) -> str:
        """A request id for a call that brought none: 32 hex digits, unique as a UUID4 is (a
        random prefix per process, then a count), at a fraction of uuid4's cost per call."""
        return f"{self._id_prefix}{next(self._ids):016x}"

    @property
    def max_inputs(self) -> int:
        """Most rows one call may carry."""
        return self._max_inputs

    async def predict(self, call: PredictCall) -> PredictResult:
        policy = call.principal.policy
        priority = self.admission.priority_for(policy, call.priority)
        with self.admission.observe(policy.name, priority, call.timeout_s):
            return await self._predict(call, priority)

    async def _predict(self, call: PredictCall, priority: PriorityClass) -> PredictResult:
        started = time.perf_counter()
        if not call.inputs:
            raise InvalidInput("request has no inputs")
        model_inputs.check_num_inputs(len(call.inputs), self._max_inputs)
        config = self.catalog.config(call.model_name)
        call.principal.check_model(config.name)
        if config.generation is not None:
            raise InvalidInput(f"{config.name} is a generation model: call Generate")
        check_call_rows(config, len(call.inputs), priority)  # never served: not a retry
        model = self.catalog.resolve(
            call.model_name, call.version_spec, sticky_key=call.request_id or None
        )
        self._metrics.validate_seconds.observe(time.perf_counter() - started)
        is_ok = False
        try:
            result = await self._predict_resolved(call, model, priority, started)
            is_ok = True
            return result
        finally:
            self.statistics.record(
                config.name, model.version, rows=len(call.inputs), is_ok=is_ok,
                duration_s=time.perf_counter() - started, finished_unix_s=time.time(),
            )  # fmt: skip

    async def _predict_resolved(
        self, call: PredictCall, model: ResolvedModel, priority: PriorityClass, started: float
    ) -> PredictResult:
        config, policy = model.config, call.principal.policy
        truncate = config.embedding.truncate if call.truncate is None else call.truncate
        # The throttle first: a call it refuses here was never served, and must not spend its
        # tenant's rows (after a flood the tenant would be refused for rows it never got).
        throttle_key = self._throttle_check(config.name, priority, policy.name)
        # Its rows return to its tenant if it is never served (admission.never_served): its
        # input refused, here or when its bundle is tokenized, or refused downstream unrun.
        with self.admission.rows_charged(policy, len(call.inputs)) as charged:
            rows = checked_rows(model, call.inputs, truncate=truncate)
            request_id = call.request_id or self._new_request_id()
            piece = pb.Slice(
                rows=len(rows),
                tenant=call.principal.tenant,
                tenant_weight=policy.weight,
                priority=priority.proto,
                request_id=request_id,
                unnormalized=call.unnormalized,
                traceparent=current_traceparent(),
            )
            # The router and worker see what is left of the deadline as their own gRPC deadline.
            timeout_s = config.timeout_s_for(call.timeout_s) - (time.perf_counter() - started)
            is_text = model.encoder is not None
            key = BundleKey(
                config.name, model.version, model.fingerprint, priority.value,
                is_text=is_text, truncate=truncate, deadline_class=deadline_class(timeout_s),
            )  # fmt: skip
            try:
                answered = await self._bundles.call(
                    key,
                    rows,
                    piece,
                    deadline_s=time.monotonic() + timeout_s,
                    max_rows=max_bundle_rows(config, priority),
                    prepare=self.tokenizers.get(model, truncate=truncate) if is_text else None,
                    on_unsent=charged.give_back,  # dropped here: ran nowhere
                )
            except UpstreamError as error:
                # Expired here unsent, downstream never saw it: no accept of theirs to count.
                if not (error.code == grpc.StatusCode.DEADLINE_EXCEEDED and error.ran_nothing):
                    self._throttle.record(
                        throttle_key,
                        time.monotonic(),
                        is_accepted=not error.is_overload,
                        retry_after_s=error.retry_after_s,
                    )
                raise
        self._throttle.record(throttle_key, time.monotonic(), is_accepted=True)
        self._metrics.inputs_total_of[(config.name, model.version)].inc(len(rows))
        num_tokens = sum(len(r) for r in answered.rows) if is_text else 0
        return PredictResult(config.name, model.version, answered.outputs, request_id, num_tokens)

    async def _call_router(
        self,
        request: bytes,
        metadata: Sequence[tuple[str, str]],
        deadline_s: float,
        slice_cancels: SliceCancels,
    ) -> bytes:
        """One bundle, resent to another router while refused as never started."""
        attempt = 0
        while True:
            try:
                return await self._router.call(
                    request,
                    metadata=metadata,
                    timeout_s=max(0.0, deadline_s - time.monotonic()),
                    slice_cancels=slice_cancels,
                )
            except UpstreamError as error:
                if not await self._may_resend(error, attempt, deadline_s, "predict"):
                    raise
            attempt += 1

    async def _may_resend(
        self, error: UpstreamError, attempt: int, deadline_s: float, rpc: str
    ) -> bool:
        """False when the call must fail with `error`; otherwise counts the resend, backs off
        and returns True."""
        decision = decide_resend(
            is_not_started=error.is_not_started, attempt=attempt,
            time_left_s=deadline_s - time.monotonic(), random_value=self._rng.random(),
            config=self._retry,
        )  # fmt: skip
        if isinstance(decision, GiveUp):
            return False
        self._metrics.router_retries_total.labels(rpc).inc()
        await asyncio.sleep(decision.delay_s)
        return True

    def _throttle_check(self, model: str, priority: PriorityClass, tenant: str) -> str:
        """Refuses here (RESOURCE_EXHAUSTED) the share of requests downstream is refusing
        anyway, before any tokenizing or forwarding is spent on them. Kept per model, class
        and tenant: a flood of `batch` work, or one tenant's, is refused downstream, and it
        must not teach the gateway to refuse everyone else's. Returns the throttle's key."""
        key = throttle_key(model, priority, tenant)
        shed = self._throttle.admit(key, time.monotonic(), self._rng.random())
        if priority is not PriorityClass.BATCH:  # its gauge: the highest of its online keys'
            self._metrics.follow_throttle(model, self._throttle.highest_probability)
        if shed is not None:
            self._metrics.throttled_total_of[(model,)].inc()
            self.admission.refused(tenant, "throttled")
            raise Overloaded(
                f"{model}: overloaded, refused at the gateway (downstream is refusing work; "
                f"{shed.probability:.0%} of requests are refused here now)",
                retry_after_s=shed.retry_after_s,
            )
        return key

    async def close(self) -> None:
        await self._bundles.close()
        await self._router.close()

    async def generate(self, call: GenerateCall) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Checks, tokenizes and forwards a generation; yields the worker's stream messages."""
        policy = call.principal.policy
        priority = self.admission.priority_for(policy, call.priority)
        with self.admission.observe(policy.name, priority, call.timeout_s):
            # Each stream closed with its caller's: the downstream call is cancelled now.
            async with contextlib.aclosing(self._generate_stream(call, priority)) as messages:
                async for message in messages:
                    yield message

    async def _generate_stream(
        self, call: GenerateCall, priority: PriorityClass
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        config = self.catalog.config(call.model_name)
        # The caller's deadline as it stands now: resolving and tokenizing come out of it.
        deadline_s = time.monotonic() + config.timeout_s_for(call.timeout_s)
        call.principal.check_model(config.name)
        if config.generation is None:
            raise InvalidInput(f"{config.name} is not a generation model: call Predict")
        model = self.catalog.resolve(
            call.model_name, call.version_spec, sticky_key=call.request_id or None
        )
        if call.on_version is not None:
            call.on_version(model.version)
        started = time.perf_counter()
        is_ok = False
        try:
            max_model_len = config.generation.max_model_len
            generated = self._generate_resolved(
                call, model, priority, max_model_len=max_model_len, deadline_s=deadline_s
            )
            async with contextlib.aclosing(generated) as messages:
                async for message in messages:
                    yield message
            is_ok = True
        finally:
            # One generation is one request of one row, as Triton counts a decoupled model.
            self.statistics.record(
                config.name, model.version, rows=1, is_ok=is_ok,
                duration_s=time.perf_counter() - started, finished_unix_s=time.time(),
            )  # fmt: skip

    async def _generate_resolved(
        self,
        call: GenerateCall,
        model: ResolvedModel,
        priority: PriorityClass,
        *,
        max_model_len: int,
        deadline_s: float,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """`deadline_s`: the caller's, on time.monotonic()."""
        config = model.config
        if model.encoder is None:
            raise InvalidInput(f"{config.name} has no tokenizer")
        with self.admission.rows_charged(call.principal.policy, 1):
            if call.templated is not None:
                ids = model.encoder.encode_templated(call.templated)
            else:
                (ids,) = model.encoder.encode_many([call.prompt])
            fills_context = call.fills_context and not call.sampling.max_tokens
            checked_sampling(call.sampling, max_model_len=max_model_len, prompt_len=len(ids),
                             fills_context=fills_context)  # fmt: skip
        request = pb.WorkerGenerateRequest(
            model_name=config.name,
            model_version=model.version,
            fingerprint=model.fingerprint,
            token_ids=ids.astype("<i4").tobytes(),
            sampling=call.sampling,
            fills_context=fills_context,
            tenant=call.principal.tenant,
            request_id=call.request_id or self._new_request_id(),
            priority=priority.proto,
            tenant_weight=call.principal.policy.weight,
        )
        route = route_metadata(
            config.name, model.version, len(ids), priority.value,
            tenant=call.principal.tenant, weight=call.principal.policy.weight,
        )  # fmt: skip
        metadata = outgoing_metadata(route)
        for attempt in itertools.count():
            # wait_for_ready: while no router can be reached the call waits (within its
            # deadline) for one, instead of failing; it was sent nowhere meanwhile.
            stream = self._generate(
                request,
                timeout=max(0.0, deadline_s - time.monotonic()),
                metadata=metadata,
                wait_for_ready=True,
            )
            has_sent = False
            try:
                while isinstance(message := await stream.read(), pb.GenerateResponse):  # not EOF
                    has_sent = True
                    yield message
                return
            except grpc.aio.AioRpcError as error:
                failure = UpstreamError.from_rpc_error(error).as_not_served_now()
                # Resent only before the first message: a stream is never replayed.
                if has_sent or not await self._may_resend(failure, attempt, deadline_s, "generate"):
                    if not has_sent and never_served(failure):
                        self.admission.give_back_rows(call.principal.policy, 1)
                    raise failure from None
            finally:
                stream.cancel()  # our caller left mid-stream: stop the worker's generation too
