"""The gateway's coalescer (services.gateway.coalescer) against a recorded downstream.

The downstream here is a function that records each bundle it is sent and answers it as a
worker would (or fails, or never answers): what these tests pin down is the coalescer's own
bookkeeping, which the integration and e2e tests exercise through real tiers.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.bundles import SliceCancels
from services.common.errors import (
    RETRY_AFTER_MS_KEY,
    Unavailable,
    UpstreamError,
    retry_after_trailer,
)
from services.common.model_repository import ModelConfig, parse_model_config
from services.common.moving_average import MovingAverage
from services.common.priority import PriorityClass
from services.common.tensors import tensor_from_pb, tensor_to_pb
from services.gateway import coalescer as coalescer_module
from services.gateway.admission import never_served
from services.gateway.bundle_clock import DEFAULT_CLOCK, BundleClock
from services.gateway.bundle_parts import BundleKey, deadline_class
from services.gateway.call_rows import max_bundle_rows, max_call_rows
from services.gateway.coalescer import DOWNSTREAM_WEIGHT, Coalescer
from services.gateway.metrics import GatewayMetrics
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit

INTERACTIVE = PriorityClass.INTERACTIVE

KEY = BundleKey("affine", "1", "f", "interactive", is_text=False)


class Downstream:
    """Answers each bundle with its rows doubled, after `delay_s` and once `gate` is open,
    reporting `worker_s` as its worker's time on it (0: not reported); records what it was
    sent."""

    def __init__(self, delay_s: float = 0.0, worker_s: float = 0.0) -> None:
        self.bundles: list[pb.InferRequest] = []
        self.delay_s = delay_s
        self.worker_s = worker_s
        self.gate = asyncio.Event()
        self.gate.set()
        #: Raised instead of answering, once the gate opens.
        self.error: Exception | None = None
        #: Sent instead of an answer, once the gate opens (a garbled one, say).
        self.garbled: bytes | None = None
        #: Per bundle sent (in order), the slices a worker refuses UNAVAILABLE unstarted.
        self.unstarted: list[set[int]] = []
        #: Per bundle sent (in order), the slices refused NOT_FOUND (no worker serves them).
        self.not_found: list[set[int]] = []
        #: The SliceCancels each bundle was sent with.
        self.cancels: list[SliceCancels] = []
        #: Bundles sent from this one on (counted from 0) are never answered.
        self.silent_from: int | None = None

    async def send(
        self,
        body: bytes,
        metadata: Sequence[tuple[str, str]],
        deadline_s: float,
        cancels: SliceCancels,
    ) -> bytes:
        request = pb.InferRequest.FromString(body)
        self.bundles.append(request)
        self.cancels.append(cancels)
        sent = len(self.bundles) - 1
        unstarted = self.unstarted[sent] if sent < len(self.unstarted) else set()
        not_found = self.not_found[sent] if sent < len(self.not_found) else set()
        if self.silent_from is not None and sent >= self.silent_from:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s)
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        if self.garbled is not None:
            return self.garbled
        rows = tensor_from_pb(request.packed.tensor)
        response = pb.InferResponse(worker_us=round(self.worker_s * 1e6))
        answered, start = [], 0
        for index, piece in enumerate(request.slices):
            if index in unstarted:
                refusal = Unavailable("worker stopping; retry elsewhere", is_not_started=True)
                response.slices.append(
                    pb.SliceStatus(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                   message=str(refusal), trailers=dict(refusal.trailers()))
                )  # fmt: skip
            elif index in not_found:
                response.slices.append(
                    pb.SliceStatus(code=grpc.StatusCode.NOT_FOUND.value[0],
                                   message="no worker serves m@1")
                )  # fmt: skip
            else:
                response.slices.append(pb.SliceStatus())
                answered.extend(rows[start : start + piece.rows])
            start += piece.rows
        if answered:
            response.packed_outputs.CopyFrom(tensor_to_pb(np.stack(answered) * 2))
        return response.SerializeToString()


def coalescer(
    downstream: Downstream,
    clock: BundleClock = DEFAULT_CLOCK,
    pickup_delay_s: float | Callable[[], float] = 0.0,
) -> Coalescer:
    """A coalescer sending to `downstream`; `pickup_delay_s` the door's pickup delay, or what
    reads it (a test that changes it as it goes)."""
    delay = pickup_delay_s if callable(pickup_delay_s) else lambda: pickup_delay_s
    return Coalescer(
        downstream.send, GatewayMetrics(CollectorRegistry()), clock=clock, pickup_delay_s=delay
    )


def rows(*values: float) -> list[np.ndarray]:
    return [np.full(2, v, dtype=np.float32) for v in values]


async def call(
    bundles: Coalescer,
    values: list[np.ndarray],
    *,
    timeout_s: float = 5.0,
    max_rows: int = 8,
    on_unsent: Callable[[], None] | None = None,
) -> list[np.ndarray]:
    answered = await bundles.call(
        KEY,
        values,
        pb.Slice(tenant="t"),
        deadline_s=time.monotonic() + timeout_s,
        max_rows=max_rows,
        on_unsent=on_unsent,
    )
    return answered.outputs


async def test_concurrent_calls_share_a_bundle_and_each_gets_its_own_rows() -> None:
    downstream = Downstream()
    bundles = coalescer(downstream)
    answers = await asyncio.gather(*(call(bundles, rows(i, i + 0.5)) for i in range(3)))
    assert len(downstream.bundles) == 1
    assert [s.rows for s in downstream.bundles[0].slices] == [2, 2, 2]
    for i, outputs in enumerate(answers):
        np.testing.assert_array_equal(np.stack(outputs)[:, 0], [2 * i, 2 * i + 1])


async def test_a_bundle_never_holds_more_than_the_max_rows() -> None:
    downstream = Downstream()
    bundles = coalescer(downstream)
    await asyncio.gather(*(call(bundles, rows(1, 2, 3), max_rows=8) for _ in range(4)))
    sizes = [sum(s.rows for s in b.slices) for b in downstream.bundles]
    assert sum(sizes) == 12
    assert max(sizes) <= 8


async def test_a_bundle_never_carries_more_bytes_than_one_call_may(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of a tensor model that would make a bundle past the internal call's byte limit
    start the next bundle, as rows past the max batch do: sent together, the call would fail
    every caller in it. Here the limit is 40 bytes and each caller's two rows 16."""
    monkeypatch.setattr(coalescer_module, "MAX_BUNDLE_BYTES", 40)
    downstream = Downstream()
    bundles = coalescer(downstream)
    answers = await asyncio.gather(*(call(bundles, rows(i, i)) for i in range(5)))
    sizes = [[s.rows for s in b.slices] for b in downstream.bundles]
    assert sizes == [[2, 2], [2, 2], [2]]
    for i, outputs in enumerate(answers):
        np.testing.assert_array_equal(np.stack(outputs)[:, 0], [2 * i, 2 * i])


