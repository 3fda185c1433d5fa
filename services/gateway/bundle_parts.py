"""The parts of a bundle the gateway's coalescer (services.gateway.coalescer) fills, sends and
answers: its key, each caller's slice, and what each caller is told once the bundle is
prepared, answered or failed."""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
import numpy as np

from services.common.bundles import SliceCancels
from services.common.errors import InvalidInput, UpstreamError
from services.common.tensors import tensor_from_pb
from services.pb.inference.v1 import worker_pb2 as pb

#: Turns each caller's values into its rows, once per bundle (a text model tokenizes every
#: caller's texts in one call): per caller, its rows or the InvalidInput that refuses it alone.
Made = list[np.ndarray] | InvalidInput
Prepare = Callable[[Sequence[Sequence[Any]]], list[Made]]


class BundleKey(NamedTuple):
    """What the calls of one bundle share: the model version, its inputs' kind, the class. A
    tuple: made, hashed and compared per call, in C (a frozen dataclass's are Python calls)."""

    model: str
    version: str
    fingerprint: str
    #: The priority class's name (routing and the worker's order are per class).
    priority: str
    #: Rows are token ids (text models), not tensor rows.
    is_text: bool
    #: Text models: texts too long are cut, not refused (another tokenizer).
    truncate: bool = False
    #: `deadline_class` of the caller's time left: a bundle is answered once all its slices
    #: are, so callers whose deadlines are far apart do not share one.
    deadline_class: int = 0


def deadline_class(timeout_s: float) -> int:
    """Time left in classes of powers of two milliseconds (bundle-mates' within 2x)."""
    return math.ceil(math.log2(max(1.0, timeout_s * 1000.0)))


@dataclass(slots=True)  # made per call: not frozen, whose fields are set at a call each
class Answered:
    """A caller's outputs, and the rows that were sent for it (token ids for text models)."""

    outputs: list[np.ndarray]
    rows: Sequence[np.ndarray]


@dataclass(eq=False)  # found by identity: its rows (arrays) do not compare with `==`
class CallerSlice:
    #: The caller's values: its rows, or what `Prepare` makes them of.
    rows: Sequence[Any]
    piece: pb.Slice
    deadline_s: float
    future: asyncio.Future[list[np.ndarray]]
    #: Bytes its tensor rows carry, as the caller gave them (a text's values count none).
    num_bytes: int
    #: Its index in the bundle once sent (None before).
    index: int | None = None
    #: The bundle it is in (another, once sent again: `answer`).
    bundle: Bundle | None = None
    #: Whether it was sent again already (a slice the worker refused unstarted: once).
    is_resent: bool = False
    #: Called once if its caller stops waiting (deadline, cancellation) before it is sent.
    on_unsent: Callable[[], None] | None = None
    #: The caller's context (its trace): a bundle is sent in its first slice's.
    context: contextvars.Context = field(default_factory=contextvars.copy_context)


@dataclass
class Bundle:
    key: BundleKey
    prepare: Prepare | None
    slices: list[CallerSlice] = field(default_factory=list)
    rows: int = 0
    #: Bytes its slices' rows carry (CallerSlice.num_bytes).
    num_bytes: int = 0
    cancels: SliceCancels = field(default_factory=SliceCancels)
    is_sent: bool = False
    #: Its answer came and parsed (its slices each got their status).
    is_answered: bool = False
    #: While the clock holds it: when the hold began, and a future done once it leaves.
    held_from: float | None = None
    left: asyncio.Future[None] | None = None
    #: The task sending it, once it left: cancelled when every caller in it stopped waiting.
    task: asyncio.Task[None] | None = None


def closing() -> UpstreamError:
    return UpstreamError(grpc.StatusCode.UNAVAILABLE, "gateway is shutting down")


def fail(slices: Sequence[CallerSlice], error: BaseException) -> None:
    """Every caller not answered yet gets `error` (a downstream status: its own copy; a
    NOT_FOUND is UNAVAILABLE, as_not_served_now: each caller's version is in the repository)."""
    if isinstance(error, StopIteration):  # a future cannot hold one (a tokenizer's)
        error = RuntimeError(f"preparing the bundle's rows: {error!r}")
    if isinstance(error, UpstreamError):
        error = error.as_not_served_now()
    for entry in slices:
        if not entry.future.done():
            own = error.for_one_caller() if isinstance(error, UpstreamError) else error
            entry.future.set_exception(own)


