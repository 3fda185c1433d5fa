"""A blocking client for the gateway's public API (`inference.v1.InferenceService`).

    from inference_fabric_client import Client

    with Client("gateway.example.com:8001", api_key="...", tls=True) as client:
        vectors = client.embed(["hello world"])                  # numpy [1, 384]
        for chunk in client.generate("tiny-llama", "Once upon", max_tokens=16):
            print(chunk.text, end="")

Every call takes `timeout_s` (the call's deadline; default the client's) and `priority`
("critical", "interactive", "batch"; default the tenant's). Failures raise `FabricError` with
the gRPC status name, the server's message and, for RESOURCE_EXHAUSTED, its retry hint. A
predict refused for load is sent again after the server's hint, and one the gateway's grpc
dropped unseen (CANCELLED) after a short jittered wait, while its deadline allows, within a
retry budget (`retry`, inference_fabric_client.retry), and not while the throttle (below)
refuses; `RetryPolicy(max_retries=0)` turns that off. Job calls (`jobs()`) are sent again the
same way, a submit dropped unseen only when it carries an idempotency key. While the gateway
refuses many of a model's predicts, the client refuses some of them itself, at no cost to the
gateway (`throttle`, inference_fabric_client.throttle): they raise `ThrottledError`
(RESOURCE_EXHAUSTED) unsent; `throttle=None` turns that off.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from inference_fabric_client._pb.inference.v1 import inference_pb2 as api
from inference_fabric_client._pb.inference.v1 import inference_pb2_grpc as api_grpc
from inference_fabric_client._pb.inference.v1 import jobs_pb2_grpc as jobs_grpc
from inference_fabric_client._pb.inference.v1 import types_pb2 as types
from inference_fabric_client.results import (
    FabricError,
    GenerationChunk,
    PredictResult,
    ThrottledError,
)
from inference_fabric_client.retry import RetryBudget, RetryPolicy, retry_after_s
from inference_fabric_client.tensors import to_array, to_tensor
from inference_fabric_client.throttle import (
    DEFAULT_THROTTLE,
    AdaptiveThrottle,
    ModelThrottles,
    ThrottlePolicy,
    is_accepted,
)

if TYPE_CHECKING:
    from inference_fabric_client.jobs import Jobs

_PRIORITIES = {
    None: types.PRIORITY_UNSPECIFIED,
    "critical": types.PRIORITY_CRITICAL,
    "interactive": types.PRIORITY_INTERACTIVE,
    "batch": types.PRIORITY_BATCH,
}
_FINISH_REASONS = {types.FINISH_REASON_LENGTH: "length", types.FINISH_REASON_STOP: "stop"}
#: The largest reply taken, the servers' bound (grpc's 4 MiB failed a bigger one, done work).
MAX_REPLY_BYTES = 64 * 1024 * 1024


def _read(path_or_bytes: str | Path | bytes | None) -> bytes | None:
    if path_or_bytes is None or isinstance(path_or_bytes, bytes):
        return path_or_bytes
    return Path(path_or_bytes).read_bytes()


def opening(open_stream: Callable[..., Any]) -> Callable[..., tuple[Any, list[Any]]]:
    """A server-streaming method as a call for `Client._attempts`: opens the stream and reads
    its first message, returning the stream and that message (none: a stream that ended
    without one), so that the opening is sent again as a unary call is, a dropped one or one
    refused for load, until a message came; never once it came (it reaches the caller)."""

    def opened(request: Any, *, timeout: float, metadata: Any) -> tuple[Any, list[Any]]:
        stream = open_stream(request, timeout=timeout, metadata=metadata)
        try:
            return stream, list(itertools.islice(stream, 1))
        except BaseException:
            stream.cancel()
            raise

    return opened


class Client:
    """One channel to a gateway; thread-safe; close it (or use `with`) when done."""

    def __init__(
        self,
        address: str = "127.0.0.1:8001",
        *,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: str | Path | bytes | None = None,
        client_certificate: str | Path | bytes | None = None,
        client_key: str | Path | bytes | None = None,
        server_name: str | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        throttle: ThrottlePolicy | None = DEFAULT_THROTTLE,
    ) -> None:
        """`tls`: verify the gateway with `root_certificates` (PEM; default the system's);
        `client_certificate`/`client_key` for mutual TLS; `server_name` overrides the name
        checked in the gateway's certificate. `retry`: when refused predicts are sent again
        (default RetryPolicy()). `throttle`: when this client refuses predicts itself while the
        gateway refuses many (None: never). Certificates or a server name without `tls` are a
        ValueError: the channel would be plaintext, and the API key would go out in clear."""
        if not (isinstance(timeout_s, int | float) and 0 < timeout_s < math.inf):
            # Every call would be due at once (0 or less), or never (NaN, inf).
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s}")
        tls_settings = (root_certificates, client_certificate, client_key, server_name)
        if not tls and any(setting is not None for setting in tls_settings):
            raise ValueError(
                "root_certificates, client_certificate, client_key and server_name need "
                "tls=True (without it the channel is plaintext)"
            )
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_REPLY_BYTES)]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls:
            credentials = grpc.ssl_channel_credentials(
                _read(root_certificates), _read(client_key), _read(client_certificate)
            )
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = api_grpc.InferenceServiceStub(self._channel)
        # Made now: grpc crashes the process making a stub on a channel another thread closed.
        self._jobs_stub = jobs_grpc.JobServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s
        self._retry = retry or RetryPolicy()
        self._budget = RetryBudget(self._retry)
        self._throttles = ModelThrottles(throttle) if throttle is not None else None
        #: Set once closed (from any thread): a call then cut short ends CANCELLED and is not
        #: retried, and a retry's wait ends at once.
        self._closed = threading.Event()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _is_closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        self._closed.set()
        self._channel.close()

    def jobs(self) -> Jobs:
        """Durable batch jobs over this client's channel (inference_fabric_client.jobs); once
        the client is closed, their calls fail CANCELLED unsent, as its predicts do."""
        from inference_fabric_client.jobs import Jobs

        return Jobs(
            self._jobs_stub,
            self._metadata,
            self._timeout_s,
            self._attempts,
            closed=self._closed,
        )

    def predict(
        self,
        model: str,
        inputs: Sequence[str | np.ndarray],
        *,
        version: str = "",
        priority: str | None = None,
        request_id: str = "",
        timeout_s: float | None = None,
    ) -> PredictResult:
        """Runs a fixed-cost model on texts (text models) or arrays (one row each)."""
        if isinstance(inputs, str | bytes):  # iterated: an input a character (review finding)
            raise TypeError("inputs must be a sequence of texts or arrays: wrap one text as [text]")
        rows = [
            api.PredictInput(text=x)
            if isinstance(x, str)
            else api.PredictInput(tensor=to_tensor(x))
            for x in inputs
        ]
        request = api.PredictRequest(
            model_name=model,
            model_version=version,
            inputs=rows,
            request_id=request_id,
            priority=_priority(priority),
        )
        throttles = self._throttles
        throttle = throttles.of(model, time.monotonic()) if throttles is not None else None
        reply = self._call_with_retries(
            self._stub.Predict, request, self._timeout(timeout_s), throttle
        )
        outputs = [to_array(t) for t in reply.outputs]
        return PredictResult(reply.model_name, reply.model_version, outputs, reply.request_id)

    def _timeout(self, timeout_s: float | None) -> float:
        """A call's timeout: the one given, else the client's. One of 0 or less is already
        due: DEADLINE_EXCEEDED without a call (gRPC may still serve a call whose deadline is
        now, before its timer fires). A closed client makes no call: CANCELLED (grpc's own
        error would be a ValueError)."""
        if self._is_closed:
            raise FabricError("CANCELLED", "the client is closed")
        if timeout_s is None:
            return self._timeout_s
        if timeout_s <= 0:
            raise FabricError("DEADLINE_EXCEEDED", f"timeout of {timeout_s} s: no time left")
        if not timeout_s < math.inf:  # NaN was sent as no time, inf as no deadline
            raise ValueError(f"timeout_s must be a finite number of seconds, got {timeout_s}")
        return timeout_s

    def _call_with_retries(
        self,
        method: object,
        request: object,
        timeout_s: float,
        throttle: AdaptiveThrottle | None = None,
    ) -> object:
        """`method(request)` within `timeout_s` in all, unless `throttle` refuses it unsent;
        a refusal for load with a retry hint, or a call dropped unseen, is sent again after its
        wait (`retry_after_s`) while time and the retry budget allow and `throttle` refuses
        nothing. A call ending in any other exception counts as accepted: the gateway did not
        refuse it."""
        if throttle is None:
            return self._attempts(method, request, timeout_s)
        now_s = time.monotonic()
        if not throttle.admits(now_s, random.random()):
            counts = throttle.counts(now_s)
            raise ThrottledError(
                "RESOURCE_EXHAUSTED",
                f"refused by this client, unsent: the gateway refuses this model's calls, and "
                f"accepted {counts.num_accepts} of the {counts.num_requests} asked of this "
                f"client in the last {throttle.policy.window_s:g} s (adaptive throttling; "
                f"Client(throttle=None) turns it off)",
                throttle.retry_after_s,
            )
        is_refused = False
        try:
            return self._attempts(method, request, timeout_s, throttle)
        except FabricError as failure:
            is_refused = not is_accepted(failure.code, failure.message)
            raise
        finally:
            throttle.record(time.monotonic(), accepted=not is_refused)

    def _attempts(
        self,
        method: object,
        request: object,
        timeout_s: float,
        throttle: AdaptiveThrottle | None = None,
        *,
        is_dropped_retried: bool = True,
        is_costly: bool = False,
    ) -> object:
        """The attempts of one call: the first, then retries while allowed, and none while
        `throttle` refuses calls (a retry would be a call it sheds, and one retried until
        accepted would hide the refusal from it). `is_dropped_retried` False: a call ending
        CANCELLED is not sent again (one that may have taken effect before it was cut, and is
        not idempotent). `is_costly`: a retry needs as long left as the refused attempt took
        (a job's items streamed again; a unary call's first attempt may include connecting)."""
        if self._is_closed:
            raise FabricError("CANCELLED", "the client is closed")
        deadline = time.monotonic() + timeout_s
        self._budget.on_call()
        for attempt in range(self._retry.max_retries + 1):
            sent_s = time.monotonic()
            try:
                return method(  # type: ignore[operator]
                    request, timeout=max(0.0, deadline - sent_s), metadata=self._metadata
                )
            except grpc.RpcError as error:
                failure = FabricError.from_rpc(error)
            except ValueError:  # grpc's "Cannot invoke RPC on closed channel!"
                if not self._is_closed:
                    raise
                raise FabricError("CANCELLED", "the client is closed") from None
            min_attempt_s = self._retry.min_attempt_s
            if is_costly:
                min_attempt_s = max(min_attempt_s, time.monotonic() - sent_s)
            if throttle is not None and not is_accepted(failure.code, failure.message):
                throttle.note_refused(time.monotonic())
            hint = retry_after_s(self._retry, failure.code, failure.retry_after_s)
            if (
                hint is None
                or (failure.code == "CANCELLED" and not is_dropped_retried)
                or self._is_closed
                or attempt == self._retry.max_retries
                or time.monotonic() + hint + min_attempt_s >= deadline
                or (throttle is not None and throttle.refusal_probability(time.monotonic()) > 0)
                or not self._budget.try_spend()
            ):
                raise failure from None
            if self._closed.wait(hint):  # closed during the wait: nothing is sent again
                raise failure from None
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def embed(
        self,
        texts: Sequence[str],
        *,
        model: str = "minilm",
        version: str = "",
        priority: str | None = None,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """Embeddings of `texts`, one row each: float32 [len(texts), dims]."""
        result = self.predict(model, texts, version=version, priority=priority, timeout_s=timeout_s)
        return np.stack(result.outputs)

    def generate(
        self,
        model: str,
        prompt: str,
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        version: str = "",
        priority: str | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[GenerationChunk]:
        """Streams the generation as it is produced; closing the iterator cancels it. Its
        arguments are checked here, at the call (a bad priority, a closed client, no time
        left), and the stream is opened at the first `next`."""
        sampling = types.SamplingParameters(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=stop
        )
        if seed is not None:
            sampling.seed = seed
        request = api.GenerateRequest(
            model_name=model,
            model_version=version,
            prompt=prompt,
            sampling=sampling,
            priority=_priority(priority),
        )
        return self._generated(request, self._timeout(timeout_s))

    def _generated(
        self, request: api.GenerateRequest, timeout_s: float
    ) -> Iterator[GenerationChunk]:
        """`generate`'s stream, opened at the first `next`."""
        # Sent again as a predict is (a drop, a refusal with a hint) until its first message
        # came, never after: a dropped generation failed the call (review finding).
        stream, first = self._attempts(opening(self._stub.Generate), request, timeout_s)
        try:
            for reply in itertools.chain(first, stream):
                yield GenerationChunk(
                    text=reply.text,
                    token_ids=list(reply.token_ids),
                    finish_reason=_FINISH_REASONS.get(reply.finish_reason),
                    prompt_tokens=reply.prompt_tokens,
                    completion_tokens=reply.completion_tokens,
                )
        except grpc.RpcError as error:
            raise FabricError.from_rpc(error) from None
        finally:
            stream.cancel()

    def models(self, *, timeout_s: float | None = None) -> list[dict[str, object]]:
        """The models this key may use: name, served versions and labels."""
        # Through the attempts a predict takes: a client closed meanwhile is CANCELLED there.
        reply: Any = self._attempts(
            self._stub.ListModels, api.ListModelsRequest(), self._timeout(timeout_s)
        )
        return [
            {
                "name": m.name,
                "versions": [v.model_version for v in m.versions],
                "labels": dict(m.labels),
            }
            for m in reply.models
        ]


def _priority(name: str | None) -> int:
    try:
        return _PRIORITIES[name]
    except KeyError:
        choices = "critical, interactive, batch"
        raise ValueError(f"priority must be one of {choices}; got {name!r}") from None