async def test_a_callers_long_request_id_counts_against_the_bundles_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slice's own fields count with its rows: a caller with a long request id goes in a
    bundle of its own, not into one it would take past the call's limit (which would fail
    every caller in it). Here the limit is 200 bytes, each caller's row 8 bytes and its
    slice 6, or 176 with the long id."""
    monkeypatch.setattr(coalescer_module, "MAX_BUNDLE_BYTES", 200)
    downstream = Downstream()
    bundles = coalescer(downstream)

    async def call_with_id(value: float, request_id: str) -> list[np.ndarray]:
        answered = await bundles.call(
            KEY,
            rows(value),
            pb.Slice(tenant="t", request_id=request_id),
            deadline_s=time.monotonic() + 5.0,
            max_rows=8,
        )
        return answered.outputs

    ids = ["a", "b", "x" * 170, "c"]
    answers = await asyncio.gather(*(call_with_id(i, id_) for i, id_ in enumerate(ids)))
    for bundle in downstream.bundles:
        assert bundle.ByteSize() <= 200 + 64  # the rows' packing and the bundle's own fields
    assert [[s.request_id[:1] for s in b.slices] for b in downstream.bundles] == [
        ["a", "b"],
        ["x", "c"],
    ]
    for i, outputs in enumerate(answers):
        np.testing.assert_array_equal(np.stack(outputs)[:, 0], [2 * i])


def test_a_bundle_takes_no_more_rows_than_a_workers_queue_holds_or_an_answer_carries(
    tmp_path: Path,
) -> None:
    """A batch, unless the model's queue is smaller (a bundle past it is refused whole at the
    worker), or its rows' outputs are so big that a full bundle's answer would pass the call's
    limit: [512, 768] FP32 outputs are 1.5 MiB a row, and 64 of them 96 MiB."""

    def config(outputs: str, max_queue_size: int = 2048) -> ModelConfig:
        path = tmp_path / "config.toml"
        path.write_text(
            f'kind = "torchscript"\nslo_p99_ms = 250\nmax_batch_size = 64\n'
            f"max_queue_size = {max_queue_size}\n"
            f'[inputs.x]\ndtype = "FP32"\ndims = [4]\n[outputs.y]\n{outputs}\n'
        )
        return parse_model_config("m", path)

    small = 'dtype = "FP32"\ndims = [384]'
    assert max_bundle_rows(config(small), INTERACTIVE) == 64
    assert max_bundle_rows(config(small, max_queue_size=8), INTERACTIVE) == 8
    big = config('dtype = "FP32"\ndims = [512, 768]')
    assert big.output_row_bytes == 512 * 768 * 4
    assert max_bundle_rows(big, INTERACTIVE) == coalescer_module.MAX_BUNDLE_BYTES // (512 * 768 * 4)
    assert max_bundle_rows(big, INTERACTIVE) < 64
    huge = config('dtype = "INT64"\ndims = [4096, 4096]')  # one row alone is past it
    assert max_bundle_rows(huge, INTERACTIVE) == 1
    # One call's rows (a job's chunk): a batch-class call takes at most half the queue, which
    # is all a worker admits of batch rows (past it, refused on an idle worker too, for good).
    assert max_call_rows(config(small, max_queue_size=9), PriorityClass.INTERACTIVE) == 9
    assert max_call_rows(config(small, max_queue_size=9), PriorityClass.BATCH) == 5
    assert max_call_rows(big, PriorityClass.BATCH) == max_bundle_rows(big, INTERACTIVE)
    # A bundle of batch-class callers too: its slices past half the queue were refused (each
    # whole) on an idle worker, with a retry hint.
    assert max_bundle_rows(config(small, max_queue_size=64), PriorityClass.BATCH) == 32
    assert max_bundle_rows(config(small, max_queue_size=64), INTERACTIVE) == 64


async def test_a_failure_preparing_every_callers_rows_reaches_every_caller() -> None:
    downstream = Downstream()
    bundles = coalescer(downstream)

    def broken(calls: Sequence[Sequence[object]]) -> list:
        raise RuntimeError("tokenizer crashed")

    async def one() -> None:
        await bundles.call(
            KEY, ["text"], pb.Slice(), deadline_s=time.monotonic() + 30, max_rows=8, prepare=broken
        )

    results = await asyncio.gather(one(), one(), return_exceptions=True)
    # The failure itself, not the deadline's DEADLINE_EXCEEDED (30 s away).
    assert [type(r) for r in results] == [RuntimeError, RuntimeError]
    assert downstream.bundles == []
    assert bundles._keys[KEY].in_flight == 0


async def test_a_stop_iteration_out_of_a_tokenizer_reaches_its_caller_as_an_error() -> None:
    """A future cannot hold a StopIteration (a tokenizer that returned too few rows raises one
    out of `next`): before, setting it raised TypeError and the caller waited for its
    deadline. It gets a RuntimeError at once."""
    downstream = Downstream()
    bundles = coalescer(downstream)

    def short(calls: Sequence[Sequence[object]]) -> list:
        return [next(iter(()))]

    unsent: list[str] = []
    with pytest.raises(RuntimeError, match="StopIteration"):
        await bundles.call(
            KEY,
            ["text"],
            pb.Slice(),
            deadline_s=time.monotonic() + 5,
            max_rows=8,
            prepare=short,
            on_unsent=lambda: unsent.append("text"),
        )
    assert downstream.bundles == []
    assert unsent == ["text"], "its rows ran nowhere: back to its tenant (review finding)"


async def test_a_failure_preparing_one_callers_rows_reaches_that_caller_alone() -> None:
    """A tokenizer's own error on one caller's text (not a refusal of bad input): each
    caller's rows are made again alone, so only that caller gets the error and its
    bundle-mates are served in one bundle (before, every caller of the bundle got it)."""
    clock = BundleClock(max_out=1, min_in_flight=0, max_hold_s=30.0)
    downstream, bundles, first = await one_out(clock)

    def fussy(calls: Sequence[Sequence[object]]) -> list:
        if any(value == "boom" for values in calls for value in values):
            raise RuntimeError("tokenizer crashed on boom")
        return [[np.full(2, len(str(v)), dtype=np.float32) for v in values] for values in calls]

    unsent: list[str] = []

    async def one(text: str) -> list[np.ndarray]:
        deadline_s = time.monotonic() + LONG_S
        answered = await bundles.call(
            KEY,
            [text],
            pb.Slice(),
            deadline_s=deadline_s,
            max_rows=8,
            prepare=fussy,
            on_unsent=lambda: unsent.append(text),
        )
        return answered.outputs

    calls = [asyncio.ensure_future(one(text)) for text in ("ab", "boom", "abcd")]
    await asyncio.sleep(0.01)
    downstream.gate.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    await first

    assert isinstance(results[1], RuntimeError), results[1]
    assert [r[0].tolist() for r in (results[0], results[2])] == [[4.0, 4.0], [8.0, 8.0]]
    assert sizes(downstream) == [1, 2], "the two served in one bundle"
    assert unsent == ["boom"], "only the failed caller's rows ran nowhere"


async def test_a_caller_past_its_deadline_is_answered_while_its_bundle_is_in_flight() -> None:
    downstream = Downstream(delay_s=10.0)
    bundles = coalescer(downstream)
    unsent: list[str] = []
    # The bundle leaves within a few turns of the loop: its deadline must outlast a busy
    # machine's stall in those turns (50 ms did not, and the call then never left).
    task = asyncio.ensure_future(
        call(bundles, rows(1), timeout_s=1.0, on_unsent=lambda: unsent.append("sent"))
    )
    with pytest.raises(UpstreamError) as raised:
        await task
    assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(raised.value) == "router: deadline exceeded"
    assert unsent == []  # it left: it may have run
    assert not raised.value.ran_nothing and not never_served(raised.value)
    # Its slice was withdrawn from the bundle in flight (the cancel travels downstream).
    (bundle,) = downstream.bundles
    assert len(bundle.slices) == 1
    await bundles.close()


async def test_close_answers_every_waiting_caller_unavailable() -> None:
    downstream = Downstream(delay_s=10.0)
    bundles = coalescer(downstream)
    waiting = [asyncio.ensure_future(call(bundles, rows(i))) for i in range(3)]
    await asyncio.sleep(0.01)
    await bundles.close()
    for task in waiting:
        with pytest.raises(UpstreamError) as raised:
            await task
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE


async def test_the_idle_state_of_a_stale_version_s_keys_is_dropped_when_a_key_is_new() -> None:
    """Versions come and go (rollouts): the state of a key whose version went stale is dropped
    by the next new key once nothing of it is open, in flight or out, not kept for good."""
    stale_versions: set[str] = set()
    downstream = Downstream()
    downstream.gate.clear()
    bundles = Coalescer(
        downstream.send,
        GatewayMetrics(CollectorRegistry()),
        pickup_delay_s=lambda: 0.0,
        is_stale=lambda key: key.version in stale_versions,
    )
    waiting = asyncio.create_task(call(bundles, rows(1.0)))
    await sent(downstream, 1)
    stale_versions.add("1")
    version_2 = BundleKey("affine", "2", "f", "interactive", is_text=False)
    deadline_s = time.monotonic() + 5.0
    answered = [
        asyncio.create_task(
            bundles.call(version_2, rows(2.0), pb.Slice(), deadline_s=deadline_s, max_rows=8)
        )
    ]
    await asyncio.sleep(0)
    assert bundles.num_keys == 2, "version 1's bundle is still out: its state stays"
    downstream.gate.set()
    assert [o.tolist() for o in await waiting] == [[2.0, 2.0]]
    await asyncio.gather(*answered)
    version_3 = BundleKey("affine", "3", "f", "interactive", is_text=False)
    await bundles.call(version_3, rows(3.0), pb.Slice(), deadline_s=deadline_s, max_rows=8)
    assert bundles.num_keys == 2, "version 1's idle state went, 2's and 3's stay"
    await bundles.close()


def test_deadline_classes_keep_far_apart_deadlines_in_different_bundles() -> None:
    assert deadline_class(0.2) != deadline_class(30.0)
    assert deadline_class(0.2) == deadline_class(0.25)  # within 2x: one class
    assert deadline_class(0.0) == deadline_class(0.0005)  # at or under 1 ms: the first


async def sent(downstream: Downstream, count: int) -> None:
    """Waits until `downstream` was sent `count` bundles (a test's own bound: 10 s)."""
    async with asyncio.timeout(10):
        while len(downstream.bundles) < count:
            await asyncio.sleep(0.001)


def sizes(downstream: Downstream) -> list[int]:
    return [len(b.slices) for b in downstream.bundles]


def holds(bundles: Coalescer) -> float:
    """Bundles the clock held (its histogram's count)."""
    held = bundles._metrics.registry.get_sample_value(
        f"{names.GATEWAY_BUNDLE_HOLD_SECONDS}_count", {"model": "affine"}
    )
    return held or 0.0


#: Callers' time: 300 s, so that a hold of 30 s is not cut to a tenth of it.
LONG_S = 300.0


async def one_out(
    clock: BundleClock, max_rows: int = 8, pickup_delay_s: float | Callable[[], float] = 0.0
) -> tuple[Downstream, Coalescer, asyncio.Future[list[np.ndarray]]]:
    """A coalescer with `clock` whose first bundle, one call (its answer the future returned),
    is downstream and not answered until the test opens the downstream's gate."""
    downstream = Downstream()
    downstream.gate.clear()
    bundles = coalescer(downstream, clock, pickup_delay_s)
    first = asyncio.ensure_future(call(bundles, rows(0), timeout_s=LONG_S, max_rows=max_rows))
    await sent(downstream, 1)
    return downstream, bundles, first


@pytest.mark.parametrize(("max_out", "expected"), [(1, [1, 5]), (0, [1, 1, 1, 1, 1, 1])])
async def test_while_a_bundle_is_out_the_next_gathers_calls_until_it_is_answered(
    max_out: int, expected: list[int]
) -> None:
    clock = BundleClock(max_out=max_out, min_in_flight=0, max_hold_s=30.0)
    downstream, bundles, first = await one_out(clock)
    calls = [first]
    for i in range(1, 6):  # one call per turn of the loop, as separate RPCs arrive
        calls.append(asyncio.ensure_future(call(bundles, rows(i), timeout_s=LONG_S)))
        await asyncio.sleep(0.002)
    downstream.gate.set()
    answers = await asyncio.gather(*calls)
    # With a bundle out, the other five calls waited for its answer and left as one bundle;
    # without the clock, each left alone (too few in flight for the linger to hold them).
    assert sizes(downstream) == expected
    assert [float(a[0][0]) for a in answers] == [0, 2, 4, 6, 8, 10]
    assert bundles._keys[KEY].out == 0
    assert holds(bundles) == (1 if max_out == 1 else 0)  # only the bundle that waited counts


async def test_with_few_calls_in_flight_a_ready_bundle_leaves_without_waiting() -> None:
    clock = BundleClock(max_out=1, min_in_flight=8, max_hold_s=30.0)
    downstream, bundles, first = await one_out(clock)
    second = asyncio.ensure_future(call(bundles, rows(1), timeout_s=LONG_S))
    await sent(downstream, 2)  # 2 calls in flight, under 8: at once, not after a 30 s hold
    assert holds(bundles) == 0
    downstream.gate.set()
    await asyncio.gather(first, second)


@pytest.mark.parametrize("pickup_delay_s", [0.0, 0.005, 1.0])
async def test_calls_waiting_to_be_picked_up_count_as_in_flight(pickup_delay_s: float) -> None:
    # Three calls in flight, under 8; at the key's rate (a call every 2 ms or so) a process
    # that picks calls up 5 ms late has about 2.5 more waiting (still under 8), one that picks
    # them up 1 s late about 500: a busy gateway, which holds. The busy case's delay is made
    # 1,000 s while the hold is decided (held whatever the calls' gaps on a busy machine: a
    # gap of 0.17 s would have let 1 s's pass), then none, so the answered hold leaves at once.
    clock = BundleClock(max_out=1, min_in_flight=8, max_hold_s=30.0)
    is_busy = pickup_delay_s == 1.0
    delay = [1000.0 if is_busy else pickup_delay_s]
    downstream, bundles, first = await one_out(clock, pickup_delay_s=lambda: delay[0])
    calls = [first]
    for i in (1, 2):
        await asyncio.sleep(0.002)
        calls.append(asyncio.ensure_future(call(bundles, rows(i), timeout_s=LONG_S)))
    if is_busy:
        await asyncio.sleep(0.005)
        assert len(downstream.bundles) == 1  # held: only the first is out
        delay[0] = 0.0
    else:
        await sent(downstream, 3)  # each left at once
    downstream.gate.set()
    await asyncio.gather(*calls)
    assert sizes(downstream) == ([1, 2] if is_busy else [1, 1, 1])
    assert holds(bundles) == (1 if is_busy else 0)


async def one_out_one_held(
    pickup_delay_s: float,
) -> tuple[Downstream, Coalescer, asyncio.Future[list[np.ndarray]], asyncio.Future[Any]]:
    """`one_out` with a clock that holds up to 30 s, and a second call held behind the first
    (its linger over), with calls waiting `pickup_delay_s` to be picked up."""
    clock = BundleClock(max_out=1, min_in_flight=0, max_hold_s=30.0)
    downstream, bundles, first = await one_out(clock, pickup_delay_s=pickup_delay_s)
    second = asyncio.ensure_future(call(bundles, rows(1), timeout_s=LONG_S))
    await asyncio.sleep(0.005)
    return downstream, bundles, first, second


async def test_an_answered_hold_gathers_the_calls_waiting_to_be_picked_up() -> None:
    # A busy process (its calls wait 2 s to be picked up): when the bundle out is answered,
    # the held one waits for the calls already at the door, which arrive within that delay,
    # rather than leaving with what it has and sending them a bundle later.
    downstream, bundles, first, second = await one_out_one_held(pickup_delay_s=2.0)
    downstream.gate.set()
    await first
    await asyncio.sleep(0.05)  # answered a while ago: the second's bundle still gathers
    assert len(downstream.bundles) == 1
    third = asyncio.ensure_future(call(bundles, rows(2), timeout_s=LONG_S))
    answered_s = time.monotonic()
    await asyncio.gather(second, third)
    assert sizes(downstream) == [1, 2]
    # It left after the pickup delay, not after its 30 s hold.
    assert time.monotonic() - answered_s < 10.0


async def test_an_answered_hold_leaves_at_once_when_no_call_waits() -> None:
    downstream, _, first, second = await one_out_one_held(pickup_delay_s=0.0)
    downstream.gate.set()
    answered_s = time.monotonic()
    await asyncio.gather(first, second)
    assert time.monotonic() - answered_s < 10.0  # not after its 30 s hold
    assert sizes(downstream) == [1, 1]


async def test_a_failed_bundle_ends_the_hold_without_gathering() -> None:
    downstream, _, first, second = await one_out_one_held(pickup_delay_s=30.0)
    downstream.error = UpstreamError(grpc.StatusCode.UNAVAILABLE, "worker gone")
    downstream.gate.set()
    with pytest.raises(UpstreamError):
        await first
    await sent(downstream, 2)  # at once: no 30 s gather after a failure
    assert sizes(downstream) == [1, 1]
    with pytest.raises(UpstreamError):  # the downstream still fails
        await second


async def test_a_held_bundle_leaves_after_its_hold_if_nothing_is_answered() -> None:
    clock = BundleClock(max_out=1, min_in_flight=0, max_hold_s=0.05)
    downstream, bundles, first = await one_out(clock)
    second = asyncio.ensure_future(call(bundles, rows(1)))
    await sent(downstream, 2)  # the first is still out: the hold, not an answer, sent it
    assert not first.done()
    assert holds(bundles) == 1
    downstream.gate.set()
    assert [float(a[0][0]) for a in await asyncio.gather(first, second)] == [0, 2]


async def test_a_held_bundle_leaves_at_once_when_it_fills() -> None:
    clock = BundleClock(max_out=1, min_in_flight=0, max_hold_s=30.0)
    downstream, bundles, first = await one_out(clock, max_rows=4)
    held = asyncio.ensure_future(call(bundles, rows(1), timeout_s=LONG_S, max_rows=4))
    await asyncio.sleep(0.005)  # held: the first is out
    assert len(downstream.bundles) == 1
    filling = asyncio.ensure_future(call(bundles, rows(2, 2, 2), timeout_s=LONG_S, max_rows=4))
    await sent(downstream, 2)  # 4 rows: the max, sent without waiting for the first's answer
    assert sizes(downstream) == [1, 2]
    # Its hold ended when it left, not when an answer came (none has yet).
    assert holds(bundles) == 1
    downstream.gate.set()
    await asyncio.gather(first, held, filling)


async def test_a_failed_bundle_ends_the_hold_and_counts_as_a_round_trip() -> None:
    clock = BundleClock(max_out=1, min_in_flight=0, max_hold_s=30.0)
    downstream, bundles, first = await one_out(clock)
    downstream.error = UpstreamError(grpc.StatusCode.UNAVAILABLE, "worker gone")
    held = asyncio.ensure_future(call(bundles, rows(1), timeout_s=LONG_S))
    await asyncio.sleep(0.005)
    assert bundles._keys[KEY].downstream.mean is None
    downstream.gate.set()  # the first fails: the held one leaves then, not after 30 s
    async with asyncio.timeout(10):
        results = await asyncio.gather(first, held, return_exceptions=True)
    assert [r.code for r in results if isinstance(r, UpstreamError)] == [
        grpc.StatusCode.UNAVAILABLE
    ] * 2
    assert sizes(downstream) == [1, 1]
    assert bundles._keys[KEY].downstream.mean is not None  # the failures' round trips count


async def test_an_answer_that_does_not_parse_fails_its_callers_and_counts_its_round_trip() -> None:
    downstream = Downstream(delay_s=0.03)
    downstream.garbled = b"\xff\xff\xff"  # no InferResponse
    bundles = coalescer(downstream)
    with pytest.raises(DecodeError):  # the callers' status: INTERNAL (status_of)
        await call(bundles, rows(0))
    mean = bundles._keys[KEY].downstream.mean
    assert mean is not None and mean >= 0.03  # the round trip: no worker's time to read


async def test_outputs_that_do_not_read_fail_their_callers_internal() -> None:
    """A tensor whose bytes do not make its shape is downstream's fault: INTERNAL, where its
    callers were told INVALID_ARGUMENT, as if they had sent it (review finding)."""
    downstream = Downstream()
    response = pb.InferResponse(slices=[pb.SliceStatus()])
    response.packed_outputs.CopyFrom(tensor_to_pb(np.zeros((1, 2), dtype=np.float32)))
    response.packed_outputs.raw_data = b"\x00" * 5
    downstream.garbled = response.SerializeToString()
    bundles = coalescer(downstream)
    with pytest.raises(UpstreamError) as raised:
        await call(bundles, rows(0))
    assert raised.value.code == grpc.StatusCode.INTERNAL
    assert "raw_data" in str(raised.value)


async def test_callers_that_stop_waiting_before_their_bundle_leaves_are_left_out_of_it() -> None:
    """One caller cancelled and one past its deadline while their bundle is held: neither is
    sent (their rows, arrays like their bundle-mates', are found by identity), each is told
    once that it was not (`on_unsent`: its tenant's rows go back), the cancelled one ends
    cancelled, and nothing fails on the loop."""
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: loop_errors.append(context))
    clock = BundleClock(max_out=1, min_in_flight=0, max_hold_s=30.0)
    downstream, bundles, first = await one_out(clock)
    unsent: list[str] = []

    def held(name: str, timeout_s: float) -> asyncio.Future[list[np.ndarray]]:
        told = functools.partial(unsent.append, name)
        return asyncio.ensure_future(call(bundles, rows(1), timeout_s=timeout_s, on_unsent=told))

    kept, cancelled = held("kept", LONG_S), held("cancelled", LONG_S)
    await asyncio.sleep(0.005)  # held, for up to 30 s: the first is out
    expired = held("expired", 0.05)
    with pytest.raises(UpstreamError) as raised:
        await expired
    assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(raised.value) == "gateway: deadline exceeded before the call was sent"
    # Nothing downstream saw: not counted there (the throttle's accepts), rows given back.
    assert raised.value.ran_nothing and never_served(raised.value)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert unsent == ["expired", "cancelled"]
    assert len(downstream.bundles) == 1  # the three were held behind the first
    downstream.gate.set()
    assert [float(a[0][0]) for a in await asyncio.gather(first, kept)] == [0, 2]
    assert sizes(downstream) == [1, 1]
    assert loop_errors == []
    assert bundles._keys[KEY].in_flight == 0


