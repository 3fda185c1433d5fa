"""API keys -> tenants. Keys are stored as SHA-256 hashes and compared in constant time; the
tenant never comes from a request body.

Keys file (TOML)::

    [[keys]]
    tenant = "search"
    sha256 = "<hex digest of the key>"    # python -m services.gateway.auth hash <key>
    models = ["minilm"]                   # optional: the models this key may use (default all)
    admin = true                          # optional: may load/unload models (default false)

and, optionally, `[tenants.NAME]` tables: each tenant's weight, quotas, models and priority
classes (services.gateway.tenants). The file is re-read when it changes (checked every
KEYS_POLL_PERIOD_S), once it has held still for one check (a version caught half-written may
parse, and give a key every model); a version that does not parse keeps the keys and tenants
in force, and says so (`KeyStore.is_refused`: a gauge and an alert) until a good one is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import hmac
import logging
import re
import sys
import tomllib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.caller_shares import caller_of, presented_key
from services.common.errors import PermissionDenied, Unauthenticated
from services.gateway.admission import INFERENCE_METHODS, TenantAdmission
from services.gateway.tenants import TenantPolicy, parse_tenants

log = logging.getLogger(__name__)

#: Tenant of local mode (no keys file, started with --allow-unauthenticated).
LOCAL_TENANT = "local"
#: How often the keys file is checked for changes, seconds.
KEYS_POLL_PERIOD_S = 1.0
#: Open on the HTTP port too (/v2/health/live, /v2/health/ready). Not health's Watch nor
#: reflection: their calls are long-lived streams, and a caller without a key could hold every
#: place of the server's --max-concurrent-rpcs with idle ones (probes call Check).
_OPEN_METHODS = (
    "/grpc.health.v1.Health/Check",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
)


@dataclass(frozen=True)
class Principal:
    tenant: str
    #: Models this caller may use (its key's and its tenant's lists together); None: every model.
    models: frozenset[str] | None
    #: The tenant's weight, quotas and priority classes.
    policy: TenantPolicy
    #: May load and unload models for the whole fleet (Triton's repository extension).
    is_admin: bool = False

    def check_model(self, model_name: str) -> None:
        if self.models is not None and model_name not in self.models:
            raise PermissionDenied(f"tenant {self.tenant!r} may not use model {model_name!r}")

    def check_admin(self, action: str) -> None:
        """Raises PermissionDenied unless this caller's key is an admin key."""
        if not self.is_admin:
            raise PermissionDenied(
                f"{action} needs an admin API key; tenant {self.tenant!r}'s is not"
            )


#: Local mode has one caller, the operator: it may use every model and change the repository.
LOCAL_PRINCIPAL = Principal(LOCAL_TENANT, None, TenantPolicy(LOCAL_TENANT), is_admin=True)
_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("principal")


def current_principal() -> Principal:
    """The caller of the RPC being handled (set by the Authentication stage)."""
    return _principal.get(LOCAL_PRINCIPAL)


def hash_key(key: str) -> str:
    """The digest a key is known by. A header's bytes that are not UTF-8 reach us as lone
    surrogates (aiohttp decodes with surrogateescape): they hash as those bytes."""
    try:
        data = key.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no decoding made: no key's, never an error
        data = key.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


