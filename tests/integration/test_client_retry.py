"""The slim client's retries (inference_fabric_client.retry) against a real gRPC server on
port 0 that refuses for load before it serves: the client waits the hint and sends again while
its deadline and its retry budget allow, and never retries what was not refused for load."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from inference_fabric_client import Client, FabricError, ThrottledError
from inference_fabric_client import client as client_module
from inference_fabric_client.retry import RetryPolicy
from inference_fabric_client.throttle import ThrottlePolicy

from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import types_pb2
from tests.support.clock import FakeClock
from tests.support.sync_servers import sync_servers

pytestmark = pytest.mark.integration


@dataclass
class Refusing(api_grpc.InferenceServiceServicer):
    """Refuses the first `refusals` Predicts (RESOURCE_EXHAUSTED, `hint_ms`; None: no hint),
    then answers."""

    refusals: int = 0
    hint_ms: int | None = 20
    code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED
    #: How long each answer takes, seconds.
    delay_s: float = 0.0
    calls: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    breaks_after_first: bool = False

    def Predict(self, request: api.PredictRequest, context: Any) -> api.PredictResponse:
        with self.lock:
            self.calls.append(time.monotonic())
            refuse = len(self.calls) <= self.refusals
        time.sleep(self.delay_s)
        if refuse:
            if self.hint_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(self.hint_ms)),))
            context.abort(self.code, "busy")
        return api.PredictResponse(model_name=request.model_name, model_version="1")

    def Generate(self, request: api.GenerateRequest, context: Any) -> Iterator[Any]:
        """Refused as Predict is (the same count), else "a", "b", then `code` if
        `breaks_after_first` (a stream cut after its first message)."""
        with self.lock:
            self.calls.append(time.monotonic())
            refuse = len(self.calls) <= self.refusals
        if refuse:
            if self.hint_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(self.hint_ms)),))
            context.abort(self.code, "busy")
        yield types_pb2.GenerateResponse(text="a", token_ids=[1])
        if self.breaks_after_first:
            context.abort(self.code, "cut")
        yield types_pb2.GenerateResponse(text="b", token_ids=[2])


@pytest.fixture
def serve() -> Iterator[Any]:
    with sync_servers(api_grpc.add_InferenceServiceServicer_to_server) as start:
        yield start


def test_a_refused_call_is_sent_again_after_the_hint(serve: Any) -> None:
    servicer = Refusing(refusals=2, hint_ms=50)
    with Client(serve(servicer)) as client:
        result = client.predict("m", ["hello"], timeout_s=10)
    assert result.model == "m"
    assert len(servicer.calls) == 3
    gaps = [b - a for a, b in zip(servicer.calls, servicer.calls[1:], strict=False)]
    assert all(gap >= 0.05 for gap in gaps), gaps


def test_retries_stop_at_max_retries_and_at_the_deadline(serve: Any) -> None:
    servicer = Refusing(refusals=100, hint_ms=10)
    policy = RetryPolicy(max_retries=3)
    with Client(serve(servicer), retry=policy) as client, pytest.raises(FabricError) as raised:
        client.predict("m", ["hello"], timeout_s=10)
    assert raised.value.code == "RESOURCE_EXHAUSTED" and raised.value.retry_after_s == 0.01
    assert len(servicer.calls) == 4

    slow = Refusing(refusals=100, hint_ms=5000)
    with Client(serve(slow)) as client, pytest.raises(FabricError):
        client.predict("m", ["hello"], timeout_s=1)
    assert len(slow.calls) == 1  # the hint is past the deadline: no retry


def test_the_budget_bounds_retries_to_a_share_of_calls(serve: Any) -> None:
    servicer = Refusing(refusals=1000, hint_ms=1)
    policy = RetryPolicy(max_retries=5, ratio=0.1, min_tokens=2, refill_per_s=0.0)
    with Client(serve(servicer), retry=policy, throttle=None) as client:
        for _ in range(20):
            with pytest.raises(FabricError):
                client.predict("m", ["hello"], timeout_s=10)
    # 20 calls; the budget starts at 2 retries and earns 0.1 per call (capped at 2): at most
    # 2 + 20 * 0.1 = 4 retries, where unbudgeted the client would have sent 100 more.
    assert 20 < len(servicer.calls) <= 24


def test_a_call_dropped_unseen_is_sent_again_after_a_jittered_wait(serve: Any) -> None:
    """CANCELLED that this client did not cause by closing (a gateway's grpc dropped the call
    before any Python saw it, past --max-pending-calls) carries no hint: it is sent again
    after `dropped_retry_s`, jittered to within 0.5-1.5 of it."""
    servicer = Refusing(refusals=2, hint_ms=None, code=grpc.StatusCode.CANCELLED)
    policy = RetryPolicy(dropped_retry_s=0.2)
    with Client(serve(servicer), retry=policy) as client:
        assert client.predict("m", ["hello"], timeout_s=10).model == "m"
    assert len(servicer.calls) == 3
    gaps = [b - a for a, b in zip(servicer.calls, servicer.calls[1:], strict=False)]
    assert all(gap >= 0.1 for gap in gaps), gaps

    dropped = Refusing(refusals=100, hint_ms=None, code=grpc.StatusCode.CANCELLED)
    policy = RetryPolicy(max_retries=2, dropped_retry_s=0.01)
    with Client(serve(dropped), retry=policy) as client, pytest.raises(FabricError) as raised:
        client.predict("m", ["hello"], timeout_s=10)
    assert raised.value.code == "CANCELLED" and len(dropped.calls) == 3


def test_a_generation_dropped_before_its_first_message_is_sent_again_never_after(
    serve: Any,
) -> None:
    """A generation dropped unseen (or refused with a hint) failed the call: the client sent
    only its predicts again (review finding). Until its first message came it is sent again
    as a predict is; a stream cut after one is not (its text reached the caller)."""
    servicer = Refusing(refusals=2, hint_ms=None, code=grpc.StatusCode.CANCELLED)
    policy = RetryPolicy(dropped_retry_s=0.05)
    with Client(serve(servicer), retry=policy) as client:
        texts = [chunk.text for chunk in client.generate("m", "hi", timeout_s=10)]
    assert texts == ["a", "b"] and len(servicer.calls) == 3

    cut = Refusing(code=grpc.StatusCode.CANCELLED, breaks_after_first=True)
    received = []
    with Client(serve(cut), retry=policy) as client, pytest.raises(FabricError) as raised:
        for chunk in client.generate("m", "hi", timeout_s=10):
            received.append(chunk.text)
    assert raised.value.code == "CANCELLED"
    assert received == ["a"] and len(cut.calls) == 1


def _close_once_called(
    servicer: Refusing, client: Client, after_s: float, timeout_s: float = 10
) -> FabricError:
    """Closes `client` from this thread `after_s` after its predict (in another thread, of
    `timeout_s`) reached `servicer`; returns the predict's failure, which must come within
    10 s."""
    with futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.predict, "m", ["hello"], timeout_s=timeout_s)
        deadline = time.monotonic() + 10
        while not servicer.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(after_s)
        client.close()
        with pytest.raises(FabricError) as raised:
            call.result(timeout=10)
    return raised.value


def test_a_call_cut_short_by_closing_the_client_is_not_retried(serve: Any) -> None:
    """Closing the client (from another thread) ends its calls CANCELLED: that is not a
    drop, and sending again on the closed channel would fail with grpc's ValueError."""
    servicer = Refusing(delay_s=2.0)
    failure = _close_once_called(servicer, Client(serve(servicer)), after_s=0.0)
    assert failure.code == "CANCELLED"
    assert len(servicer.calls) == 1


