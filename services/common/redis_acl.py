"""Who may do what in the registry Redis: one ACL user per role, and how a tier authenticates.

Roles and their rights (Redis >= 6.2 ACL syntax; the keys are the registry's,
services.common.registry_schema):
- `worker`: publishes its heartbeat (EVALSHA of the publish script, which runs TIME, ZADD and
  SET) and deregisters (ZREM, DEL), on the registry keys, and reads the desired model state
  (HGETALL of `<prefix>:repository`, services.common.repository_state; Redis 6 ACLs cannot
  make that key read-only).
- `router`: reads the registry (ZRANGE, MGET, TIME, and GET of its epoch) and writes nothing.
- `gateway`: shares tenants' quota demand (HSET, HGETALL, HDEL) on the quota keys and reads
  the runtime model routing (HGETALL of `<prefix>:rollout`; Redis 6 ACLs cannot make one key
  read-only, so it could also write it) (services.gateway.quota_sync, routing_sync), and writes
  the desired model state (EVALSHA of repository_state's WRITE_STATE, which runs HGETALL and
  HSET on `<prefix>:repository`; EVALSHA and SCRIPT LOAD come with the job commands); it
  cannot read or touch the registry.
- `jobs`: durable batch jobs (services.common.job_store): streams, hashes, lists and the
  job scripts, on the job keys only; the gateway has the same rights there (it submits).
- `admin`: everything, for operators and tests.
- `default` (unauthenticated connections): disabled, so a client without a password gets
  NOAUTH and nothing else.

ACL rules can only name key patterns, not "this worker's own key": any `worker` may overwrite or
delete another worker's record. The router's address allowlist (services.router.worker_networks)
bounds what a forged record can attract.

Passwords reach the server hashed (`#<sha256>`), so the ACL file holds no secret. A tier reads
its password from a file (`--redis-password-file`), never from its argv, and re-reads it on
every new connection, so a rotated Secret takes effect without a restart.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from redis.credentials import CredentialProvider

from services.common.settings import StartupError, unusable_file

ADMIN, ROUTER, WORKER, GATEWAY = "admin", "router", "worker", "gateway"
#: The job runners (services.jobs): the job keys only (services.common.job_store).
JOBS = "jobs"
ROLES = (ADMIN, ROUTER, WORKER, GATEWAY, JOBS)
#: What the job keys need: the gateway submits, reads and cancels jobs, the runners claim,
#: record and acknowledge (scripts run under the caller's rights, hence their commands too).
JOB_COMMANDS = (
    "evalsha", "eval", "script|load", "get", "set", "persist", "expire", "del", "rpush",
    "lrange", "hset", "hsetnx", "hincrby", "hgetall", "hmget", "zadd", "zrevrange", "zrange",
    "zrem", "zscore", "exists", "info", "incrby", "decrby",
    "xadd",
    "xreadgroup", "xautoclaim", "xclaim", "xpending", "xack", "xdel", "xgroup|create",
    "xinfo|groups",
    "xinfo|consumers", "xgroup|delconsumer",
    "xrange",
    "xlen",
    "multi", "exec",
    "time",
)  # fmt: skip
#: Commands each role needs beyond `ping`, and nothing else. The worker's publish script runs
#: inside EVALSHA under the worker's own rights, hence TIME, ZADD and SET.
ROLE_COMMANDS: Mapping[str, tuple[str, ...]] = {
    ROUTER: ("zrange", "mget", "time", "get"),
    WORKER: (
        "evalsha",
        "script|load",
        "time",
        "zadd",
        "zremrangebyscore",
        "set",
        "zrem",
        "del",
        "hgetall",
    ),
    GATEWAY: ("hset", "hgetall", "hdel", *JOB_COMMANDS),
    JOBS: JOB_COMMANDS,
}
#: File names `write_acl_files` uses: the ACL for redis-server, one password file per role.
ACL_FILE_NAME = "users.acl"


def password_file_name(role: str) -> str:
    return f"{role}-password"


def password_hash(password: str) -> str:
    """The `#<hex>` form Redis keeps a password in."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def acl_lines(passwords: Mapping[str, str], *, registry_prefix: str = "fabric") -> list[str]:
    """The ACL file's lines for `passwords` (role -> password, every role of ROLES).

    Raises ValueError for a missing role, an empty password, or a prefix that is not a plain
    word (it becomes part of a key pattern).
    """
    missing = [role for role in ROLES if not passwords.get(role)]
    if missing:
        raise ValueError(f"no password for Redis role(s) {', '.join(missing)}")
    if not registry_prefix or not all(c.isalnum() or c in "-_." for c in registry_prefix):
        raise ValueError(f"registry prefix {registry_prefix!r}: letters, digits, - _ . only")
    registry_keys = (
        f"~{registry_prefix}:workers ~{registry_prefix}:worker:* ~{registry_prefix}:epoch"
    )
    job_keys = f"~{registry_prefix}:job:* ~{registry_prefix}:jobs:*"
    repository_keys = f"~{registry_prefix}:repository"  # desired model state (repository_state)
    role_keys = {
        ROUTER: registry_keys,
        WORKER: f"{registry_keys} {repository_keys}",
        GATEWAY: (
            f"~{registry_prefix}:quota:* ~{registry_prefix}:rollout {repository_keys} {job_keys}"
        ),
        JOBS: job_keys,
    }
    lines = [
        "user default off resetpass resetkeys resetchannels -@all",
        f"user {ADMIN} on {password_hash(passwords[ADMIN])} ~* &* +@all",
    ]
    for role, commands in ROLE_COMMANDS.items():
        allowed = " ".join(f"+{command}" for command in dict.fromkeys(("ping", *commands)))
        lines.append(
            f"user {role} on {password_hash(passwords[role])} resetkeys {role_keys[role]} "
            f"resetchannels -@all {allowed}"
        )
    return lines


