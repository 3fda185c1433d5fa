"""Model backends, chosen by a model's `kind`."""

from __future__ import annotations

import torch

from services.common.model_repository import ModelConfigError, ModelKind, ModelVersion
from services.gpu_worker.backends.base import Backend


def load_backend(
    version: ModelVersion, device: torch.device, *, compile_models: bool = False
) -> Backend:
    """Loads one version's weights onto `device`. Raises ModelConfigError on a bad version.
    `compile_models`: models written here (not TorchScript) run their forward through
    `torch.compile`."""
    kind = version.config.kind
    if kind is ModelKind.EMBEDDING:
        from services.gpu_worker.backends.embedding import EmbeddingBackend

        return EmbeddingBackend(version, device, compile_forward=compile_models)
    if kind is ModelKind.TORCHSCRIPT:
        from services.gpu_worker.backends.torchscript import TorchScriptBackend

        return TorchScriptBackend(version, device)
    raise ModelConfigError(f"{version.config.name}: kind {kind.value!r} is not served yet")
