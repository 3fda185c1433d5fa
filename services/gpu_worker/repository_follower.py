"""The worker's side of the fleet's desired model state: read `<prefix>:repository` (one
HGETALL) every period, plan with services.gpu_worker.reconcile, and apply the plan through the
ModelSwapper. Never on the request path; a Redis outage leaves the worker serving what it has.

The repository directory is re-read only when some model's desired revision changed (a new
RepositoryModelLoad or Unload), so versions added to the volume are picked up by a load, as in
Triton, without scanning the disk every period."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.lifecycle import sleep_unless_stopped, stop_if_cancelled
from services.common.model_repository import ModelConfigError, ModelVersion, load_repository
from services.common.redis_acl import WORKER, role_credentials
from services.common.registry_schema import connect
from services.common.repository_state import DesiredState, parse_desired, repository_key
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.hot_swap import ModelSwapper, in_daemon_thread
from services.gpu_worker.loaded_models import LoadedModels
from services.gpu_worker.reconcile import (
    Action,
    Retire,
    Unload,
    VersionKey,
    is_wanted,
    keeps_serving,
    plan,
    revision_of,
)

log = logging.getLogger(__name__)

#: Seconds between reads of the desired state: a change reaches every worker within about
#: this plus one load or drain.
FOLLOW_PERIOD_S = 1.0


def read_pool_at_start(repository_dir: Path, pool: tuple[str, ...]) -> list[ModelVersion]:
    """The repository's versions at start-up. A model that does not read (its files still
    being copied) is logged and left out, for the follower to load once it reads, unless it is
    in the worker's named pool (`--models`): the start then fails naming why. A model outside
    the pool never stops a worker."""
    errors: dict[str, ModelConfigError] = {}
    versions = load_repository(repository_dir, on_error=errors.__setitem__)
    if pool and (wanted := [str(errors[name]) for name in pool if name in errors]):
        raise ModelConfigError("; ".join(wanted))
    if not pool:
        for name, error in errors.items():
            log.error("model %s not read; not served until it reads: %s", name, error)
    return versions


async def desired_at_start(config: WorkerConfig) -> dict[str, DesiredState] | None:
    """The desired state before the first load, so that a worker started after an unload does
    not load (and advertise) what the fleet unloaded; {} without Redis; None while it is
    unreachable (the pool is loaded, and the follower corrects within a period)."""
    if not config.redis_url:
        return {}
    credentials = role_credentials(WORKER, config.redis_url, config.redis_password_file)
    client = connect(config.redis_url, credentials=credentials)
    try:
        return parse_desired(await client.hgetall(repository_key(config.registry_prefix)))
    except (RedisError, OSError) as error:
        log.warning("desired model state unreadable at start (%s): loading the pool", error)
        return None
    finally:
        await client.aclose()


class RepositoryFollower:
    """Brings the worker's loaded versions to the desired state, one action at a time."""

    def __init__(
        self,
        *,
        client: aioredis.Redis,
        registry_prefix: str,
        repository_dir: Path,
        pool: tuple[str, ...],
        models: LoadedModels,
        swapper: ModelSwapper,
        start_state: Mapping[str, DesiredState] | None = None,
        on_applied: Callable[[], None] = lambda: None,
    ) -> None:
        """`start_state`: the desired state the start-up load followed (None: it could not
        be read; the first read's then), at whose revisions its failures count as attempts.
        `on_applied`: called when the revisions applied change (the heartbeat tells
        them, `LoadedModels.applied_revisions`)."""
        self._client = client
        self._key = repository_key(registry_prefix)
        self._repository_dir = repository_dir
        self._pool = pool
        self._models = models
        self._swapper = swapper
        self._versions: dict[VersionKey, ModelVersion] | None = None
        #: The desired revisions when the repository was last read whole (None: never).
        self._revisions: dict[str, int] | None = None
        self._is_first = True
        self._start_state = start_state
        self._on_applied = on_applied
        #: Versions that failed to load -> their model's revision then (retried once it grows).
        self._failed: dict[VersionKey, int] = {}
        #: What was last logged of each unreadable model, so a lasting fault is logged once.
        self._unreadable: dict[str, str] = {}

    async def run(self) -> None:
        """Follows until cancelled; logs what goes wrong (once while it lasts) and goes on."""
        last_failure: str | None = None
        while True:
            try:
                await self.follow_once()
                last_failure = None
            except (RedisError, OSError) as error:
                stop_if_cancelled()
                if last_failure is None:
                    log.warning("desired model state unreadable (%s); serving as is", error)
                last_failure = "unreachable"
            except Exception as error:  # a bug, or data nobody foresaw: log it, keep following
                if repr(error) != last_failure:
                    log.exception("following the desired model state failed; retrying")
                last_failure = repr(error)
            await sleep_unless_stopped(FOLLOW_PERIOD_S)

    async def follow_once(self) -> None:
        """One read of the desired state and the actions it calls for."""
        desired = parse_desired(await self._client.hgetall(self._key))
        stop_if_cancelled()  # the read may have swallowed a stop: no load or unload after it
        revisions = {name: entry.revision for name, entry in desired.items()}
        if self._is_first:
            # Failures of the start-up load count as attempts at the revisions it saw: a load
            # written since (while the worker loaded) retries them.
            at_start = desired if self._start_state is None else self._start_state
            for failure in self._models.failed:
                self._failed[(failure.model, failure.version)] = revision_of(
                    failure.model, at_start
                )
            self._models.failed = tuple(  # reported at the revision each counts as tried at
                replace(f, revision=self._failed[(f.model, f.version)]) for f in self._models.failed
            )
            self._is_first = False
        has_read = True  # the repository as it is at these revisions
        if self._versions is None or revisions != self._revisions:
            # Read again until a read finds every model readable: a model being staged when a
            # load was written is picked up once its files are complete.
            versions, is_whole = await self._read_repository()
            has_read = versions is not None
            if versions is not None:
                self._versions = versions
                if is_whole:
                    self._revisions = revisions
        if self._versions is None:
            return  # never read the repository: acting now would unload everything
        versions = self._versions
        self._models.forget_failures(
            lambda f: (f.model, f.version) in versions and is_wanted(f.model, desired, self._pool)
        )
        actions = plan(
            desired=desired,
            loaded=[(m.config.name, m.version.version) for m in self._models.all],
            failed=self._failed,
            pool=self._pool,
            repository=self._versions,
        )
        for action in actions:
            stop_if_cancelled()
            await self._apply(action, desired, self._versions)
        # Applied: a load of a model unloaded before waits for its revision here, not for a
        # version still advertised while its unload drains. A model that did not read keeps
        # what it applied last; the others' go on (one model half copied froze them all, and
        # their reloads waited out their timeouts: diff review).
        before, unread = self._models.applied_revisions, self._unreadable
        applied = {m: r for m, r in revisions.items() if m not in unread}
        applied.update((m, r) for m, r in before.items() if m in unread)
        if has_read and applied != before:  # an unreadable repository: as last read, no more
            self._models.applied_revisions = applied
            self._on_applied()

    async def _apply(
        self,
        action: Action,
        desired: Mapping[str, DesiredState],
        versions: Mapping[VersionKey, ModelVersion],
    ) -> None:
        if isinstance(action, Retire):
            loaded = [(m.config.name, m.version.version) for m in self._models.all]
            if keeps_serving(
                action, desired=desired, loaded=loaded, failed=self._failed, repository=versions
            ):
                return  # its replacement failed to load: it serves on (logged at the failure)
        if isinstance(action, Unload | Retire):
            await self._swapper.unload(action.model, action.version)
            return
        key, revision = (action.model, action.version), revision_of(action.model, desired)
        if await self._swapper.load(versions[key], revision=revision):
            self._failed.pop(key, None)
        else:
            self._failed[key] = revision

    async def _read_repository(self) -> tuple[dict[VersionKey, ModelVersion] | None, bool]:
        """The repository's versions in this worker's pool (None, logged, if the repository is
        unreadable), and whether every model read. A model that does not read keeps what was
        last read of it: a half-written config must not unload the versions it serves."""
        errors: dict[str, ModelConfigError] = {}
        try:
            versions = await in_daemon_thread(
                lambda: load_repository(self._repository_dir, on_error=errors.__setitem__)
            )
        except (ModelConfigError, OSError) as error:
            log.error("model repository unreadable; keeping the last read: %s", error)
            return None, False
        read = {
            (v.config.name, v.version): v
            for v in versions
            if not self._pool or v.config.name in self._pool
        }
        errors = {m: e for m, e in errors.items() if not self._pool or m in self._pool}
        # What was last read of a model: the previous read, or, before the first, what the
        # worker loaded at start (a model that does not read then must not be unloaded).
        loaded = {(m.config.name, m.version.version): m.version for m in self._models.all}
        for (model, version), last in {**loaded, **(self._versions or {})}.items():
            if model in errors:
                read[(model, version)] = last
        unreadable = {model: str(fault) for model, fault in errors.items()}
        for model, fault in unreadable.items():
            if self._unreadable.get(model) != fault:
                log.error("model %s unreadable; keeping its last read: %s", model, fault)
        self._unreadable = unreadable
        return read, not errors
