"""A bundle that no worker can take whole in time, routed in parts.

The router forwards a bundle (services.common.bundles) as the bytes it arrived as, with one
routing decision and one reservation. Only when no worker can finish all of it within its
deadline does the router open it: `plan` halves it by rows, along its slices, until each part
is routed or is one slice that no worker can take (that slice alone is refused), at most
`MAX_SPLIT_DEPTH` halvings deep. Each part travels as a bundle of its own, and `merge` answers
the caller with one status per slice, in slice order, as if the bundle had been served whole.

Pure: no I/O and no clock. The router decides each part (`Decide`); this module cuts the
request, relays cancelled slices to the parts that carry them and merges the answers.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from services.common.bundles import SliceCancels, token_row_ends
from services.common.errors import InvalidInput, Overloaded, UpstreamError
from services.common.grpc_errors import status_of
from services.pb.inference.v1 import worker_pb2 as pb
from services.router.routing import Reject, RejectReason, Route

log = logging.getLogger(__name__)

#: Halvings at most: a bundle goes out in 2**MAX_SPLIT_DEPTH parts or fewer, after at most
#: 2 * (2**MAX_SPLIT_DEPTH - 1) routing decisions. Splitting happens when the fleet is busy,
#: when the router's CPU is worth most: past this depth, a part no worker takes is refused.
MAX_SPLIT_DEPTH = 3


@dataclass(frozen=True)
class Part:
    """Slices [first, stop) of a bundle, routed and sent as one bundle."""

    first: int
    stop: int
    #: Each slice's rows.
    slice_rows: tuple[int, ...]
    #: How long before the bundle's deadline this part's deadline (its latest slice's) falls.
    earlier_us: int
    #: The part's tenant when all its slices share one ("" and 1.0 when they do not: routing
    #: then prices the rows as shared, as the gateway does for a bundle).
    tenant: str
    weight: float

    @property
    def rows(self) -> int:
        return sum(self.slice_rows)


def _weight(value: float) -> float:
    """A slice's fair-share weight for routing: 1 (the default) when unset or not a positive
    number (the worker refuses the slice; routing must not price negative rows ahead)."""
    return value if math.isfinite(value) and value > 0 else 1.0


#: The routing decision for a part: a route (rows reserved) or why none.
Decide = Callable[[Part], Route | Reject]


class Bundle:
    """A parsed bundle: its slices' rows and where each slice's rows lie in the packed columns."""

    def __init__(self, request: pb.InferRequest, token_starts: list[int] | None) -> None:
        self.request = request
        self.slice_rows = [s.rows for s in request.slices]
        #: Row index where each slice starts, and the total at the end.
        self._row_starts = [0, *itertools.accumulate(self.slice_rows)]
        #: Text bundles: offset of each row's first token id, and the total at the end.
        self._token_starts = token_starts

    @classmethod
    def parse(cls, body: bytes) -> Bundle | None:
        """The bundle in `body`; None when `body` is no bundle of two slices or more, or its
        packed columns do not add up (the worker refuses those; there is nothing to split)."""
        try:
            request = pb.InferRequest.FromString(body)
        except DecodeError:  # the worker refuses it whole; nothing to split
            return None
        num_rows = sum(s.rows for s in request.slices)
        if len(request.slices) < 2 or any(s.rows < 1 for s in request.slices):
            return None
        packed = request.packed
        has_tokens = bool(packed.token_ids or packed.row_lengths)
        if has_tokens and packed.HasField("tensor"):
            return None  # two columns: the worker refuses it (or reads the tokens); not ours
        if packed.HasField("tensor"):
            shape = packed.tensor.shape
            if not shape or shape[0] != num_rows or len(packed.tensor.raw_data) % num_rows:
                return None
            return cls(request, None)
        try:
            ends = token_row_ends(packed.token_ids, packed.row_lengths, num_rows)
        except InvalidInput:  # the worker refuses it whole; nothing to split
            return None
        return cls(request, [0, *ends.tolist()])

    def part(self, first: int, stop: int) -> Part:
        slices = self.request.slices[first:stop]
        tenants = {(s.tenant, _weight(s.tenant_weight)) for s in slices}
        tenant, weight = next(iter(tenants)) if len(tenants) == 1 else ("", 1.0)
        return Part(
            first,
            stop,
            tuple(self.slice_rows[first:stop]),
            min(s.earlier_us for s in slices),
            tenant,
            weight,
        )

    def halfway(self, first: int, stop: int) -> int:
        """Where [first, stop) (two slices or more) splits into two parts of about equal rows."""
        half = (self._row_starts[first] + self._row_starts[stop]) / 2
        middle = first + 1
        while middle < stop - 1 and self._row_starts[middle + 1] <= half:
            middle += 1
        return middle

    def body(self, part: Part) -> bytes:
        """The request that carries `part` alone: its slices, with deadlines measured from the
        part's own (its latest slice's), and their rows of the packed columns."""
        whole = self.request
        request = pb.InferRequest(
            model_name=whole.model_name,
            model_version=whole.model_version,
            fingerprint=whole.fingerprint,
        )
        for piece in whole.slices[part.first : part.stop]:
            copy = request.slices.add()
            copy.CopyFrom(piece)
            copy.earlier_us = piece.earlier_us - part.earlier_us
        first_row, stop_row = self._row_starts[part.first], self._row_starts[part.stop]
        packed = whole.packed
        if self._token_starts is None:
            row_bytes = len(packed.tensor.raw_data) // packed.tensor.shape[0]
            request.packed.tensor.dtype = packed.tensor.dtype
            request.packed.tensor.shape.extend([part.rows, *packed.tensor.shape[1:]])
            request.packed.tensor.raw_data = packed.tensor.raw_data[
                first_row * row_bytes : stop_row * row_bytes
            ]
        else:
            first_id, stop_id = self._token_starts[first_row], self._token_starts[stop_row]
            request.packed.token_ids = packed.token_ids[4 * first_id : 4 * stop_id]
            request.packed.row_lengths = packed.row_lengths[4 * first_row : 4 * stop_row]
        return request.SerializeToString()


def plan(bundle: Bundle, decide: Decide) -> list[tuple[Part, Route | Reject]]:
    """The parts of a bundle that was refused whole for its deadline, in slice order, each with
    its decision: halved by rows until a part is routed, is one slice, is refused for another
    reason than its deadline, or lies `MAX_SPLIT_DEPTH` halvings deep."""
    decided: list[tuple[Part, Route | Reject]] = []

    def place(first: int, stop: int, depth: int) -> None:
        part = bundle.part(first, stop)
        decision = decide(part)
        if (
            isinstance(decision, Route)
            or decision.reason is not RejectReason.DEADLINE
            or stop - first == 1
            or depth == MAX_SPLIT_DEPTH
        ):
            decided.append((part, decision))
            return
        middle = bundle.halfway(first, stop)
        place(first, middle, depth + 1)
        place(middle, stop, depth + 1)

    whole = len(bundle.slice_rows)
    middle = bundle.halfway(0, whole)
    place(0, middle, 1)
    place(middle, whole, 1)
    return decided


def relay_cancels(
    whole: SliceCancels, parts: Sequence[Part]
) -> tuple[list[SliceCancels], Callable[[], None]]:
    """Each part's cancelled slices, fed from the bundle's (a slice's index in its part); and
    the function that stops the relay."""
    cancels = [SliceCancels() for _ in parts]

    def relay(index: int) -> None:
        for part, part_cancels in zip(parts, cancels, strict=True):
            if part.first <= index < part.stop:
                part_cancels.cancel(index - part.first)
                return

    return cancels, whole.listen(relay)


def merge(answers: Sequence[tuple[Part, bytes | BaseException]]) -> bytes:
    """The bundle's answer from its parts' (in slice order): one status per slice, the rows of
    the slices answered OK, packed when every part packed rows of one dtype and shape, and the
    longest of the parts' times in their workers (0 when a part failed: its time is not
    known, so the gateway's bundle clock reads the round trip instead)."""
    response = pb.InferResponse()
    failed = False
    # Each answered part's rows, in order: its packed tensor, or its row tensors.
    outputs: list[pb.Tensor | Sequence[pb.Tensor]] = []
    for part, answer in answers:
        if isinstance(answer, bytes):
            try:
                answered = _part_response(answer, part)
            except Exception as error:  # a malformed answer: its part's slices hear of it
                log.error(
                    "a part of a split bundle (slices %d-%d) answered what does not read",
                    part.first, part.stop - 1, exc_info=error,
                )  # fmt: skip
                answer = error
            else:
                if not response.model_name:
                    response.model_name = answered.model_name
                    response.model_version = answered.model_version
                    response.fingerprint = answered.fingerprint
                response.slices.extend(answered.slices)
                response.worker_us = max(response.worker_us, answered.worker_us)
                if answered.HasField("packed_outputs"):
                    outputs.append(answered.packed_outputs)
                elif answered.outputs:
                    outputs.append(answered.outputs)
                continue
        response.slices.extend(_failed(answer) for _ in part.slice_rows)
        failed = True
    packed = [o for o in outputs if isinstance(o, pb.Tensor)]
    if packed and len(packed) == len(outputs) and _stack_alike(packed):
        response.packed_outputs.CopyFrom(_stacked(packed))
    else:
        for output in outputs:
            response.outputs.extend(_rows(output) if isinstance(output, pb.Tensor) else output)
    if failed:
        response.worker_us = 0
    return response.SerializeToString()


def _part_response(body: bytes, part: Part) -> pb.InferResponse:
    """A part's answer, checked: a status per slice and a row per row of its OK slices (so a
    malformed answer fails its own part's callers, never its bundle-mates')."""
    response = pb.InferResponse.FromString(body)
    if len(response.slices) != len(part.slice_rows):
        raise ValueError(
            f"a part of {len(part.slice_rows)} slices answered with {len(response.slices)} statuses"
        )
    expected = sum(r for r, s in zip(part.slice_rows, response.slices, strict=True) if s.code == 0)
    if response.HasField("packed_outputs"):
        shape = response.packed_outputs.shape
        answered = shape[0] if shape else -1
    else:
        answered = len(response.outputs)
    if answered != expected:
        raise ValueError(f"a part answered {answered} rows for {expected}")
    return response


def _stack_alike(tensors: Sequence[pb.Tensor]) -> bool:
    first = tensors[0]
    return all(t.dtype == first.dtype and t.shape[1:] == first.shape[1:] for t in tensors)


def _stacked(tensors: Sequence[pb.Tensor]) -> pb.Tensor:
    first = tensors[0]
    return pb.Tensor(
        dtype=first.dtype,
        shape=[sum(t.shape[0] for t in tensors), *first.shape[1:]],
        raw_data=b"".join(t.raw_data for t in tensors),
    )


def _rows(stacked: pb.Tensor) -> list[pb.Tensor]:
    """A packed tensor's rows, each a tensor of its own."""
    num_rows = stacked.shape[0]
    row_bytes = len(stacked.raw_data) // num_rows if num_rows else 0
    return [
        pb.Tensor(
            dtype=stacked.dtype,
            shape=stacked.shape[1:],
            raw_data=stacked.raw_data[i * row_bytes : (i + 1) * row_bytes],
        )
        for i in range(num_rows)
    ]


def _failed(error: BaseException) -> pb.SliceStatus:
    """One slice's status of a part that failed or was refused with `error`: a retry hint of
    its own, so that the part's callers do not all come back together."""
    if isinstance(error, Overloaded | UpstreamError):
        error = error.for_one_caller()
    status = status_of(error)
    return pb.SliceStatus(
        code=status.code.value[0], message=status.message, trailers=dict(status.trailers)
    )
