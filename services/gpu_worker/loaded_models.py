"""The model versions a worker has loaded, of both kinds, looked up by name and version."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from services.common.errors import InvalidInput, NotFound
from services.common.model_repository import ModelKind, ModelVersion
from services.gpu_worker.backends import load_backend
from services.gpu_worker.backends.base import Backend
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.metrics import GenerationMetrics

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")

AnyBackend = Backend | GenerationBackend


def load_versions(
    versions: Sequence[ModelVersion], device: torch.device, metrics: GenerationMetrics
) -> list[AnyBackend]:
    """Loads every version's weights onto `device` (blocking). Raises ModelConfigError."""
    return [
        GenerationBackend(v, device, metrics)
        if v.config.kind is ModelKind.GENERATION
        else load_backend(v, device)
        for v in versions
    ]


class LoadedModels:
    def __init__(self, backends: Sequence[AnyBackend]) -> None:
        self._by_key = {(b.config.name, b.version.version): b for b in backends}
        self.backends = tuple(backends)

    @property
    def fixed_cost(self) -> list[Backend]:
        return [b for b in self.backends if isinstance(b, Backend)]

    @property
    def generation(self) -> list[GenerationBackend]:
        return [b for b in self.backends if isinstance(b, GenerationBackend)]

    def resolve(self, model_name: str, model_version: str) -> AnyBackend:
        if not _NAME_RE.match(model_name):
            raise InvalidInput(f"model name {model_name!r} is not a valid model name")
        if model_version and not model_version.isdigit():
            raise InvalidInput(f"model version {model_version!r} must be a version number")
        if model_version:
            backend = self._by_key.get((model_name, str(int(model_version))))
        else:
            versions = [b for (name, _), b in self._by_key.items() if name == model_name]
            backend = max(versions, key=lambda b: int(b.version.version), default=None)
        if backend is None:
            raise NotFound(f"model {model_name!r} version {model_version or 'latest'!r} not found")
        return backend

    def fixed_cost_backend(self, model_name: str, model_version: str) -> Backend:
        backend = self.resolve(model_name, model_version)
        if not isinstance(backend, Backend):
            raise InvalidInput(f"{model_name} is a generation model: call Generate")
        return backend

    def generation_backend(self, model_name: str, model_version: str) -> GenerationBackend:
        backend = self.resolve(model_name, model_version)
        if not isinstance(backend, GenerationBackend):
            raise InvalidInput(f"{model_name} is not a generation model: call Infer")
        return backend