def test_a_client_closed_while_it_waits_to_retry_sends_nothing_again(serve: Any) -> None:
    """Closed during the wait for a retry (a 20 s hint here, within the call's 60 s), the
    call fails at once: the wait slept its whole hint before it looked (review finding: a
    60 s store-full hint held a closing program's thread a minute)."""
    servicer = Refusing(refusals=1, hint_ms=20_000)
    # 0.3 s after the call arrived, its refusal is back: the client waits its hint (wide
    # margins both ways: a loaded machine may be slow to hand the refusal back, or to close).
    failure = _close_once_called(servicer, Client(serve(servicer)), after_s=0.3, timeout_s=60)
    assert failure.code == "RESOURCE_EXHAUSTED"
    assert len(servicer.calls) == 1


def test_other_failures_are_never_retried(serve: Any) -> None:
    servicer = Refusing(refusals=1, code=grpc.StatusCode.UNAVAILABLE)
    with Client(serve(servicer)) as client, pytest.raises(FabricError) as raised:
        client.predict("m", ["hello"], timeout_s=10)
    assert raised.value.code == "UNAVAILABLE"
    assert len(servicer.calls) == 1


def test_a_timeout_of_zero_is_due_at_once_not_the_clients_default(serve: Any) -> None:
    servicer = Refusing()
    with Client(serve(servicer)) as client, pytest.raises(FabricError) as raised:
        client.predict("m", ["hello"], timeout_s=0.0)
    assert raised.value.code == "DEADLINE_EXCEEDED"