class KeyStore:
    """The known keys: fixed, or read from a keys file and re-read when it changes
    (`reload_if_changed`, polled by `watch`)."""

    def __init__(self, entries: Mapping[str, Principal], path: Path | None = None) -> None:
        #: sha256 hex -> principal; replaced whole on reload, never mutated.
        self._entries = dict(entries)
        self._path = path
        self._stamp = _stamp(path) if path is not None else None
        #: The stamp a check saw that differs from the keys' in force: read at the next check
        #: that sees it again (None: none seen since the last read).
        self._settling: tuple[int, int, int] | None = None
        #: The stamp of the last version refused (not read again; None: none refused).
        self._refused: tuple[int, int, int] | None = None
        #: Whether the keys file now is missing or refused: the keys in force are older.
        self.is_refused = False
        #: Told each refusal's reason ("missing_key", "unknown_key"): the gateway counts them
        #: (a flood of made-up keys is seen, though refused before any call is counted).
        self.on_refused: Callable[[str], None] = lambda reason: None

    @classmethod
    def from_file(cls, path: Path) -> KeyStore:
        return cls(_read_keys(path), path)

    @property
    def tenants(self) -> dict[str, TenantPolicy]:
        """The policy of every tenant that has a key."""
        return {p.tenant: p.policy for p in self._entries.values()}

    def reload_if_changed(self) -> bool:
        """Re-reads the keys file once its mtime, size or inode changed and then held still
        from one check to the next (a file written in place may be caught half-written, and
        parse: a key cut off before its `models` would use every model); True when new keys
        took effect. A file that is missing or does not parse keeps the old keys, logged once
        and `is_refused` until a good version is read: a bad edit must not lock every tenant
        out, nor let anyone in, nor go unseen (a key revoked in it stays valid)."""
        if self._path is None:
            return False
        try:
            stamp = _stamp(self._path)
        except OSError as error:
            self._refuse(None, error)
            return False
        if stamp == self._stamp:
            self._settling, self.is_refused = None, False
            return False
        if stamp == self._refused:
            return False
        if stamp != self._settling:
            self._settling = stamp  # read at the next check, if it holds still until then
            return False
        try:
            entries = _read_keys(self._path)
            if _stamp(self._path) != stamp:  # written again while it was read: read it later
                self._settling = None
                return False
        except ValueError as error:
            self._refuse(stamp, error)
            return False
        except OSError as error:  # not the version's fault (its mode, the process's files):
            self._refuse(None, error)  # read again, however its stamp stays
            return False
        self._stamp, self._entries, self._settling = stamp, entries, None
        self._refused, self.is_refused = None, False
        log.info("API keys reloaded from %s: %d keys", self._path, len(entries))
        return True

    def _refuse(self, stamp: tuple[int, int, int] | None, error: Exception) -> None:
        """The keys file's version `stamp` does not parse, or (`stamp` None) the file cannot
        be read now (missing, its mode): a version refused is not read again, a file that
        could not be read is."""
        if not self.is_refused or stamp != self._refused:
            log.error("API keys file not reloaded, old keys stay in force: %s", error)
        self._refused, self._settling, self.is_refused = stamp, None, True

    async def watch(
        self,
        period_s: float = KEYS_POLL_PERIOD_S,
        on_reload: Callable[[KeyStore], None] | None = None,
    ) -> None:
        """Polls the keys file every `period_s` until cancelled (a task the gateway owns);
        `on_reload` runs after new keys and tenants took effect."""
        while True:
            await asyncio.sleep(period_s)
            try:
                is_reloaded = self.reload_if_changed()
            except Exception:  # a bug in reading: the keys in force stay, and so does the watch
                log.exception("API keys file not reloaded, old keys stay in force")
                continue
            if is_reloaded and on_reload is not None:
                try:
                    on_reload(self)
                except Exception:  # the watch goes on; the next change tries again
                    log.exception("API keys reloaded, but tenants' settings not updated")

    def tenant_of(self, key: str) -> str | None:
        """The tenant of `key` if it is known (looked up by its hash: no answer depends on
        comparing it with each key), else None."""
        principal = self._entries.get(hash_key(key)) if key else None
        return None if principal is None else principal.tenant

    def authenticate(self, key: str | None) -> Principal:
        if not key:
            self.on_refused("missing_key")
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>'")
        presented = hash_key(key).encode()
        found: Principal | None = None
        # Compare against every entry so the time taken says nothing about which one matched.
        for digest, principal in self._entries.items():
            if hmac.compare_digest(presented, digest.encode()):
                found = principal
        if found is None:
            self.on_refused("unknown_key")
            raise Unauthenticated("invalid API key")
        return found