async def test_the_callers_of_a_refused_bundle_get_errors_and_retry_hints_of_their_own() -> None:
    downstream = Downstream()
    downstream.error = UpstreamError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (retry_after_trailer(1.0),)
    )
    bundles = coalescer(downstream)
    callers = (call(bundles, rows(i), max_rows=32) for i in range(20))
    errors = await asyncio.gather(*callers, return_exceptions=True)
    assert len(downstream.bundles) == 1
    refusals = [e for e in errors if isinstance(e, UpstreamError) and e.is_overload]
    assert len({id(e) for e in refusals}) == 20
    hints = [dict(e.trailers())[RETRY_AFTER_MS_KEY] for e in refusals]
    assert len(set(hints)) > 1, hints  # spread, not one wave of retries after the same delay
    assert all(500 <= int(h) <= 1600 for h in hints), hints


async def test_close_answers_the_callers_of_a_held_bundle_unavailable() -> None:
    """The held bundle's caller, never sent, is told so once (its rows go back); the first,
    out when the gateway closes, is not."""
    clock = BundleClock(max_out=1, min_in_flight=0, max_hold_s=30.0)
    _, bundles, first = await one_out(clock)
    unsent: list[str] = []
    told = functools.partial(unsent.append, "held")
    held = asyncio.ensure_future(call(bundles, rows(1), timeout_s=LONG_S, on_unsent=told))
    await asyncio.sleep(0.005)
    await bundles.close()
    for caller in (first, held):
        with pytest.raises(UpstreamError) as raised:
            await caller
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert bundles._keys[KEY].out == 0
    assert unsent == ["held"]


