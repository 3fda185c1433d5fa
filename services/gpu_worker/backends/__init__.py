"""Model backends, chosen by a model's `kind`."""

from __future__ import annotations

import torch

from services.common.model_repository import ModelConfigError, ModelKind, ModelVersion
from services.gpu_worker.backends.base import Backend
from services.gpu_worker.load_options import DEFAULT_LOAD, LoadOptions

__all__ = ["DEFAULT_LOAD", "Backend", "LoadOptions", "load_backend"]


def load_backend(
    version: ModelVersion, device: torch.device, options: LoadOptions = DEFAULT_LOAD
) -> Backend:
    """Loads one version's weights onto `device`. Raises ModelConfigError on a bad version."""
    kind = version.config.kind
    if kind is ModelKind.EMBEDDING and options.stand_in_curve is not None:
        from services.gpu_worker.backends.stand_in import StandInBackend

        return StandInBackend(version, device, options.stand_in_curve)
    if kind is ModelKind.EMBEDDING:
        from services.gpu_worker.backends.embedding import EmbeddingBackend

        return EmbeddingBackend(version, device, compile_forward=options.compile_models)
    if kind is ModelKind.TORCHSCRIPT:
        from services.gpu_worker.backends.torchscript import TorchScriptBackend

        return TorchScriptBackend(version, device)
    raise ModelConfigError(f"{version.config.name}: kind {kind.value!r} is not served yet")