#: The door's one caller for every call with a missing or unknown key.
UNKNOWN_CALLER = "\x00unknown"


def door_caller(keys: KeyStore | None) -> Callable[[Sequence[tuple[str, Any]]], str]:
    """Whom the door counts a call for (services.common.caller_shares), from its metadata: the
    tenant of the key it presents, and one caller, UNKNOWN_CALLER, for every missing or
    unknown key, so that made-up credentials share one share however many a flood presents
    (each counted on its own, they outnumbered the tenants, whose shares shrank until every
    tenant was over its share). Without a key store: the credential presented."""
    if keys is None:
        return caller_of

    def caller(metadata: Sequence[tuple[str, Any]]) -> str:
        return keys.tenant_of(caller_of(metadata)) or UNKNOWN_CALLER

    return caller


def _stamp(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


_FILE_TABLES = frozenset({"keys", "tenants"})
_KEY_FIELDS = frozenset({"tenant", "sha256", "models", "admin"})
#: A key's SHA-256 in hex (either case): anything else (a placeholder) would be a dead key.
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")


def _refuse_unknown(table: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    if unknown := sorted(set(table) - known):
        raise ValueError(f"{where}: unknown settings {unknown}; known: {sorted(known)}")


def _read_keys(path: Path) -> dict[str, Principal]:
    """The keys in `path`; ValueError naming it for a file that does not read as keys."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, RecursionError) as error:
        raise ValueError(f"{path}: not valid TOML: {error!r}") from error
    try:
        return _keys_of(raw, path)
    except (TypeError, AttributeError, RecursionError) as error:  # a setting of the wrong shape
        raise ValueError(f"{path}: {error!r}") from error


def _keys_of(raw: dict[str, Any], path: Path) -> dict[str, Principal]:
    entries: dict[str, Principal] = {}
    _refuse_unknown(raw, _FILE_TABLES, str(path))
    tenants = parse_tenants(raw.get("tenants"), str(path))
    keys = raw.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(entry, dict) for entry in keys):
        raise ValueError(f"{path}: keys must be [[keys]] tables")
    for entry in keys:
        # A misspelt setting fails: `model` read as no `models` would grant every model.
        _refuse_unknown(entry, _KEY_FIELDS, f"{path}: [[keys]] of {entry.get('tenant')!r}")
        digest, tenant = entry.get("sha256", ""), entry.get("tenant", "")
        is_valid = isinstance(digest, str) and _HEX_DIGEST.fullmatch(digest) is not None
        if not (is_valid and isinstance(tenant, str) and tenant):
            raise ValueError(f"{path}: every [[keys]] needs tenant and a sha256 hex digest")
        if (earlier := entries.get(digest.lower())) is not None:
            # Kept silently, the later entry would make the earlier tenant's key another's.
            raise ValueError(
                f"{path}: one sha256 digest is given to tenant {earlier.tenant!r} and again to "
                f"{tenant!r}: every key must be listed once"
            )
        models = entry.get("models")
        is_names = isinstance(models, list) and all(isinstance(m, str) for m in models)
        if models is not None and not is_names:
            raise ValueError(f"{path}: models of tenant {tenant!r} must be a list of names")
        is_admin = entry.get("admin", False)
        if not isinstance(is_admin, bool):
            raise ValueError(f"{path}: admin of tenant {tenant!r} must be true or false")
        policy = tenants.get(tenant) or TenantPolicy(tenant)
        # `models = []` is no model at all, not every model.
        allowed = [set(m) for m in (models, policy.models) if m is not None]
        entries[digest.lower()] = Principal(
            tenant, frozenset(set.intersection(*allowed)) if allowed else None, policy, is_admin
        )
    if not entries:
        raise ValueError(f"{path}: no [[keys]] entries")
    named = {principal.tenant for principal in entries.values()}
    for name in sorted(set(tenants) - named):
        # Said, not refused: a tenant may be set up before its keys are issued.
        log.warning(
            "%s: [tenants.%s] is no key's tenant, so its limits apply to no one (a misspelt "
            "name leaves the tenant it meant unlimited); tenants with keys: %s",
            path, name, ", ".join(sorted(named)),
        )  # fmt: skip
    return entries


def principal_for(keys: KeyStore | None, metadata: Mapping[str, str]) -> Principal:
    """The caller a call's metadata (or an HTTP request's lower-cased headers) presents:
    LOCAL_PRINCIPAL without a keys store; raises Unauthenticated for a missing or unknown key."""
    return LOCAL_PRINCIPAL if keys is None else keys.authenticate(_presented_key(metadata))


@contextlib.asynccontextmanager
async def acting_as(
    principal: Principal, admission: TenantAdmission | None = None
) -> AsyncIterator[None]:
    """Serves the code inside as `principal` (`current_principal`), counted in flight by
    `admission` when given (an admitted inference call); the HTTP API's way in."""
    scope = _Acting(principal, admission)
    scope.enter()
    try:
        yield
    finally:
        scope.exit(grpc.StatusCode.OK, None)


def _presented_key(metadata: Mapping[str, str]) -> str | None:
    return presented_key(metadata.get("authorization", ""), metadata.get("x-api-key"))


class Authentication:
    """The authentication stage of every call (services.common.interceptors): resolves the
    caller's principal from the call's metadata and admits inference calls against its
    tenant's quotas, before the request body is read or parsed; a refused call never has its
    body deserialised."""

    def __init__(self, keys: KeyStore | None, admission: TenantAdmission | None = None) -> None:
        self._keys = keys
        self._admission = admission

    def scope(self, method: str, metadata: Sequence[tuple[str, Any]]) -> _Acting | None:
        """Raises Unauthenticated, or the quota's refusal, to refuse the call."""
        if method.startswith(_OPEN_METHODS):
            return None
        if self._keys is None:  # no key to read: the metadata need not be read either
            principal = LOCAL_PRINCIPAL
        else:
            principal = principal_for(self._keys, {k: v for k, v in metadata if isinstance(v, str)})
        admission = self._admission
        if admission is None or method not in INFERENCE_METHODS:
            return _Acting(principal)
        policy = principal.policy
        refusal = admission.acquire(policy)
        if refusal is not None:
            raise refusal
        # Counted in flight from here, in the step that checked for room: grpc runs the handler
        # only once the request body has arrived, and the calls arriving meanwhile must see
        # this one. Given back when the call's task ends, however it ends (a later stage's
        # refusal, a caller gone before its body came).
        admission.enter(policy)
        task = asyncio.current_task()
        assert task is not None  # grpc runs a call's interceptors, its stages, in its task
        task.add_done_callback(lambda _: admission.release(policy))
        return _Acting(principal)


class _Acting:
    """A call served as its principal: set inside the call (not where the call arrives), so
    the handler's own context holds it; counted in flight by `admission` while it runs (an
    HTTP call's: a gRPC call is counted from its authentication, `Authentication.scope`)."""

    __slots__ = ("_admission", "_principal")

    def __init__(self, principal: Principal, admission: TenantAdmission | None = None) -> None:
        self._principal = principal
        self._admission = admission

    def enter(self) -> None:
        _principal.set(self._principal)
        if self._admission is not None:
            self._admission.enter(self._principal.policy)

    def attach(self) -> None:
        return None

    def detach(self, token: object) -> None:
        pass

    def exit(self, code: grpc.StatusCode, error: BaseException | None) -> None:
        if self._admission is not None:
            self._admission.release(self._principal.policy)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "hash":
        raise SystemExit("usage: python -m services.gateway.auth hash <key>")
    print(hash_key(sys.argv[2]))
