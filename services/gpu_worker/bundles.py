"""The worker's side of a bundle (services.common.bundles): the rows of several callers in one
call, each caller's slice admitted, queued, timed out, cancelled and answered on its own.

One bad, refused, late or cancelled slice never fails its bundle-mates: only what the whole
bundle shares (the model, its version and fingerprint, the packed columns) fails the call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from services.common.bundles import SliceCancels, slice_time_left_s
from services.common.errors import InvalidInput, Unavailable
from services.common.grpc_errors import code_of, status_of
from services.common.priority import PriorityClass, worker_priority
from services.common.telemetry import given_up_by
from services.common.tensors import stack_rows, tensor_to_pb
from services.common.tracing import span_context_of
from services.gpu_worker.backends.base import Backend, PreparedRow
from services.gpu_worker.batching import bundle_door
from services.gpu_worker.batching.driver import Admission, BatchingDriver
from services.gpu_worker.batching.lane import Lane
from services.gpu_worker.batching.slice_admission import SliceAsk
from services.gpu_worker.bundle_rows import bundle_rows, row_buckets
from services.gpu_worker.metrics import WorkerMetrics
from services.pb.inference.v1 import worker_pb2 as pb

_OK = pb.SliceStatus()
#: A call cancelled this close to its deadline (seconds) was cancelled by it: our timer, or
#: the caller's cancel at its own, a hop earlier.
DEADLINE_SLACK_S = 0.05
#: The slices cancelled before a bundle arrives, for a call that relays no cancels.
_NONE_GONE: frozenset[int] = frozenset()
#: A slice's place among a bundle's outcomes while its rows are being admitted.
_ADMITTING = Unavailable("being admitted")


def request_priority(value: int) -> PriorityClass:
    """The priority class of an internal request; INVALID_ARGUMENT for an unknown value."""
    try:
        return worker_priority(value)
    except ValueError as error:
        raise InvalidInput(str(error)) from error


async def all_done(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Returns once every one of `futures` is done, whatever its outcome: `asyncio.wait`'s
    ALL_COMPLETED for less a slice (one callback per future still pending; no set, no
    per-future checks, no callbacks taken back). Cancelling the caller cancels none of them."""
    pending = [future for future in futures if not future.done()]
    if not pending:
        return
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    remaining = len(pending)

    def one_done(_: asyncio.Future[Any]) -> None:
        nonlocal remaining
        remaining -= 1
        if remaining == 0 and not done.done():
            done.set_result(None)

    for future in pending:
        future.add_done_callback(one_done)
    await done


