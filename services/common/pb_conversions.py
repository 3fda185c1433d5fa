"""Conversions between the fabric's Python values and the internal protobuf enums, in one place
for every tier (tensors have their own module, `services.common.tensors`)."""

from __future__ import annotations

from services.common.model_repository import ModelKind
from services.pb.inference.v1 import worker_pb2 as pb

_KIND_TO_PB = {
    ModelKind.EMBEDDING: pb.MODEL_KIND_EMBEDDING,
    ModelKind.TORCHSCRIPT: pb.MODEL_KIND_TORCHSCRIPT,
    ModelKind.GENERATION: pb.MODEL_KIND_GENERATION,
}
_FINISH_TO_PB = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP}
_FINISH_FROM_PB = {code: name for name, code in _FINISH_TO_PB.items()}


def model_kind_to_pb(kind: ModelKind | str) -> pb.ModelKind:
    """The wire enum of a model kind (a `ModelKind` or its string value, as registry records
    carry it); MODEL_KIND_UNSPECIFIED for a kind this build does not know."""
    try:
        return _KIND_TO_PB[ModelKind(kind)]
    except ValueError:
        return pb.MODEL_KIND_UNSPECIFIED


def finish_reason_to_pb(reason: str | None) -> pb.FinishReason:
    """ "length"/"stop" as the wire enum; None (not finished) is FINISH_REASON_UNSPECIFIED."""
    return _FINISH_TO_PB.get(reason or "", pb.FINISH_REASON_UNSPECIFIED)


def finish_reason_from_pb(code: pb.FinishReason) -> str | None:
    """The wire enum as "length"/"stop"; None while the stream is not finished. An unknown
    final code reads as "stop"."""
    if code == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return _FINISH_FROM_PB.get(code, "stop")
