"""What a worker must load or unload to match the fleet's desired state: a pure function of
the desired states (services.common.repository_state), what it has loaded, what failed, its
model pool and its repository.

Rules:
- A model is wanted when it is in the pool (an empty pool is every model) and its desired
  state is `loaded` or absent (no entry: the repository and `--models` decide, as at start).
- Every version of a wanted model found in the repository is loaded; a version that failed
  to load is retried only once its model's revision has grown (a new RepositoryModelLoad),
  never every period.
- Every loaded version of an unwanted model is unloaded, first (freeing memory a load may
  need).
- A loaded version of a wanted model no longer in the repository is retired (`Retire`): after
  the loads, so that a version replaced on disk (v1 deleted, v2 added) serves until its
  replacement does, and not at all while its model serves no other version and a load of it
  failed at its revision (`keeps_serving`: RELIABILITY.md, a new version that fails to load
  leaves the old one serving). Unloaded first, a swap left the model served by no worker of
  the fleet for the new version's load and warm-up, and for good when it failed (review
  finding). A model whose every version left the repository, with nothing failed, retires
  them all.
Each list in name, version order.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
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


@dataclass(frozen=True)
class Retire:
    """Unload this version, gone from the repository, unless `keeps_serving` says it must
    stay (checked when it is applied, after the plan's loads)."""

    model: str
    version: str


Action = Load | Unload | Retire


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
    serving = sorted(set(loaded), key=_order)
    unloads = [Unload(*key) for key in serving if not is_wanted(key[0], desired, pool)]
    loads = [
        Load(name, version)
        for name, version in sorted(on_disk - set(serving), key=_order)
        if is_wanted(name, desired, pool)
        and failed.get((name, version), -1) != revision_of(name, desired)
    ]
    retires = [
        Retire(*key) for key in serving if is_wanted(key[0], desired, pool) and key not in on_disk
    ]
    return (*unloads, *loads, *retires)


def keeps_serving(
    retire: Retire,
    *,
    desired: Mapping[str, DesiredState],
    loaded: Iterable[VersionKey],
    failed: Mapping[VersionKey, int],
    repository: Container[VersionKey],
) -> bool:
    """Whether a version gone from the repository stays loaded: its model serves no other
    version, and a load of one still in the `repository` failed at the model's revision (its
    replacement). A model whose every version left the repository is retired whatever
    failed before."""
    model = retire.model
    if any(name == model and version != retire.version for name, version in loaded):
        return False
    revision = revision_of(model, desired)
    return any(
        key[0] == model and at == revision and key in repository for key, at in failed.items()
    )


def _order(key: VersionKey) -> tuple[str, int]:
    name, version = key
    return (name, int(version) if version.isdigit() else -1)
