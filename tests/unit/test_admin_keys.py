"""Admin API keys: who may change the fleet's model repository (services.gateway.auth)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.common.errors import PermissionDenied
from services.gateway.auth import LOCAL_PRINCIPAL, KeyStore, hash_key

pytestmark = pytest.mark.unit


def keys_file(tmp_path: Path, admin_line: str) -> Path:
    path = tmp_path / "api-keys.toml"
    path.write_text(
        f'[[keys]]\ntenant = "ops"\nsha256 = "{hash_key("ops-key")}"\n{admin_line}\n'
        f'[[keys]]\ntenant = "search"\nsha256 = "{hash_key("search-key")}"\n'
    )
    return path


def test_only_a_key_marked_admin_is_admin(tmp_path: Path) -> None:
    store = KeyStore.from_file(keys_file(tmp_path, "admin = true"))
    admin, user = store.authenticate("ops-key"), store.authenticate("search-key")
    admin.check_admin("RepositoryModelLoad")
    with pytest.raises(PermissionDenied, match="RepositoryModelUnload needs an admin API key"):
        user.check_admin("RepositoryModelUnload")
    assert (admin.is_admin, user.is_admin) == (True, False)


def test_admin_must_be_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="admin of tenant 'ops' must be true or false"):
        KeyStore.from_file(keys_file(tmp_path, 'admin = "yes"'))


def test_local_mode_without_keys_is_the_operator() -> None:
    LOCAL_PRINCIPAL.check_admin("RepositoryIndex")
    assert LOCAL_PRINCIPAL.is_admin


def test_a_tenant_table_no_key_belongs_to_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A misspelt `[tenants.NAME]` applies to no one and leaves the tenant it meant unlimited:
    loading says so (before, it was ignored silently)."""
    path = keys_file(tmp_path, "")
    path.write_text(path.read_text() + "\n[tenants.serach]\nrequests_per_s = 5\n")
    with caplog.at_level(logging.WARNING, logger="services.gateway.auth"):
        store = KeyStore.from_file(path)
    assert store.authenticate("search-key").policy.requests_per_s is None  # not limited
    (record,) = [r for r in caplog.records if "serach" in r.getMessage()]
    assert "no key's tenant" in record.getMessage() and "ops, search" in record.getMessage()


def test_a_digest_listed_twice_is_refused(tmp_path: Path) -> None:
    """A copy-paste giving ops's digest to a later tenant made ops's key act as that tenant
    (its models, quotas and jobs); the later entry won silently. Case does not make it
    another digest."""
    path = keys_file(tmp_path, "")
    again = hash_key("ops-key").upper()
    path.write_text(path.read_text() + f'[[keys]]\ntenant = "billing"\nsha256 = "{again}"\n')
    with pytest.raises(ValueError, match="given to tenant 'ops' and again to 'billing'"):
        KeyStore.from_file(path)


def test_a_digest_that_is_not_hex_is_refused(tmp_path: Path) -> None:
    path = keys_file(tmp_path, "")
    path.write_text(path.read_text() + f'[[keys]]\ntenant = "billing"\nsha256 = "{"x" * 64}"\n')
    with pytest.raises(ValueError, match="needs tenant and a sha256 hex digest"):
        KeyStore.from_file(path)