async def test_a_bundle_sent_as_the_gateway_closes_is_answered_unavailable() -> None:
    downstream = Downstream()
    bundles = coalescer(downstream)
    caller = asyncio.ensure_future(call(bundles, rows(0), max_rows=1))
    await asyncio.sleep(0)  # the caller's bundle is full and sent: its task has not started
    await bundles.close()
    with pytest.raises(UpstreamError) as raised:
        await caller
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert downstream.bundles == []  # never sent downstream
    assert bundles._keys[KEY].out == 0


@pytest.mark.parametrize(
    ("delay_s", "worker_s", "held"),
    [
        # Answered in 100 ms (a model on a CPU, say), as its worker reports or not: past the
        # 50 ms hold, so a ready bundle leaves without waiting.
        (0.1, 0.0, 0),
        (0.0, 0.1, 0),
        # Answered in 100 ms, 1 ms of it in the worker: the rest was the wait to read it (a
        # saturated gateway's loop). The model is fast, so the clock holds.
        (0.1, 0.001, 1),
    ],
)
async def test_a_ready_bundle_waits_only_while_its_key_is_fast_downstream(
    delay_s: float, worker_s: float, held: int
) -> None:
    downstream = Downstream(delay_s=delay_s, worker_s=worker_s)
    bundles = coalescer(downstream, BundleClock(max_out=1, min_in_flight=0, max_hold_s=0.05))
    await call(bundles, rows(0))
    downstream.delay_s = 0.0
    downstream.gate.clear()
    first = asyncio.ensure_future(call(bundles, rows(1)))
    await sent(downstream, 2)
    second = asyncio.ensure_future(call(bundles, rows(2)))
    await sent(downstream, 3)  # after its 50 ms hold, if held
    assert holds(bundles) == held
    downstream.gate.set()
    await asyncio.gather(first, second)


