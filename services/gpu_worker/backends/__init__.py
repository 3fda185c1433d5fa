"""Model backends, chosen by a model's `kind`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.model_repository import ModelConfigError, ModelKind, ModelVersion
from services.gpu_worker.backends.base import Backend


@dataclass(frozen=True)
class LoadOptions:
    """How a worker loads its fixed-cost versions (from WorkerConfig)."""

    #: Models written here (not TorchScript) run their forward through `torch.compile`.
    compile_models: bool = False
    #: Embedding models run as GPU-speed stand-ins timed by this curve (backends/stand_in.py).
    stand_in_curve: Path | None = None


#: The real models, uncompiled.
DEFAULT_LOAD = LoadOptions()


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
