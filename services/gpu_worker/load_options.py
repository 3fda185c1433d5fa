"""How a worker loads its fixed-cost versions: apart from the backends, so that reading the
worker's settings (its fronts do) imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoadOptions:
    """How a worker loads its fixed-cost versions (from WorkerConfig)."""

    #: Models written here (not TorchScript) run their forward through `torch.compile`.
    compile_models: bool = False
    #: Embedding models run as GPU-speed stand-ins timed by this curve (backends/stand_in.py).
    stand_in_curve: Path | None = None


#: The real models, uncompiled.
DEFAULT_LOAD = LoadOptions()