def test_the_clock_holds_only_with_max_out_bundles_out_and_within_its_bounds() -> None:
    clock = BundleClock(max_out=2, min_in_flight=8, max_hold_s=0.02, hold_share=0.1)

    def hold(
        out: int, *, in_flight: int = 8, left_s: float = 1.0, downstream: float | None = 0.005
    ) -> float:
        return clock.hold_s(out, in_flight, left_s, downstream)

    assert hold(0) == hold(1) == 0.0  # under max_out bundles out
    assert hold(2) == 0.02  # max_hold_s
    assert hold(2, downstream=None) == 0.02  # no time downstream known yet: it holds
    assert hold(5, left_s=0.1) == pytest.approx(0.01)  # 10% of the time left
    assert hold(5, left_s=-1.0) == 0.0  # already late
    assert hold(5, in_flight=7) == 0.0  # too few calls in flight to gather any
    # Bundles held downstream longer than the hold: waiting for an answer only adds latency.
    assert hold(5, downstream=0.021) == 0.0
    assert BundleClock(max_out=0).hold_s(9, 99, 1.0, 0.0) == 0.0  # clock off
    # Answered: it waits for the calls at the door, within what is left of its hold.
    assert clock.gather_s(0.005, held_s=0.004, hold_s=0.02) == 0.005
    assert clock.gather_s(0.05, held_s=0.004, hold_s=0.02) == pytest.approx(0.016)
    assert clock.gather_s(0.0, held_s=0.004, hold_s=0.02) == 0.0  # nothing waits
    assert clock.gather_s(0.05, held_s=0.03, hold_s=0.02) == 0.0  # the hold is spent
    with pytest.raises(ValueError):
        BundleClock(hold_share=2.0)


