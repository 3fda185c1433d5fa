"""The registry Redis's ACL as generated text, and how a tier picks its credentials."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.common.redis_acl import (
    ACL_FILE_NAME,
    JOB_COMMANDS,
    ROLES,
    FileCredentials,
    acl_lines,
    password_hash,
    redacted_url,
    role_credentials,
    write_acl_files,
)
from services.common.settings import StartupError

pytestmark = pytest.mark.unit

PASSWORDS = {
    "admin": "a" * 8, "router": "r" * 8, "worker": "w" * 8, "gateway": "g" * 8, "jobs": "j" * 8,
}  # fmt: skip


def user_rules(lines: list[str]) -> dict[str, list[str]]:
    rules = {}
    for line in lines:
        keyword, name, *rest = line.split()
        assert keyword == "user"
        rules[name] = rest
    return rules


def test_default_user_is_off_and_can_do_nothing() -> None:
    default = user_rules(acl_lines(PASSWORDS))["default"]
    assert "off" in default and "on" not in default
    assert "-@all" in default and not [r for r in default if r.startswith(("+", "~", "&"))]
    assert "nopass" not in default


def test_each_role_gets_only_its_commands_on_the_registry_keys() -> None:
    rules = user_rules(acl_lines(PASSWORDS, registry_prefix="blue"))
    router, worker = rules["router"], rules["worker"]
    # The router reads the registry's epoch too (GET): it tells a Redis that lost the registry.
    assert {r for r in router if r.startswith("+")} == {
        "+ping",
        "+zrange",
        "+mget",
        "+time",
        "+get",
    }
    assert {r for r in worker if r.startswith("+")} == {
        "+ping", "+evalsha", "+script|load", "+time", "+zadd", "+zremrangebyscore", "+set",
        "+zrem", "+del", "+hgetall",
    }  # fmt: skip
    registry_keys = {"~blue:workers", "~blue:worker:*", "~blue:epoch"}
    assert {r for r in router if r.startswith("~")} == registry_keys
    # Workers also read the fleet's desired model state (services.common.repository_state).
    assert {r for r in worker if r.startswith("~")} == {*registry_keys, "~blue:repository"}
    for role in (router, worker):
        assert "-@all" in role and role.index("-@all") < role.index("+ping")
        assert "resetchannels" in role and not [r for r in role if r.startswith("&")]
    assert {"~*", "+@all"} <= set(rules["admin"])
    # Gateways share quota demand (and submit jobs, below): no registry key, no other command.
    gateway, jobs = rules["gateway"], rules["jobs"]
    job_commands = {f"+{c}" for c in JOB_COMMANDS}
    job_keys = {"~blue:job:*", "~blue:jobs:*"}
    assert job_commands <= set(gateway) and job_keys <= set(gateway)
    own_commands = {r for r in gateway if r.startswith("+")} - job_commands
    assert own_commands == {"+ping", "+hset", "+hgetall", "+hdel"} - job_commands
    own_keys = {r for r in gateway if r.startswith("~")} - job_keys
    assert own_keys == {"~blue:quota:*", "~blue:rollout", "~blue:repository"}
    # Job runners: the job keys only.
    assert {r for r in jobs if r.startswith("+")} == {"+ping", *job_commands}
    assert {r for r in jobs if r.startswith("~")} == job_keys
    assert not {"+keys", "+flushall", "+config"} & set(jobs)


def test_passwords_appear_only_hashed() -> None:
    text = "\n".join(acl_lines(PASSWORDS))
    for role, password in PASSWORDS.items():
        assert password not in text
        assert password_hash(password) in user_rules(acl_lines(PASSWORDS))[role]
    # Redis's own form: '#' and the SHA-256 of the password in lower-case hex.
    assert password_hash("x") == "#2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"


@pytest.mark.parametrize(
    ("passwords", "prefix", "message"),
    [
        ({**PASSWORDS, "worker": ""}, "fabric", "worker"),
        ({"admin": "a", "router": "r"}, "fabric", "worker"),
        (PASSWORDS, "fab ric", "prefix"),
        (PASSWORDS, "f*", "prefix"),
        (PASSWORDS, "", "prefix"),
    ],
)
def test_refuses_missing_passwords_and_odd_prefixes(
    passwords: dict[str, str], prefix: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        acl_lines(passwords, registry_prefix=prefix)


def test_written_files_are_private_and_hold_what_they_say(tmp_path: Path) -> None:
    acl = write_acl_files(tmp_path / "acl", PASSWORDS)
    assert acl.name == ACL_FILE_NAME
    assert acl.read_text().splitlines() == acl_lines(PASSWORDS)
    for role in ROLES:
        path = tmp_path / "acl" / f"{role}-password"
        assert path.read_text().strip() == PASSWORDS[role]
    for path in (tmp_path / "acl").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_password_files_already_there_and_readable_become_private(tmp_path: Path) -> None:
    (tmp_path / "acl").mkdir()
    for role in ROLES:
        (tmp_path / "acl" / f"{role}-password").write_text("old")
        (tmp_path / "acl" / f"{role}-password").chmod(0o644)
    write_acl_files(tmp_path / "acl", PASSWORDS)
    for path in (tmp_path / "acl").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_role_credentials_from_a_file_reread_on_each_connection(tmp_path: Path) -> None:
    secret = tmp_path / "router-password"
    secret.write_text("first\n")
    credentials = role_credentials("router", "redis://127.0.0.1:6379/0", secret)
    assert credentials == FileCredentials("router", secret)
    assert credentials.get_credentials() == ("router", "first")
    secret.write_text("rotated")
    assert credentials.get_credentials() == ("router", "rotated")


def test_role_credentials_user_from_the_url_and_none_without_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("p")
    credentials = role_credentials("router", "redis://ops%40x@redis:6379/0", secret)
    assert credentials is not None and credentials.get_credentials() == ("ops@x", "p")
    assert role_credentials("router", "redis://router:p@redis:6379/0", None) is None


def test_redacted_url_hides_only_the_password() -> None:
    assert redacted_url("redis://router:s3cret@redis:6379/0") == "redis://router:***@redis:6379/0"
    assert redacted_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted_url("redis://router@redis:6379/0") == "redis://router@redis:6379/0"
    assert redacted_url("redis://redis:6379/0") == "redis://redis:6379/0"


def test_role_credentials_fail_at_start_up_on_a_bad_file_or_two_passwords(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="missing cannot be used: No such file"):
        role_credentials("worker", "redis://redis:6379/0", tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(StartupError, match="empty"):
        role_credentials("worker", "redis://redis:6379/0", tmp_path / "empty")
    (tmp_path / "password").write_text("p")
    with pytest.raises(StartupError, match="not both"):
        role_credentials("worker", "redis://worker:q@redis:6379/0", tmp_path / "password")
