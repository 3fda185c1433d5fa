"""What a worker serves: one loaded model version, as the servicer, ListModels and the registry
heartbeat see it, whichever way it runs.

Two kinds implement it: fixed-cost backends (`backends.base.Backend`: rows batched by the
shared batching driver) and generation backends (`generation.backend.GenerationBackend`:
sequences stepped by the backend's own engine).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Protocol

from services.common.errors import FingerprintMismatch
from services.common.model_repository import ModelConfig, ModelKind, ModelVersion
from services.common.registry_schema import ModelRecord

if TYPE_CHECKING:
    from services.gpu_worker.backends.base import Backend
    from services.gpu_worker.batching.lane import LoadReport


class BatchLoads(Protocol):
    """The load of fixed-cost versions, measured where their rows queue: the batching driver."""

    def load_report(self, backend: Backend) -> LoadReport: ...


class ServedModel(abc.ABC):
    """One loaded model version."""

    version: ModelVersion
    config: ModelConfig

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A short digest of weights, tokenizer and preprocessing: inputs prepared for one
        fingerprint must never run against another."""

    @property
    def tokenizer_fingerprint(self) -> str:
        """Fingerprint of the input preparation alone (tokenizer + preprocessing); equal to
        `fingerprint` for models that take tensors."""
        return self.fingerprint

    @property
    def kind(self) -> ModelKind:
        return self.config.kind

    @property
    def max_input_tokens(self) -> int:
        """Longest text input, in tokens (special tokens included); 0 for tensor models."""
        return 0

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + generated tokens); 0 for models that do not generate."""
        return 0

    @property
    def length_buckets(self) -> tuple[int, ...]:
        """Padded lengths (tokens) a text model batches by, advertised so gateways can pad
        alike; empty for models that do not batch by length."""
        return ()

    def check_fingerprint(self, request_fingerprint: str) -> None:
        """Raises FingerprintMismatch if a request's inputs were prepared for another version;
        an empty fingerprint (raw inputs, prepared here) always passes."""
        if request_fingerprint and request_fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"inputs were prepared for fingerprint {request_fingerprint}; "
                f"{self.config.name}/{self.version.version} is {self.fingerprint}"
            )

    @abc.abstractmethod
    def warm_up(self) -> None:
        """Runs the model once so that one-off costs (lazy init, allocator) are paid before
        serving. Blocking: call it off the event loop, before serving."""

    @abc.abstractmethod
    def model_record(self, *, is_ready: bool, batching: BatchLoads) -> ModelRecord:
        """This version's entry in the worker's registry heartbeat: what it serves and how
        loaded it is now. `batching` reports fixed-cost versions' load; generation versions
        report their engine's."""

    def _record(self, *, is_ready: bool, max_batch_size: int, **load: Any) -> ModelRecord:
        """The fields every kind's record shares, plus its own load fields."""
        return ModelRecord(
            name=self.config.name,
            version=self.version.version,
            fingerprint=self.fingerprint,
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            kind=self.kind.value,
            max_batch_size=max_batch_size,
            slo_p99_ms=self.config.slo_p99_ms,
            is_ready=is_ready,
            shed_past_slo=self.config.shed_past_slo,
            **load,
        )