def test_a_moving_average_starts_at_its_first_value() -> None:
    average = MovingAverage(0.2)
    assert average.mean is None
    assert average.observe(0.010) == 0.010
    assert average.observe(0.060) == pytest.approx(0.010 + 0.2 * 0.050)
    with pytest.raises(ValueError):
        MovingAverage(0.0)


async def test_a_slice_refused_unstarted_beside_served_mates_is_sent_again_once() -> None:
    """A worker whose batching stopped (or whose drain ran out) answers the slices it never
    ran UNAVAILABLE, not started, while their bundle-mates were served: the bundle was not
    failed whole, so neither router nor gateway sent them elsewhere, and their callers got
    UNAVAILABLE (review finding). They are sent again once, as a bundle of their own."""
    downstream = Downstream()
    downstream.unstarted = [{1, 2}, set()]
    bundles = coalescer(downstream)
    try:
        answers = await asyncio.gather(*(call(bundles, rows(i)) for i in range(3)))
        assert [float(a[0][0]) for a in answers] == [0, 2, 4]
        assert sizes(downstream) == [3, 2]
        counted = bundles._metrics.router_retries_total.labels("predict")._value.get()
        assert counted == 1
        assert bundles._keys[KEY].in_flight == 0 and bundles._keys[KEY].out == 0
        # Refused unstarted again: once is all, its caller is told.
        downstream.unstarted = [set(), set(), {0}, {0}]
        with pytest.raises(UpstreamError) as raised:
            await asyncio.gather(call(bundles, rows(5)), call(bundles, rows(6)))
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE
        assert sizes(downstream) == [3, 2, 2, 1]
    finally:
        await bundles.close()


