"""The gateway's keys file read again while serving (services.gateway.auth.KeyStore): an edit
of any wrong shape keeps the keys in force, and the watch goes on."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from services.common.errors import Unauthenticated
from services.gateway import auth
from services.gateway.auth import KeyStore, Principal, hash_key
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit


def keys_file(path: Path, tenant_settings: str, key: str = "search-key") -> Path:
    path.write_text(
        f"[tenants.search]\n{tenant_settings}\n"
        f'[[keys]]\ntenant = "search"\nsha256 = "{hash_key(key)}"\n'
    )
    return path


@pytest.mark.parametrize(
    "settings",
    ["priorities = true", "priorities = 5", "priorities = [1]", "max_concurrency = true"],
)
def test_a_setting_of_the_wrong_shape_is_refused_naming_the_file(
    tmp_path: Path, settings: str
) -> None:
    # `priorities = true` raised TypeError, past every handler: a traceback at start.
    with pytest.raises(ValueError, match=r"api-keys\.toml|max_concurrency"):
        KeyStore.from_file(keys_file(tmp_path / "api-keys.toml", settings))


async def test_a_bad_edit_keeps_the_keys_and_the_watch_reads_the_next_good_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="services.gateway.auth")
    path = keys_file(tmp_path / "api-keys.toml", "max_concurrency = 4")
    store = KeyStore.from_file(path)
    reloads: list[int] = []
    watch = asyncio.create_task(store.watch(0.01, on_reload=lambda _: reloads.append(1)))
    try:
        keys_file(path, "priorities = true", key="new-key")
        os.utime(path, ns=(1, 1))  # a stamp of its own, however fast the edits come
        await eventually(lambda: "not reloaded" in caplog.text, message="bad edit not read")
        assert not watch.done(), "the watch ended on the bad edit"
        assert store.authenticate("search-key").tenant == "search"
        keys_file(path, "max_concurrency = 2", key="new-key")
        os.utime(path, ns=(2, 2))
        await eventually(lambda: bool(reloads), message="the good edit was not read")
    finally:
        watch.cancel()
    assert store.authenticate("new-key").policy.max_concurrency == 2
    with pytest.raises(Unauthenticated):
        store.authenticate("search-key")


def limited_keys(path: Path, *, cut: bool = False) -> None:
    """Key `new-key` of tenant "search", limited to minilm; `cut`: the file as a writer in
    place leaves it half-way, the key's `models` not written yet (it parses: every model)."""
    text = f'[[keys]]\ntenant = "search"\nsha256 = "{hash_key("new-key")}"\nmodels = ["minilm"]\n'
    path.write_text(text.split("models")[0] if cut else text)


def test_a_version_is_read_only_once_it_held_still_from_one_check_to_the_next(
    tmp_path: Path,
) -> None:
    """A file caught half-written, a key's `models` cut off, parses and would give that key
    every model until the next check: it is never read, as it changed again by then."""
    path = keys_file(tmp_path / "api-keys.toml", "max_concurrency = 4")
    store = KeyStore.from_file(path)
    limited_keys(path, cut=True)
    os.utime(path, ns=(1, 1))
    assert not store.reload_if_changed()  # seen, not read
    limited_keys(path)  # the writer finishes
    os.utime(path, ns=(2, 2))
    assert not store.reload_if_changed()
    with pytest.raises(Unauthenticated):
        store.authenticate("new-key")  # the cut version was never in force
    assert store.reload_if_changed()  # held still: read
    assert store.authenticate("new-key").models == frozenset({"minilm"})
    assert not store.is_refused


def test_a_refused_or_missing_file_is_said_until_a_good_version_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A key revoked in an edit refused for another mistake stays valid: the gateway says so
    (`is_refused`, its gauge and alert), and logs it once, not at every check."""
    caplog.set_level(logging.ERROR, logger="services.gateway.auth")
    path = keys_file(tmp_path / "api-keys.toml", "max_concurrency = 4")
    store = KeyStore.from_file(path)
    keys_file(path, "priorities = true", key="new-key")
    os.utime(path, ns=(1, 1))
    for _ in range(5):
        assert not store.reload_if_changed()
    assert store.is_refused
    assert caplog.text.count("not reloaded") == 1
    assert store.authenticate("search-key").tenant == "search"
    path.unlink()
    assert not store.reload_if_changed() and store.is_refused
    limited_keys(path)
    assert not store.reload_if_changed() and store.is_refused  # settling: still the old keys
    assert store.reload_if_changed()
    assert not store.is_refused


def test_a_version_written_again_while_it_was_read_is_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer starts again between the check and the read: what was read may be half of
    the next version, so it is not taken; the next version is read once it holds still."""
    path = keys_file(tmp_path / "api-keys.toml", "max_concurrency = 4")
    store = KeyStore.from_file(path)
    limited_keys(path, cut=True)
    os.utime(path, ns=(1, 1))
    assert not store.reload_if_changed()  # seen
    read_keys = auth._read_keys

    def read_then_rewritten(file: Path) -> dict[str, Principal]:
        entries = read_keys(file)
        limited_keys(file)  # the writer, again, as the read ends
        os.utime(file, ns=(2, 2))
        return entries

    monkeypatch.setattr(auth, "_read_keys", read_then_rewritten)
    assert not store.reload_if_changed()  # read, but it changed meanwhile: not taken
    monkeypatch.setattr(auth, "_read_keys", read_keys)
    with pytest.raises(Unauthenticated):
        store.authenticate("new-key")
    assert not store.reload_if_changed()  # the new version seen
    assert store.reload_if_changed()
    assert store.authenticate("new-key").models == frozenset({"minilm"})


def test_a_version_that_could_not_be_read_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error reading the file (its mode, the process out of files) is not the version's:
    once mended, the same version is read (mended by chmod, its stamp is unchanged)."""
    path = keys_file(tmp_path / "api-keys.toml", "max_concurrency = 4")
    store = KeyStore.from_file(path)
    limited_keys(path)
    os.utime(path, ns=(1, 1))
    read_keys = auth._read_keys

    def unreadable(file: Path) -> dict[str, Principal]:
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(auth, "_read_keys", unreadable)
    assert not store.reload_if_changed()
    assert not store.reload_if_changed()
    assert store.is_refused
    monkeypatch.setattr(auth, "_read_keys", read_keys)  # mended
    assert not store.reload_if_changed()
    assert store.reload_if_changed()
    assert store.authenticate("new-key").models == frozenset({"minilm"})
    assert not store.is_refused


def key_with_models(path: Path, models: str) -> Path:
    path.write_text(f'[[keys]]\ntenant = "search"\nsha256 = "{hash_key("k")}"\nmodels = {models}\n')
    return path


@pytest.mark.parametrize("models", ['"minilm"', "[1]", '["minilm", 2]', "{ minilm = 1 }"])
def test_a_keys_models_not_a_list_of_names_are_refused(tmp_path: Path, models: str) -> None:
    with pytest.raises(ValueError, match="models of tenant 'search' must be a list of names"):
        KeyStore.from_file(key_with_models(tmp_path / "api-keys.toml", models))


def test_a_key_whose_models_are_an_empty_list_may_call_none(tmp_path: Path) -> None:
    store = KeyStore.from_file(key_with_models(tmp_path / "api-keys.toml", "[]"))
    assert store.authenticate("k").models == frozenset()
    listed = KeyStore.from_file(key_with_models(tmp_path / "listed.toml", '["minilm"]'))
    assert listed.authenticate("k").models == frozenset({"minilm"})