def unsent(entry: CallerSlice) -> None:
    """Tells `entry`'s caller its rows ran nowhere (`on_unsent`: back to its tenant): refused
    or failed here before its bundle left, whatever error it gets (a tokenizer's own, our
    bug, kept them charged: review finding)."""
    if entry.on_unsent is not None:
        entry.on_unsent()


def prepared(bundle: Bundle) -> list[CallerSlice]:
    """The bundle's slices with their rows made (`Prepare`); refused callers answered, left out.
    Where making them fails other than by refusing a caller (a tokenizer's own error on some
    text), each caller's rows are made again alone, and only a caller whose rows fail so gets
    that error (its bundle-mates all got it before); raises it for a bundle of one."""
    if bundle.prepare is None:
        return bundle.slices
    kept = []
    try:
        made: list[Made | Exception] = list(bundle.prepare([s.rows for s in bundle.slices]))
    except Exception:
        if len(bundle.slices) < 2:
            raise
        made = [
            _GONE if entry.future.done() else _made_alone(bundle.prepare, entry)
            for entry in bundle.slices
        ]  # a caller gone already is not prepared again, and left out
    for entry, rows in zip(bundle.slices, made, strict=True):
        if isinstance(rows, Exception):
            if not entry.future.done():
                unsent(entry)
                entry.future.set_exception(rows)
        else:
            entry.rows = rows
            kept.append(entry)
    return kept


#: What a caller answered already (gone: its deadline, a cancel) gets instead of rows made
#: alone (`prepared`): it is left out of its bundle, and nobody hears of it.
_GONE = RuntimeError("the caller was answered before its rows were made")


def _made_alone(prepare: Prepare, entry: CallerSlice) -> Made | Exception:
    """One caller's rows made alone, or the error making them raised."""
    try:
        (rows,) = prepare([entry.rows])
    except StopIteration as error:  # not an exception a future may hold
        return RuntimeError(f"preparing a caller's rows: {error!r}")
    except Exception as error:
        return error
    return rows


def answer(slices: Sequence[CallerSlice], response: pb.InferResponse) -> list[CallerSlice]:
    """Hands each caller its slice's rows or status; returns, unanswered, the slices to send
    again: those the worker refused UNAVAILABLE without starting them (its batching stopped,
    or its drain ran out) while their bundle-mates were served, not sent again before and with
    time left. A call of its own refused so is sent elsewhere (predictor._call_router)."""
    if len(response.slices) != len(slices):
        raise UpstreamError(
            grpc.StatusCode.INTERNAL,
            f"bundle of {len(slices)} slices answered with {len(response.slices)} statuses",
        )
    try:
        if response.HasField("packed_outputs"):
            outputs = list(tensor_from_pb(response.packed_outputs))
        else:
            outputs = [tensor_from_pb(t) for t in response.outputs]
    except InvalidInput as error:  # downstream's fault, not the callers'
        raise UpstreamError(grpc.StatusCode.INTERNAL, f"bundle answered {error}") from None
    answered = sum(len(e.rows) for e, s in zip(slices, response.slices, strict=True) if s.code == 0)
    if answered != len(outputs):
        raise UpstreamError(
            grpc.StatusCode.INTERNAL, f"bundle answered {len(outputs)} rows for {answered}"
        )
    start, again, now_s = 0, [], time.monotonic()
    for entry, status in zip(slices, response.slices, strict=True):
        if status.code == 0:
            result, start = outputs[start : start + len(entry.rows)], start + len(entry.rows)
            if not entry.future.done():
                entry.future.set_result(result)
        elif not entry.future.done():
            refused = UpstreamError.from_status(status.code, status.message, status.trailers)
            refused = refused.as_not_served_now()
            if refused.is_not_started and not entry.is_resent and entry.deadline_s > now_s:
                again.append(entry)
            else:
                entry.future.set_exception(refused)
    return again