async def test_a_version_downstream_does_not_know_is_unavailable_to_callers_not_not_found() -> None:
    """A gateway sends only versions its repository has and its fleet view serves: a router's
    NOT_FOUND (started since, it has not seen their workers yet) or a worker's means not served
    now, UNAVAILABLE, which clients retry; NOT_FOUND they take as permanent. For one slice of a
    bundle, its mates served, and for a whole bundle."""
    downstream = Downstream()
    downstream.not_found = [{1}]
    bundles = coalescer(downstream)
    try:
        answers = await asyncio.gather(
            *(call(bundles, rows(i)) for i in range(3)), return_exceptions=True
        )
        assert sizes(downstream) == [3]
        assert [float(a[0][0]) for a in (answers[0], answers[2])] == [0, 4]
        refused = answers[1]
        assert isinstance(refused, UpstreamError), refused
        assert refused.code == grpc.StatusCode.UNAVAILABLE
        assert "no worker serves m@1" in str(refused)
        # Nothing ran: its rows go back to its tenant (they stayed charged: review finding),
        # though it is not sent again (to routers as blind as this one).
        assert never_served(refused) and not refused.is_not_started
        downstream.error = UpstreamError(grpc.StatusCode.NOT_FOUND, "no worker serves m@1")
        errors = await asyncio.gather(
            *(call(bundles, rows(i)) for i in range(3)), return_exceptions=True
        )
        assert [getattr(e, "code", e) for e in errors] == [grpc.StatusCode.UNAVAILABLE] * 3
        assert all(never_served(e) for e in errors if isinstance(e, BaseException))
    finally:
        await bundles.close()


