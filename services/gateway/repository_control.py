"""Triton's model repository extension, fleet-wide: RepositoryIndex, RepositoryModelLoad and
RepositoryModelUnload, for admin keys only.

Load and unload write the model's desired state into `<prefix>:repository`
(services.common.repository_state) at a revision past the hash's highest, in one step
(WRITE_STATE: each write its own revision, however many gateways write at once). Every worker
reads that hash about once a second and converges (services.gpu_worker.repository_follower), so
a change is served (or no longer served) within about 1-2 s plus one load or drain; the
gateway's catalog, refreshed from the router, follows on its next refresh. A load then waits,
as Triton's does, until the fleet serves the model's versions, or answers FAILED_PRECONDITION
with the workers' load errors (a corrupt version), while the versions already served keep
serving; an unload answers once written. Of two writes at once, the one written last wins;
a load waits for the state it wrote, after the one it replaced.

Versions added to the volume after start: the gateway handling a load re-reads its repository
before writing; every gateway does when it sees a new revision (within FOLLOW_PERIOD_S). The
index lists every version of every model in this gateway's repository: READY while at
least one live worker serves it, UNAVAILABLE otherwise, with the desired state and any
worker's load error as the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence, Set
from pathlib import Path
from typing import NamedTuple

from redis.exceptions import RedisError

from services.common.errors import InvalidInput, ModelLoadFailed, Unavailable
from services.common.lifecycle import cancel_and_wait, sleep_unless_stopped
from services.common.model_repository import ModelConfigError, load_repository
from services.common.redis_acl import GATEWAY, role_credentials
from services.common.registry_schema import connect
from services.common.repository_state import (
    WRITE_STATE,
    DesiredState,
    ModelState,
    parse_desired,
    repository_key,
)
from services.gateway.catalog import ModelCatalog, new_encoder
from services.gateway.config import GatewayConfig
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)

READY, UNAVAILABLE = "READY", "UNAVAILABLE"
#: Seconds between reads of the desired state (for versions new to the volume).
FOLLOW_PERIOD_S = 1.0
#: Seconds between looks at the fleet view while a load waits for its outcome.
LOAD_POLL_S = 0.2


def start_repository_control(
    catalog: ModelCatalog, config: GatewayConfig
) -> RepositoryControl | None:
    """The gateway's repository control, following the desired state; None without Redis
    (the repository RPCs then answer UNAVAILABLE)."""
    redis = config.quota_sync
    if not redis.redis_url:
        return None
    control = RepositoryControl(
        catalog,
        model_repository=config.model_repository,
        redis_url=redis.redis_url,
        password_file=redis.redis_password_file,
        key_prefix=redis.key_prefix,
    )
    control.start()
    return control


class RepositoryRead(NamedTuple):
    """What one read of the repository changed: the versions added (`name/version`), and
    the models that did not read, with why; and every version it found (those of a model
    that did not read: what was known of it)."""

    added: list[str]
    failed: dict[str, str]
    on_disk: frozenset[tuple[str, str]]


class RepositoryControl:
    """Reads and writes the fleet's desired model state; answers the repository RPCs."""

    def __init__(
        self,
        catalog: ModelCatalog,
        *,
        model_repository: Path,
        redis_url: str,
        password_file: Path | None,
        key_prefix: str,
    ) -> None:
        self._catalog = catalog
        self._model_repository = model_repository
        self._key = repository_key(key_prefix)
        credentials = role_credentials(GATEWAY, redis_url, password_file)
        self._client = connect(redis_url, credentials=credentials)
        self._write = self._client.register_script(WRITE_STATE)
        self._revisions: dict[str, int] | None = None
        #: Whether the last read read every model: until one does, each period reads again
        #: (a model whose files were still being copied, here at start-up or since).
        self._is_whole = False
        self._reading = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Follows the desired state: versions added to the volume become known to this
        gateway's catalog when a load (a new revision) is written, by any gateway."""
        self._task = asyncio.create_task(self._follow(), name="repository-follow")

    async def close(self) -> None:
        await cancel_and_wait(self._task, "the repository follow")
        await self._client.aclose()

    async def _follow(self) -> None:
        """Re-reads the repository when a revision changes, and again every period until a
        read reads every model (a version still being copied reads on a later try); logs what
        fails, once while it lasts, and never stops following."""
        last_failure = ""
        while True:
            try:
                desired = await self.desired()
                self._catalog.unloaded = unloaded_models(desired)
                revisions = {n: d.revision for n, d in desired.items()}
                failed: dict[str, str] = {}
                if revisions != self._revisions or not self._is_whole:
                    failed = (await self.read_repository()).failed
                    if failed and repr(failed) != last_failure:
                        log.error("models not read, retried: %s", "; ".join(failed.values()))
                last_failure = repr(failed) if failed else ""
                self._revisions = revisions
            except Unavailable as error:
                if str(error) != last_failure:
                    log.warning("desired model state unreadable: %s", error)
                last_failure = str(error)
            except Exception as error:  # a bad model directory, or a bug: retried
                if repr(error) != last_failure:
                    log.error("model repository not re-read: %s", error, exc_info=True)
                last_failure = repr(error)
            await sleep_unless_stopped(FOLLOW_PERIOD_S)

    async def read_repository(self) -> RepositoryRead:
        """Adds the repository's versions this gateway does not know yet to its catalog
        (tokenizers read off the event loop), and forgets those gone from it that nothing
        needs any more (ModelCatalog.forget_versions). A model that does not read (a config
        or tokenizer still being copied) fails alone: what this gateway knows of it stays.
        One read at a time (the follow's and a load's): a read whose listing is older than
        another's must not forget what that one added."""
        async with self._reading:
            failed: dict[str, str] = {}

            def on_error(name: str, error: ModelConfigError) -> None:
                failed[name] = str(error)

            versions = await asyncio.to_thread(
                load_repository, self._model_repository, on_error=on_error
            )
            on_disk = {(v.config.name, v.version) for v in versions}
            on_disk.update(
                (name, version)
                for name in failed
                for version in self._catalog.repository_versions(name)
            )
            forgotten = self._catalog.forget_versions(on_disk)
            if forgotten:
                log.info("model repository re-read: %s forgotten", ", ".join(forgotten))
            added = []
            for version in versions:
                name = version.config.name
                if name in failed or self._catalog.has_version(name, version.version):
                    continue
                try:
                    encoder = await asyncio.to_thread(new_encoder, version)
                except Exception as error:  # a tokenizer still being copied, or not one at all
                    failed[name] = f"{name}/{version.version}: {error}"
                    continue
                self._catalog.add_version(version, encoder)
                added.append(f"{name}/{version.version}")
            if added:
                log.info("model repository re-read: %s added", ", ".join(added))
            # A version gone from the disk that a worker still serves (a swap's, until its
            # successor serves) is kept; read again until it is forgotten (it would be listed,
            # its tokenizer held, until a later load).
            self._is_whole = not failed and not self._catalog.serves_gone(on_disk)
            return RepositoryRead(added, failed, frozenset(on_disk))

    def unloaded(self) -> frozenset[str]:
        """The models unloaded on purpose (RepositoryModelUnload), by the desired state last
        read (about once a second) or written by this gateway."""
        return self._catalog.unloaded

    async def desired(self) -> dict[str, DesiredState]:
        """Every model's desired state; UNAVAILABLE while Redis cannot be read."""
        try:
            return parse_desired(await self._client.hgetall(self._key))
        except (RedisError, OSError) as error:
            raise Unavailable(f"the model repository state is unreachable: {error}") from error

    async def set_state(self, model_name: str, state: ModelState) -> DesiredState:
        """Writes `state` for a model of the repository (NOT_FOUND for another name). A load
        first re-reads the repository, so this gateway knows new versions before any worker
        serves them."""
        if state is ModelState.LOADED:
            await self._reread(model_name)
        return (await self._write_state(model_name, state))[0]

    async def _reread(self, model_name: str) -> RepositoryRead:
        """`read_repository`; INVALID_ARGUMENT when the repository, or `model_name` in it,
        does not read (another model that does not read fails only its own loads)."""
        try:
            read = await self.read_repository()
        except (ModelConfigError, OSError) as error:
            raise InvalidInput(f"the model repository does not load: {error}") from error
        if model_name in read.failed:
            raise InvalidInput(f"model {model_name!r} does not load: {read.failed[model_name]}")
        return read

    async def _write_state(
        self, model_name: str, state: ModelState
    ) -> tuple[DesiredState, DesiredState | None]:
        """The model's desired state written, and the one it replaced (None: none), in one
        step (repository_state.WRITE_STATE)."""
        name = self._catalog.config(model_name).name
        args = [name, state.value, int(time.time() * 1000)]
        try:
            written, before = await self._write(keys=[self._key], args=args)
        except (RedisError, OSError) as error:
            raise Unavailable(f"the model repository state is unreachable: {error}") from error
        entry = parse_desired({name: written})[name]
        unloaded = self._catalog.unloaded
        is_unloaded = state is ModelState.UNLOADED
        self._catalog.unloaded = unloaded | {name} if is_unloaded else unloaded - {name}
        return entry, parse_desired({name: before}).get(name) if before else None

    async def load(self, model_name: str, *, timeout_s: float) -> None:
        """Writes the model's LOADED state and waits, as Triton's load does, until live
        workers serve every version of it on disk. Raises ModelLoadFailed as soon as a worker
        reports a version it failed to load at this load's revision or a later one
        (`load_failures_to_answer`), and Unavailable when nothing is decided within
        `timeout_s` (no live worker has the model in its pool, or loading takes longer: the
        fleet keeps converging)."""
        read = await self._reread(model_name)  # first: a model whose files came back is found
        name = self._catalog.config(model_name).name
        # The versions on disk: one deleted that a worker still serves is kept in the catalog
        # until its successor serves (a swap), and waited for, it never would be (review
        # finding: the load answered UNAVAILABLE after its whole timeout).
        wanted = {version for model, version in read.on_disk if model == name}
        written, before = await self._write_state(name, ModelState.LOADED)
        # Unloaded before: a worker still draining that unload advertises the version until
        # it is gone, and then loads it again. Counted served, it answered the load at once,
        # and calls failed meanwhile (KServe review). Only versions served by a worker that
        # applied this load count (or by workers that tell no revision: a build before).
        revision = written.revision if before and before.state is ModelState.UNLOADED else 0
        deadline_s = time.monotonic() + timeout_s
        while True:
            self._catalog.config(name)  # NOT_FOUND once a re-read forgot it (files removed)
            served = {
                v.model_version for v in self._catalog.fleet_versions(name)
                if not v.HasField("revision") or v.revision >= revision
            }  # fmt: skip
            if wanted <= served:
                return
            is_past = time.monotonic() >= deadline_s
            failures = load_failures_to_answer(
                self._failures(name), served, revision=written.revision, is_past=is_past
            )
            if failures:
                raise ModelLoadFailed(
                    f"{name}: "
                    + "; ".join(
                        f"version {f.model_version} failed to load on {f.worker_id}: {f.error}"
                        for f in failures
                    )
                )
            if is_past:
                missing = ", ".join(sorted(wanted - served, key=int))
                raise Unavailable(
                    f"{name}: version(s) {missing} not served by any live worker within "
                    f"{timeout_s:.0f} s; workers whose pool has the model keep converging"
                )
            await asyncio.sleep(LOAD_POLL_S)

    def _failures(self, name: str) -> list[pb.LoadFailure]:
        return [
            f
            for version in self._catalog.repository_versions(name)
            for f in self._catalog.load_failures(name, version)
        ]

    async def index(self, *, is_ready_only: bool) -> kserve.RepositoryIndexResponse:
        """Every version in the repository with its state in the fleet (READY versions only
        with `is_ready_only`)."""
        desired = await self.desired()
        models = []
        for name in self._catalog.model_names():
            served = {v.model_version for v in self._catalog.fleet_versions(name)}
            versions = sorted({*self._catalog.repository_versions(name), *served}, key=int)
            for version in versions:
                state = READY if version in served else UNAVAILABLE
                if is_ready_only and state != READY:
                    continue
                reason = _reason(desired.get(name))
                failures = self._catalog.load_failures(name, version)
                if failures:
                    reason += "; " + "; ".join(
                        f"failed to load on {f.worker_id}: {f.error}" for f in failures
                    )
                models.append(
                    kserve.RepositoryIndexResponse.ModelIndex(
                        name=name, version=version, state=state, reason=reason
                    )
                )
        return kserve.RepositoryIndexResponse(models=models)


def load_failures_to_answer(
    failures: Sequence[pb.LoadFailure], served: Set[str], *, revision: int, is_past: bool
) -> list[pb.LoadFailure]:
    """The failures a load written at `revision` answers, of its model's versions not served
    yet: those of an attempt at its revision or a later one, at once; before `is_past` (its
    timeout), none of an earlier attempt. A worker reports an earlier failure until it has
    tried again, up to a heartbeat and a listing later (files read half written, then moved
    in whole: the retry serves), and one from before this field reports revision 0. Past the
    timeout, every failure: a worker retrying the same files fails the same way."""
    unserved = [f for f in failures if f.model_version not in served]
    return unserved if is_past else [f for f in unserved if f.revision >= revision]


def unloaded_models(desired: Mapping[str, DesiredState]) -> frozenset[str]:
    """The models whose desired state is unloaded."""
    return frozenset(n for n, d in desired.items() if d.state is ModelState.UNLOADED)


def _reason(entry: DesiredState | None) -> str:
    """The desired state, as the index reports it."""
    if entry is None:
        return "desired: loaded (repository default)"
    return f"desired: {entry.state.value} (revision {entry.revision})"
