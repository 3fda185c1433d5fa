"""The model versions a worker has loaded, of both kinds, looked up by name and version."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.common.errors import InvalidInput, NotFound
from services.common.model_repository import ModelConfigError, ModelKind, ModelVersion
from services.gpu_worker.backends import DEFAULT_LOAD, LoadOptions, load_backend
from services.gpu_worker.backends.base import Backend
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.served_model import ServedModel

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class LoadFailure:
    """A version left out because its weights or backend failed to load."""

    model: str
    version: str
    #: The error, one line, as logged.
    error: str
    #: The model's desired-state revision the attempt followed (0: none written yet).
    revision: int = 0


def load_versions(
    versions: Sequence[ModelVersion],
    device: torch.device,
    metrics: GenerationMetrics,
    options: LoadOptions = DEFAULT_LOAD,
) -> LoadedModels:
    """Loads every version's weights onto `device` (blocking).

    A version that fails to load (corrupt weights, a bad backend setting) is logged and left
    out (`LoadedModels.failed`) as long as another version of its model loads: a bad new
    version must not take down the old one (scenario 24). A model none of whose versions
    loads raises ModelConfigError: the worker never becomes ready, so no traffic reaches a
    worker missing a model it is deployed to serve (scenario 23)."""
    fixed_cost: list[Backend] = []
    generation: list[GenerationBackend] = []
    failed: list[LoadFailure] = []
    for version in versions:
        try:
            model = load_version(version, device, metrics, options)
        except Exception as error:  # any loader error: torch, tokenizers, our own checks
            label = f"{version.config.name}/{version.version}"
            log.error("model %s failed to load; not served: %s", label, error, exc_info=True)
            failed.append(LoadFailure(version.config.name, version.version, one_line(error)))
            continue
        if isinstance(model, GenerationBackend):
            generation.append(model)
        else:
            fixed_cost.append(model)
    models = LoadedModels(fixed_cost=fixed_cost, generation=generation, failed=failed)
    models.check_every_model_served()
    return models


def load_version(
    version: ModelVersion,
    device: torch.device,
    metrics: GenerationMetrics,
    options: LoadOptions = DEFAULT_LOAD,
) -> Backend | GenerationBackend:
    """Loads one version's weights onto `device` (blocking; not warmed up). Raises whatever
    its loader raises (torch, tokenizers, our own checks)."""
    if version.config.kind is ModelKind.GENERATION:
        return GenerationBackend(
            version,
            device,
            metrics,
            host_threads=options.host_threads,
            failing_steps_to_mark=options.failing_steps_to_mark,
        )
    return load_backend(version, device, options)


def one_line(error: Exception) -> str:
    """The last non-empty line of an error (TorchScript errors carry a traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


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
        failed: Sequence[LoadFailure] = (),
    ) -> None:
        #: Versions in the repository that failed to load (not served, not advertised).
        self.failed: tuple[LoadFailure, ...] = tuple(failed)
        #: Generation versions unloaded but still finishing their streams: a worker's stop
        #: drains them with the served ones, within its grace.
        self.unloading: set[GenerationBackend] = set()
        #: Each model's desired-state revision whose loads and unloads are done (the
        #: repository follower's); published per version (ModelRecord.revision).
        self.applied_revisions: dict[str, int] = {}
        self._index(tuple(fixed_cost), tuple(generation))

    def _index(
        self, fixed_cost: tuple[Backend, ...], generation: tuple[GenerationBackend, ...]
    ) -> None:
        """Rebuilds every view at once: a reader on the event loop sees the set before or
        after a change, never half of it."""
        self.fixed_cost = fixed_cost
        self.generation = generation
        #: All versions, by name then version number (the repository's order).
        self.all: tuple[ServedModel, ...] = tuple(
            sorted(
                (*fixed_cost, *generation), key=lambda m: (m.config.name, int(m.version.version))
            )
        )
        self._by_key = {_key(m): m for m in self.all}
        self._fixed_cost_by_key = {_key(b): b for b in self.fixed_cost}
        self._generation_by_key = {_key(b): b for b in self.generation}

    def add(self, model: ServedModel) -> None:
        """Serves a version loaded while running (hot load); clears an earlier failure of it."""
        self.failed = tuple(f for f in self.failed if (f.model, f.version) != _key(model))
        if isinstance(model, GenerationBackend):
            self._index(self.fixed_cost, (*self.generation, model))
        elif isinstance(model, Backend):
            self._index((*self.fixed_cost, model), self.generation)

    def remove(self, model_name: str, model_version: str) -> ServedModel:
        """Stops serving a version (hot unload): from now on it resolves NotFound and is no
        longer advertised. Returns it, for the caller to drain and free."""
        model = self.resolve(model_name, model_version)
        self._index(
            tuple(b for b in self.fixed_cost if b is not model),
            tuple(b for b in self.generation if b is not model),
        )
        return model

    def forget_failures(self, is_news: Callable[[LoadFailure], bool]) -> None:
        """Keeps only the failures `is_news` says still matter (their version still on disk
        and wanted): one deleted or unloaded since is no longer reported."""
        self.failed = tuple(f for f in self.failed if is_news(f))

    def check_every_model_served(self) -> None:
        """Raises ModelConfigError when every version of a model failed (`load_versions`)."""
        missing = sorted({f.model for f in self.failed} - {m.config.name for m in self.all})
        if missing:
            errors = "; ".join(f"{f.model}/{f.version}: {f.error}" for f in self.failed)
            raise ModelConfigError(f"no version of {', '.join(missing)} loaded ({errors})")

    def fail_warm_up(self, model: ServedModel, error: Exception) -> None:
        """Leaves out a version loaded at start whose warm-up failed, as one that failed to
        load is (as a hot load leaves it out)."""
        label = f"{model.config.name}/{model.version.version}"
        log.error("model %s failed to warm up; not served: %s", label, error, exc_info=error)
        self.remove(*_key(model))
        self.add_failure(LoadFailure(*_key(model), one_line(error)))

    def add_failure(self, failure: LoadFailure) -> None:
        """Records a version that failed to load while running (reported, not served)."""
        key = (failure.model, failure.version)
        self.failed = (*(f for f in self.failed if (f.model, f.version) != key), failure)

    def resolve(self, model_name: str, model_version: str) -> ServedModel:
        """The named version, or the highest one for an empty `model_version`. Raises
        InvalidInput for a malformed name or version, NotFound for one not loaded."""
        if not _NAME_RE.match(model_name):
            raise InvalidInput(f"model name {model_name!r} is not a valid model name")
        # ASCII decimal, as the repository's version directories (not str.isdigit: "²" is a
        # digit int() does not read), and short (int() refuses over 4,300 digits).
        if model_version and not (
            model_version.isascii() and model_version.isdecimal() and len(model_version) <= 20
        ):
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