class BundleRunner:
    """Runs bundles on one worker's batching driver: every slice admitted in one pass, one
    wait for all of them, and one future per slice (its rows' outputs), no task."""

    def __init__(self, batching: BatchingDriver, metrics: WorkerMetrics) -> None:
        self._batching = batching
        self._metrics = metrics

    async def infer(
        self,
        backend: Backend,
        request: pb.InferRequest,
        time_left_s: float | None,
        cancels: SliceCancels | None,
    ) -> pb.InferResponse:
        """The answer to a bundle: one status per slice, the OK slices' rows stacked, and the
        time this took (`worker_us`: what the gateway's bundle clock reads)."""
        labels = (backend.config.name, backend.version.version)
        called_s = time.monotonic()  # when `time_left_s` was read
        # A slice its caller stopped waiting for before the bundle got here is not queued:
        # its rows would count against its bundle-mates' room and deadlines.
        gone = _NONE_GONE if cancels is None else cancels.cancelled
        try:
            parts = self._rows_per_slice(backend, request, time_left_s, gone)
        except Exception as error:  # refuses every slice alike: counted for each
            code = code_of(error).name
            self._metrics.requests_total_of[(*labels, code)].inc(len(request.slices))
            raise
        # Preparing the rows took some of the time left: deadlines count from the read.
        left_s = None if time_left_s is None else time_left_s - (time.monotonic() - called_s)
        outcomes = self._admit(
            backend, request.slices, parts, left_s, gone, (time_left_s, called_s)
        )
        admitted = [o for o in outcomes if isinstance(o, Admission)]

        def cancel(index: int) -> None:
            outcome = outcomes[index] if index < len(outcomes) else None
            if not isinstance(outcome, Admission):
                return
            # A slice already answered (served, or failed here) keeps its answer.
            if not outcome.future.done():
                earlier_us = request.slices[index].earlier_us
                outcomes[index] = given_up(time_left_s, called_s, earlier_us)
            self._batching.withdraw(outcome)  # its queued rows leave unrun

        stop = None if cancels is None else cancels.listen(cancel)
        try:
            await all_done([a.future for a in admitted])
        except asyncio.CancelledError:  # the whole call: its caller went away, or timed out
            for admission in admitted:  # its failures are answered to no one: read, not logged
                if admission.future.done() and not admission.future.cancelled():
                    admission.future.exception()
            gave_up = _code(given_up(time_left_s, called_s))
            self._count(labels, (_code(o) if isinstance(o, BaseException) else gave_up
                                 for o in outcomes))  # fmt: skip
            raise
        finally:
            if stop is not None:
                stop()
            for admission in admitted:
                self._batching.withdraw(admission)
        results = [_result(o) for o in outcomes]
        codes = self._count(labels, (_code(r) if isinstance(r, BaseException) else "OK"
                                     for r in results))  # fmt: skip
        unavailable = next((r for r in results if isinstance(r, Unavailable)), None)
        if unavailable is not None and fails_whole(codes):
            raise unavailable
        response = _answer(backend, results)
        response.worker_us = round((time.monotonic() - called_s) * 1e6)
        return response

    def _count(self, labels: tuple[str, str], codes: Iterable[str]) -> dict[str, int]:
        """Counts each slice's outcome (`codes`) in requests_total; returns the counts."""
        counts: dict[str, int] = {}
        for code in codes:  # a dict, not a Counter: a Counter's construction alone costs more
            counts[code] = counts.get(code, 0) + 1
        for code, count in counts.items():
            self._metrics.requests_total_of[(*labels, code)].inc(count)
        return counts

    def _rows_per_slice(
        self,
        backend: Backend,
        request: pb.InferRequest,
        time_left_s: float | None,
        gone: AbstractSet[int],
    ) -> list[list[PreparedRow] | BaseException]:
        """Each slice's prepared rows, or the error that refuses it alone; raises what refuses
        the whole bundle (its callers' time left counted from `time_left_s`), before any row
        is made where its lane would refuse every slice (bundle_door; not with slices `gone`,
        whose callers are told they gave up)."""
        backend.check_fingerprint(request.fingerprint)
        counts = [s.rows for s in request.slices]
        if 0 in counts:
            raise InvalidInput("every slice of a bundle needs at least one row")
        num_rows = sum(counts)
        if num_rows > backend.config.max_queue_size:
            raise InvalidInput(
                f"{num_rows} inputs exceed the queue capacity of "
                f"{backend.config.max_queue_size}; split the bundle"
            )
        rows = bundle_rows(request, num_rows)
        # What refuses every slice alike refuses the bundle, so the router retries it elsewhere
        # (a bundle its caller built wrong is refused INVALID_ARGUMENT first: not retried).
        lane = self._batching.open_lane(backend)
        if bundle_door.may_refuse_whole(lane) and not gone:  # a gone slice: its own answer
            refusal = self._refused_whole(lane, request, time_left_s)
            if refusal is not None:
                raise refusal
        ends = list(itertools.accumulate(counts))
        prepared = rows.prepare(backend)
        if prepared is None:
            raw = rows.raw()
            try:  # every row at once; only a bundle with a bad row is prepared slice by slice
                prepared = backend.prepare_many(raw)
            except InvalidInput:
                parts: list[list[PreparedRow] | BaseException] = []
                for n, end in zip(counts, ends, strict=True):
                    try:
                        parts.append(backend.prepare_many(raw[end - n : end]))
                    except InvalidInput as error:
                        parts.append(error)
                return parts
        return [prepared[end - n : end] for n, end in zip(counts, ends, strict=True)]

    def _refused_whole(
        self, lane: Lane, request: pb.InferRequest, time_left_s: float | None
    ) -> Exception | None:
        """What refuses every slice of `request` before its rows are made (bundle_door), or
        None where a slice might be queued, or needs an answer of its own."""
        callers = bundle_callers(request.slices, time_left_s)
        buckets = row_buckets(lane.backend, request.packed)
        if callers is None or buckets is None:
            return None
        now = self._batching.now()
        free_s = self._batching.executor_free_s(now)
        return bundle_door.whole_refusal(lane, callers, buckets, now, free_s, self._metrics)

    def _admit(
        self,
        backend: Backend,
        slices: Sequence[pb.Slice],
        parts: list[list[PreparedRow] | BaseException],
        time_left_s: float | None,
        gone: AbstractSet[int],
        call_clock: tuple[float | None, float],
    ) -> list[Admission | BaseException]:
        """Queues every slice's rows in one pass (each linked to its caller's trace): each
        slice's admission, or the error refusing it (for the indices in `gone`, what a caller
        that stopped waiting is told: `given_up` at the call's time left and when it was read,
        `call_clock`)."""
        asks: list[SliceAsk] = []
        outcomes: list[Admission | BaseException] = []
        for index, (part, piece) in enumerate(zip(parts, slices, strict=True)):
            if index in gone:
                outcomes.append(given_up(*call_clock, piece.earlier_us))
                continue
            if isinstance(part, BaseException):
                outcomes.append(part)
                continue
            try:
                rows = part
                if piece.unnormalized:
                    rows = [dataclasses.replace(r, is_normalized=False) for r in rows]
                ask = SliceAsk(
                    rows,
                    slice_time_left_s(time_left_s, piece.earlier_us),
                    piece.tenant or "default",
                    request_priority(piece.priority),
                    piece.tenant_weight,
                    span_context_of(piece.traceparent),
                )
            except Exception as error:
                outcomes.append(error)
                continue
            outcomes.append(_ADMITTING)
            asks.append(ask)
        try:
            admitted: list[Admission | Exception] = self._batching.admit_slices(
                backend, asks, arrival_s=self._batching.now()
            )
        except Exception as error:  # refuses every slice alike (the lane closed)
            admitted = [error] * len(asks)
        answers = iter(admitted)
        return [next(answers) if o is _ADMITTING else o for o in outcomes]