def new_passwords() -> dict[str, str]:
    """A random password per role (256 bits each, hex: safe in URLs and files)."""
    return {role: secrets.token_hex(32) for role in ROLES}


def write_acl_files(
    directory: Path, passwords: Mapping[str, str], *, registry_prefix: str = "fabric"
) -> Path:
    """Writes the ACL file and one `<role>-password` file per role into `directory`, readable by
    the owner only; returns the ACL file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    contents = {password_file_name(role): passwords[role] for role in ROLES}
    contents[ACL_FILE_NAME] = "\n".join(acl_lines(passwords, registry_prefix=registry_prefix))
    for name, text in contents.items():
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        # The mode applies only to a file created: one already there (0644) keeps its own,
        # and the new password must not be written into a file others can read.
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(text + "\n")
    return directory / ACL_FILE_NAME


def read_password(path: Path) -> str:
    """The password in `path`, without surrounding whitespace. Raises ValueError when empty."""
    password = path.read_text().strip()
    if not password:
        raise ValueError(f"{path}: empty Redis password file")
    return password


@dataclass
class FileCredentials(CredentialProvider):
    """AUTH as `username` with the password in `password_file`, read again on every new
    connection (a rotated Secret needs no restart)."""

    username: str
    password_file: Path

    def get_credentials(self) -> tuple[str, str]:
        return self.username, read_password(self.password_file)

    async def get_credentials_async(self) -> tuple[str, str]:
        return self.get_credentials()


def role_credentials(role: str, url: str, password_file: Path | None) -> FileCredentials | None:
    """How a tier of `role` authenticates to `url`: None when the URL carries the credentials
    (or there are none); otherwise as the URL's user, or else `role`, with the password in
    `password_file`. Reads the file once now, so that a missing or empty one fails at start-up
    (StartupError); so does a URL with a password too (two sources, one would be ignored)."""
    if password_file is None:
        return None
    parts = urlsplit(url)
    if parts.password:
        raise StartupError("give the Redis password in the URL or in a password file, not both")
    try:
        read_password(password_file)
    except (OSError, ValueError) as error:
        raise unusable_file("the Redis password file", password_file, error) from error
    return FileCredentials(unquote(parts.username or "") or role, password_file)


def redacted_url(url: str) -> str:
    """`url` fit for a log line: a password in it becomes `***`."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return parts._replace(netloc=user + parts.netloc.rpartition("@")[2]).geturl()


def main(argv: list[str] | None = None) -> None:
    """`python -m services.common.redis_acl OUT_DIR`: new random passwords and their ACL file,
    e.g. for `kubectl create secret generic fabric-redis-acl --from-file=OUT_DIR`."""
    parser = argparse.ArgumentParser(
        prog="python -m services.common.redis_acl", description=main.__doc__
    )
    parser.add_argument("out_dir", type=Path, help="directory for users.acl and <role>-password")
    parser.add_argument("--registry-prefix", default="fabric", help="the fabric's registry prefix")
    args = parser.parse_args(argv)
    acl = write_acl_files(args.out_dir, new_passwords(), registry_prefix=args.registry_prefix)
    print(f"wrote {acl} and {', '.join(password_file_name(role) for role in ROLES)}")


if __name__ == "__main__":
    main()