async def test_inputs_a_worker_refuses_for_their_fingerprint_are_unavailable_to_callers() -> None:
    """A worker's FAILED_PRECONDITION: the version's files changed since the fleet view this
    gateway stamped from (a re-staged version mid-rollout), which its refresh corrects. It was
    given to callers as is, HTTP 400, which clients and job runners never retry (review
    finding). Nothing ran; not sent again from here (the router tried it already)."""
    downstream = Downstream()
    downstream.error = UpstreamError(
        grpc.StatusCode.FAILED_PRECONDITION, "inputs were prepared for fingerprint aa"
    )
    bundles = coalescer(downstream)
    try:
        errors = await asyncio.gather(
            *(call(bundles, rows(i)) for i in range(2)), return_exceptions=True
        )
        for error in errors:
            assert isinstance(error, UpstreamError), error
            assert error.code == grpc.StatusCode.UNAVAILABLE
            assert "prepared for fingerprint aa" in str(error)
            assert never_served(error) and not error.is_not_started
    finally:
        await bundles.close()


async def test_a_slice_sent_again_is_withdrawn_from_the_bundle_it_is_in_now() -> None:
    """Its deadline passes while it is out again: the cancel goes to its new bundle (index 0
    there), not to the first one, which no longer waits for it."""
    downstream = Downstream()
    downstream.unstarted, downstream.silent_from = [{1}], 1
    bundles = coalescer(downstream)
    try:
        first = asyncio.ensure_future(call(bundles, rows(0)))
        again = asyncio.ensure_future(call(bundles, rows(1), timeout_s=1.0))
        assert float((await first)[0][0]) == 0
        await eventually(lambda: len(downstream.bundles) == 2, interval_s=0.001)
        with pytest.raises(UpstreamError) as raised:
            await again
        assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert sizes(downstream) == [2, 1]
        assert downstream.cancels[1].cancelled == {0}
        assert downstream.cancels[0].cancelled == set()
    finally:
        await bundles.close()


async def test_a_bundle_none_of_whose_callers_waits_is_cancelled_downstream() -> None:
    """Both callers of a bundle in flight give up (their deadlines pass): its call is
    cancelled downstream whole, rows withdrawn, and not sent again. Before, it ran on, and
    a bundle waiting out a resend's backoff was still resent with no caller left."""
    cancelled = asyncio.Event()
    sent: list[bytes] = []

    async def send(body: bytes, metadata: Any, deadline_s: float, cancels: SliceCancels) -> bytes:
        sent.append(body)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("never answered")

    bundles = Coalescer(
        send, GatewayMetrics(CollectorRegistry()), clock=DEFAULT_CLOCK, pickup_delay_s=lambda: 0.0
    )
    try:
        # Past the few turns of the loop the bundle takes to leave, on a busy machine too.
        callers = [asyncio.ensure_future(call(bundles, rows(v), timeout_s=1.0)) for v in (1, 2)]
        for caller in callers:
            with pytest.raises(UpstreamError) as raised:
                await caller
            assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(cancelled.wait(), timeout=5)
        assert len(sent) == 1
    finally:
        await bundles.close()


async def test_a_bundle_is_sent_in_its_first_callers_context_whoever_makes_it_leave() -> None:
    """A opens a bundle, X joins it, and Z's rows overfill it: it leaves from Z's call.
    Its call was sent in Z's context, so under Z's trace (`outgoing_metadata` reads the
    current span), though it carries only A's and X's rows (telemetry review). It goes in
    A's; Z's own bundle in Z's."""
    caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="none")
    downstream = Downstream()
    sent_in: list[str] = []

    async def recording(*args: Any) -> bytes:
        sent_in.append(caller.get())
        return await downstream.send(*args)

    bundles = Coalescer(recording, GatewayMetrics(CollectorRegistry()), lambda: 0.0)

    async def as_caller(name: str, values: list[np.ndarray]) -> list[np.ndarray]:
        caller.set(name)
        return await call(bundles, values, max_rows=8)

    await asyncio.gather(*(as_caller(name, rows(1, 2, 3)) for name in ("A", "X", "Z")))
    assert [[s.rows for s in b.slices] for b in downstream.bundles] == [[3, 3], [3]]
    assert sent_in == ["A", "Z"]
    # X's slice refused unstarted beside A's served: sent again alone, in X's context, not
    # in A's, whose task sends it (diff review).
    downstream.bundles.clear()
    sent_in.clear()
    downstream.unstarted = [{1}]
    await asyncio.gather(*(as_caller(name, rows(1, 2)) for name in ("A", "X")))
    assert [[s.rows for s in b.slices] for b in downstream.bundles] == [[2, 2], [2]]
    assert sent_in == ["A", "X"]


@pytest.mark.parametrize(("worker_s", "moves"), [(0.15, False), (0.001, True)])
async def test_a_bundle_its_callers_left_counts_downstream_only_as_a_floor(
    worker_s: float, moves: bool
) -> None:
    """A bundle whose callers all left (short deadlines) is cancelled before its answer: the
    time it was out says downstream took at least that. Counted as its time downstream, it
    lowered a slow key's average (150 ms, its callers leaving at 30 ms) below the bundle
    clock's 20 ms, and the key's bundles were held where holding only adds latency: the
    150 ms case. A floor above the average still raises it (the 1 ms case, as before)."""
    downstream = Downstream(worker_s=worker_s)
    bundles = coalescer(downstream)
    try:
        await call(bundles, rows(1))
        state = bundles._keys[KEY]
        assert state.downstream.mean == pytest.approx(worker_s)
        downstream.silent_from = 1
        with pytest.raises(UpstreamError) as raised:
            await call(bundles, rows(2), timeout_s=0.03)
        assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: state.out == 0, message="the bundle cancelled downstream")
        mean = state.downstream.mean
        assert mean is not None
        if moves:  # toward its time out (about 30 ms), far above the first bundle's 1 ms
            assert mean > worker_s + DOWNSTREAM_WEIGHT * 0.005
        else:
            assert mean == pytest.approx(worker_s)
    finally:
        await bundles.close()
