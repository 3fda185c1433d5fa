"""What a worker must load or unload to match the fleet's desired state: a pure function of
the desired states (services.common.repository_state), what it has loaded, what failed, its
model pool and its repository.

Rules:
- A model is wanted when it is in the pool (an empty pool is every model) and its desired
  state is `loaded` or absent (no entry: the repository and `--models` decide, as at start).
- Every version of a wanted model found in the repository is loaded; a version that failed
  to load is retried only once its model's revision has grown (a new RepositoryModelLoad),
  never every period.
- Every loaded version of an unwanted model, or of a wanted one no longer in the repository,
  is unloaded.
Unloads come first (they free memory a load may need), each list in name, version order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.common.repository_state import DesiredState, ModelState

#: (model name, version) of one model version.
VersionKey = tuple[str, str]


@dataclass(frozen=True)
class Load:
    """Load, warm up and start serving this version."""

    model: str
    version: str


@dataclass(frozen=True)
class Unload:
    """Stop advertising this version, finish its admitted work, then free it."""

    model: str
    version: str


Action = Load | Unload


def is_wanted(model: str, desired: Mapping[str, DesiredState], pool: tuple[str, ...]) -> bool:
    """Whether this worker should serve `model` at all."""
    in_pool = not pool or model in pool
    entry = desired.get(model)
    return in_pool and (entry is None or entry.state is ModelState.LOADED)


def revision_of(model: str, desired: Mapping[str, DesiredState]) -> int:
    """The model's desired-state revision; 0 when it has no entry."""
    entry = desired.get(model)
    return 0 if entry is None else entry.revision


def plan(
    *,
    desired: Mapping[str, DesiredState],
    loaded: Iterable[VersionKey],
    failed: Mapping[VersionKey, int],
    pool: tuple[str, ...],
    repository: Iterable[VersionKey],
) -> tuple[Action, ...]:
    """The actions that bring this worker to `desired`.

    `failed` maps each version that failed to load to its model's revision at the attempt;
    `repository` is every version on disk, `loaded` every version served now."""
    on_disk = set(repository)
    serving = set(loaded)
    unloads = [
        Unload(name, version)
        for name, version in sorted(serving, key=_order)
        if not is_wanted(name, desired, pool) or (name, version) not in on_disk
    ]
    loads = [
        Load(name, version)
        for name, version in sorted(on_disk - serving, key=_order)
        if is_wanted(name, desired, pool)
        and failed.get((name, version), -1) != revision_of(name, desired)
    ]
    return (*unloads, *loads)


def _order(key: VersionKey) -> tuple[str, int]:
    name, version = key
    return (name, int(version) if version.isdigit() else -1)