def bundle_callers(
    slices: Iterable[pb.Slice], time_left_s: float | None
) -> list[bundle_door.Caller] | None:
    """A bundle's callers for the door (bundle_door.Caller): its slices grouped by tenant,
    weight and priority, each group's latest time left (the slices' earliest `earlier_us`)
    and rows; None when a slice needs an answer of its own, which only the row-by-row path
    gives: a priority no class has, a weight that is not finite and >= 0, a deadline passed."""
    earliest_us: dict[tuple[str, float, int], int] = {}
    rows: dict[tuple[str, float, int], int] = {}
    for piece in slices:
        like = (piece.tenant or "default", piece.tenant_weight, piece.priority)
        earlier_us = piece.earlier_us
        if earliest_us.get(like, earlier_us + 1) > earlier_us:
            earliest_us[like] = earlier_us
        rows[like] = rows.get(like, 0) + piece.rows
    callers = []
    for (tenant, weight, priority), earlier_us in earliest_us.items():
        left_s = slice_time_left_s(time_left_s, earlier_us)
        if not (math.isfinite(weight) and weight >= 0.0) or (left_s is not None and left_s <= 0):
            return None
        try:
            rank = request_priority(priority).rank
        except InvalidInput:
            return None
        latest_s = math.inf if left_s is None else left_s
        callers.append(
            bundle_door.Caller(tenant, weight, rank, latest_s, rows[tenant, weight, priority])
        )
    return callers


def fails_whole(codes: Mapping[str, int]) -> bool:
    """Whether a bundle whose slices ended with `codes` (counts by status name) fails
    UNAVAILABLE as a whole: none succeeded and this worker is failing (a slice UNAVAILABLE: a
    watchdog, a lost device, a stopped loop), which the router must see to eject it and retry
    the bundle elsewhere; answered slice by slice, their UNAVAILABLE (not marked not started)
    would reach their callers unretried. A slice that failed otherwise (INTERNAL, refused for
    its input) rides along: run again elsewhere, inference is idempotent, and a caller whose
    retries run out gets UNAVAILABLE for it."""
    return "UNAVAILABLE" in codes and "OK" not in codes


def _code(error: BaseException) -> str:
    return code_of(error).name


def given_up(time_left_s: float | None, called_s: float, earlier_us: int = 0) -> BaseException:
    """What a call (or one of its slices, `earlier_us` before the call's deadline) that its
    caller stopped waiting for is counted and answered: DEADLINE_EXCEEDED when its deadline
    had come (our timer, or the caller's cancel at its own, a hop earlier), else CANCELLED."""
    left_s = slice_time_left_s(time_left_s, earlier_us)
    deadline_s = math.inf if left_s is None else called_s + left_s
    return given_up_by(deadline_s, DEADLINE_SLACK_S)()


def _result(outcome: Admission | BaseException) -> list[np.ndarray] | BaseException:
    """A slice's outputs, or the failure of its first row to fail."""
    if isinstance(outcome, BaseException):
        return outcome
    future = outcome.future
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception() or future.result()


def _answer(
    backend: Backend, results: Sequence[list[np.ndarray] | BaseException]
) -> pb.InferResponse:
    response = pb.InferResponse(
        model_name=backend.config.name,
        model_version=backend.version.version,
        fingerprint=backend.fingerprint,
    )
    outputs: list[np.ndarray] = []
    statuses: list[pb.SliceStatus] = []
    for result in results:
        if isinstance(result, BaseException):
            status = status_of(result)
            statuses.append(
                pb.SliceStatus(
                    code=status.code.value[0],
                    message=status.message,
                    trailers=dict(status.trailers),
                )
            )
        else:
            outputs.extend(result)
            statuses.append(_OK)
    response.slices.extend(statuses)  # one call: each append copies into the message
    if outputs:
        first = outputs[0]
        if all(o.shape == first.shape and o.dtype == first.dtype for o in outputs):
            response.packed_outputs.CopyFrom(tensor_to_pb(stack_rows(outputs)))
        else:  # rows of different shapes do not stack: one tensor each
            response.outputs.extend(tensor_to_pb(o) for o in outputs)
    return response
