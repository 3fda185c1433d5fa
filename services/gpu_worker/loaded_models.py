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
from services.gpu_worker.served_model import ServedModel

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def load_versions(
    versions: Sequence[ModelVersion], device: torch.device, metrics: GenerationMetrics
) -> LoadedModels:
    """Loads every version's weights onto `device` (blocking). Raises ModelConfigError."""
    fixed_cost: list[Backend] = []
    generation: list[GenerationBackend] = []
    for version in versions:
        if version.config.kind is ModelKind.GENERATION:
            generation.append(GenerationBackend(version, device, metrics))
        else:
            fixed_cost.append(load_backend(version, device))
    return LoadedModels(fixed_cost=fixed_cost, generation=generation)


def _key(model: ServedModel) -> tuple[str, str]:
    return (model.config.name, model.version.version)


class LoadedModels:
    """Every loaded version, and each kind on its own: fixed-cost versions run in the batching
    driver, generation versions in their own engines."""

    def __init__(
        self,
        *,
        fixed_cost: Sequence[Backend] = (),
        generation: Sequence[GenerationBackend] = (),
    ) -> None:
        self.fixed_cost = tuple(fixed_cost)
        self.generation = tuple(generation)
        #: All versions, by name then version number (the repository's order).
        self.all: tuple[ServedModel, ...] = tuple(
            sorted(
                (*fixed_cost, *generation), key=lambda m: (m.config.name, int(m.version.version))
            )
        )
        self._by_key = {_key(m): m for m in self.all}
        self._fixed_cost_by_key = {_key(b): b for b in self.fixed_cost}
        self._generation_by_key = {_key(b): b for b in self.generation}

    def resolve(self, model_name: str, model_version: str) -> ServedModel:
        """The named version, or the highest one for an empty `model_version`. Raises
        InvalidInput for a malformed name or version, NotFound for one not loaded."""
        if not _NAME_RE.match(model_name):
            raise InvalidInput(f"model name {model_name!r} is not a valid model name")
        if model_version and not model_version.isdigit():
            raise InvalidInput(f"model version {model_version!r} must be a version number")
        if model_version:
            model = self._by_key.get((model_name, str(int(model_version))))
        else:
            versions = [m for (name, _), m in self._by_key.items() if name == model_name]
            model = max(versions, key=lambda m: int(m.version.version), default=None)
        if model is None:
            raise NotFound(f"model {model_name!r} version {model_version or 'latest'!r} not found")
        return model

    def fixed_cost_backend(self, model_name: str, model_version: str) -> Backend:
        backend = self._fixed_cost_by_key.get(_key(self.resolve(model_name, model_version)))
        if backend is None:
            raise InvalidInput(f"{model_name} is a generation model: call Generate")
        return backend

    def generation_backend(self, model_name: str, model_version: str) -> GenerationBackend:
        backend = self._generation_by_key.get(_key(self.resolve(model_name, model_version)))
        if backend is None:
            raise InvalidInput(f"{model_name} is not a generation model: call Infer")
        return backend
