"""How a worker loads its versions: apart from the backends, so that reading the worker's
settings (its fronts do) imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.gpu_worker.batching.failure_streak import FailingConfig


@dataclass(frozen=True)
class LoadOptions:
    """How a worker loads its versions (from WorkerConfig)."""

    #: Models written here (not TorchScript) run their forward through `torch.compile`.
    compile_models: bool = False
    #: Embedding models run as GPU-speed stand-ins timed by this curve (backends/stand_in.py).
    stand_in_curve: Path | None = None
    #: The torch threads a generation engine on a CPU chooses up to (0: torch's count on the
    #: loading thread). Resolved once at start (execution.resolve_threads): torch gives a
    #: thread its count when it first asks, from the last count set on any thread, so a version
    #: loaded while serving could read a batch's momentary one.
    host_threads: int = 0
    #: Failed steps in a row that mark a generation version failing (0: never;
    #: batching.failure_streak): the worker's --failing-batches-to-mark.
    failing_steps_to_mark: int = FailingConfig.batches_to_mark


#: The real models, uncompiled.
DEFAULT_LOAD = LoadOptions()
