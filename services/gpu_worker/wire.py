"""The worker's messages to and from its own types: a request's inputs, a generation's
weight, a served version's description."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from services.common.errors import InvalidInput
from services.common.pb_conversions import model_kind_to_pb
from services.common.tensors import dtype_pb, tensor_from_pb
from services.common.text import TokenIds
from services.gpu_worker.backends.base import RawInput
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.served_model import ServedModel
from services.pb.inference.v1 import worker_pb2 as pb


def raw_input(model_input: pb.ModelInput) -> RawInput:
    which = model_input.WhichOneof("payload")
    if which == "text":
        return model_input.text
    if which == "token_ids":
        return TokenIds(_token_ids(model_input.token_ids))
    if which == "tensor":
        return tensor_from_pb(model_input.tensor)
    raise InvalidInput("an input has no payload (text, token_ids or tensor)")


def generation_prompt(backend: GenerationBackend, request: pb.WorkerGenerateRequest) -> list[int]:
    """A generation request's prompt token ids: its text encoded, or its ids checked."""
    which = request.WhichOneof("prompt")
    if which == "text":
        return backend.encode(request.text)
    if which == "token_ids":
        if not request.fingerprint:
            raise InvalidInput("token_ids prompts require the tokenizer's fingerprint")
        ids = backend.text.check_ids(_token_ids(request.token_ids))
        return [int(i) for i in ids]
    raise InvalidInput("request has no prompt (text or token_ids)")


def _token_ids(packed: bytes) -> np.ndarray:
    """Token ids sent packed, little-endian int32; INVALID_ARGUMENT for a partial one."""
    if len(packed) % 4:
        raise InvalidInput("token_ids must be little-endian int32 (a multiple of 4 bytes)")
    return np.frombuffer(packed, dtype="<i4")


def generation_weight(value: float) -> float:
    """A generation request's fair-share weight: 0 (unset) is 1; INVALID_ARGUMENT unless
    finite and positive."""
    if not (math.isfinite(value) and value >= 0.0):
        raise InvalidInput(f"tenant weight must be finite and >= 0, got {value}")
    return value or 1.0


def version_info(model: ServedModel, *, is_ready: bool) -> pb.ModelVersionInfo:
    config = model.config

    def specs(tensors: Sequence) -> list[pb.TensorSpec]:
        return [pb.TensorSpec(name=t.name, dtype=dtype_pb(t.dtype), dims=t.dims) for t in tensors]

    return pb.ModelVersionInfo(
        model_name=config.name,
        model_version=model.version.version,
        fingerprint=model.fingerprint,
        kind=model_kind_to_pb(model.kind),
        max_batch_size=config.max_batch_size,
        slo_p99_ms=config.slo_p99_ms,
        length_buckets=list(model.length_buckets),
        max_input_tokens=model.max_input_tokens,
        max_model_len=model.max_model_len,
        inputs=specs(config.inputs),
        outputs=specs(config.outputs),
        is_ready=is_ready,
        tokenizer_fingerprint=model.tokenizer_fingerprint,
    )