def test_a_client_refused_by_most_calls_refuses_some_itself_unsent(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adaptive throttling (inference_fabric_client.throttle), on by default, against a real
    server that refuses every predict without a hint: past `min_requests`, the client refuses
    calls itself, unsent, as ThrottledError (RESOURCE_EXHAUSTED with a hint), for that model
    only; once the server accepts again and the window has passed, every call is sent again.
    Unthrottled, every call reaches the server. The client's clock (it reads time.monotonic
    alone) moves when the test moves it: every call falls in the throttle's window however
    slowly the machine answers, and a window passes at once."""
    clock = FakeClock()
    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(monotonic=clock))
    servicer = Refusing(refusals=1000, hint_ms=None)
    with Client(serve(servicer)) as client:
        failures = []
        for _ in range(60):
            with pytest.raises(FabricError) as raised:
                client.predict("m", ["hello"], timeout_s=10)
            failures.append(raised.value)
        local = [f for f in failures if isinstance(f, ThrottledError)]
        assert {f.code for f in failures} == {"RESOURCE_EXHAUSTED"}
        assert all(f.retry_after_s == 0.2 and "refused by this client" in str(f) for f in local)
        # The first 20 are all sent; then each is refused here with a chance near 1 - 1/n.
        assert 20 <= len(servicer.calls) < 40 and len(local) == 60 - len(servicer.calls)
        servicer.refusals = 0  # another model's calls are not throttled
        assert client.predict("other", ["hello"], timeout_s=10).model == "other"

    policy = ThrottlePolicy(window_s=1.0, min_requests=10)
    recovering = Refusing(refusals=30, hint_ms=None)
    with Client(serve(recovering), throttle=policy) as client:
        for _ in range(30):
            with pytest.raises(FabricError):
                client.predict("m", ["hello"], timeout_s=10)
        sent = len(recovering.calls)
        assert sent < 30
        recovering.refusals = 0
        clock.now_s += policy.window_s  # a window: the refusals are forgotten
        for _ in range(20):
            assert client.predict("m", ["hello"], timeout_s=10).model == "m"
        assert len(recovering.calls) == sent + 20

    unthrottled = Refusing(refusals=1000, hint_ms=None)
    with Client(serve(unthrottled), throttle=None) as client:
        for _ in range(60):
            with pytest.raises(FabricError):
                client.predict("m", ["hello"], timeout_s=10)
    assert len(unthrottled.calls) == 60


def test_a_client_sends_no_retry_while_its_throttle_refuses(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call retried until accepted would hide the refusal from the throttle, so while it
    refuses calls (its chance above 0), a refused call is not sent again. Every draw is 0.999,
    so every call is sent: the first, with nothing counted before it, is retried twice, and
    each of the 29 after it reaches the server once. Unthrottled, each is retried as the
    budget allows."""
    monkeypatch.setattr("inference_fabric_client.client.random.random", lambda: 0.999)
    servicer = Refusing(refusals=1000, hint_ms=1)
    policy = ThrottlePolicy(min_requests=0)
    retry = RetryPolicy(max_retries=2)
    with Client(serve(servicer), throttle=policy, retry=retry) as client:
        for _ in range(30):
            with pytest.raises(FabricError) as raised:
                client.predict("m", ["hello"], timeout_s=10)
            assert not isinstance(raised.value, ThrottledError)
    assert len(servicer.calls) == 3 + 29

    unthrottled = Refusing(refusals=1000, hint_ms=1)
    with Client(serve(unthrottled), throttle=None, retry=retry) as client:
        for _ in range(30):
            with pytest.raises(FabricError):
                client.predict("m", ["hello"], timeout_s=10)
    assert len(unthrottled.calls) > 3 + 29


def test_a_message_past_the_size_limit_is_no_refusal_for_load(serve: Any) -> None:
    """grpc answers a message past the server's size limit RESOURCE_EXHAUSTED, with no hint:
    nothing to do with load. The throttle counted it as a refusal, so an app that sent one
    oversized call in two had about a quarter of its small, valid calls refused unsent
    (ThrottledError) by a gateway that refused nothing for load."""
    servicer = Refusing(refusals=0)
    address = serve(servicer, (("grpc.max_receive_message_length", 64 * 1024),))
    with Client(address) as client:
        for _ in range(40):
            with pytest.raises(FabricError) as raised:
                client.predict("m", ["x" * (100 * 1024)], timeout_s=10)
            assert raised.value.code == "RESOURCE_EXHAUSTED"
            assert not isinstance(raised.value, ThrottledError)
            assert client.predict("m", ["hello"], timeout_s=10).model == "m"
    assert len(servicer.calls) == 40  # the small ones: every one sent and served
