"""API keys -> tenants. Keys are stored as SHA-256 hashes and compared in constant time; the
tenant never comes from a request body.

Keys file (TOML)::

    [[keys]]
    tenant = "search"
    sha256 = "<hex digest of the key>"    # python -m services.gateway.auth hash <key>
    models = ["minilm"]                   # optional: the models this key may use (default all)
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import sys
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.errors import PermissionDenied, Unauthenticated
from services.common.interceptors import Step, no_step, wrap_handler

#: Tenant of local mode (no keys configured).
LOCAL_TENANT = "local"
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class Principal:
    tenant: str
    #: Models this caller may use; None means every model.
    models: frozenset[str] | None

    def check_model(self, model_name: str) -> None:
        if self.models is not None and model_name not in self.models:
            raise PermissionDenied(f"tenant {self.tenant!r} may not use model {model_name!r}")


LOCAL_PRINCIPAL = Principal(LOCAL_TENANT, None)
_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("principal")


def current_principal() -> Principal:
    """The caller of the RPC being handled (set by AuthInterceptor)."""
    return _principal.get(LOCAL_PRINCIPAL)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, entries: Mapping[str, Principal]) -> None:
        #: sha256 hex -> principal
        self._entries = dict(entries)

    @classmethod
    def from_file(cls, path: Path) -> KeyStore:
        raw = tomllib.loads(path.read_text())
        entries = {}
        for entry in raw.get("keys", []):
            digest, tenant = entry.get("sha256", ""), entry.get("tenant", "")
            if len(digest) != 64 or not tenant:
                raise ValueError(f"{path}: every [[keys]] needs tenant and a sha256 hex digest")
            models = entry.get("models")
            entries[digest.lower()] = Principal(tenant, frozenset(models) if models else None)
        if not entries:
            raise ValueError(f"{path}: no [[keys]] entries")
        return cls(entries)

    def authenticate(self, key: str | None) -> Principal:
        if not key:
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>'")
        presented = hash_key(key).encode()
        found: Principal | None = None
        # Compare against every entry so the time taken says nothing about which one matched.
        for digest, principal in self._entries.items():
            if hmac.compare_digest(presented, digest.encode()):
                found = principal
        if found is None:
            raise Unauthenticated("invalid API key")
        return found


def _presented_key(metadata: Mapping[str, str]) -> str | None:
    authorization = metadata.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return metadata.get("x-api-key")


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Resolves the caller's principal (or refuses the call) before any handler runs."""

    def __init__(self, keys: KeyStore | None) -> None:
        self._keys = keys

    def _principal(self, metadata: Mapping[str, str]) -> Principal:
        return (
            LOCAL_PRINCIPAL
            if self._keys is None
            else self._keys.authenticate(_presented_key(metadata))
        )

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_METHODS):
            return handler
        metadata = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        return wrap_handler(handler, lambda context: self._authenticated(metadata))

    @contextlib.asynccontextmanager
    async def _authenticated(self, metadata: Mapping[str, str]) -> AsyncIterator[Step]:
        # Inside the call, not in intercept_service: a refusal is then answered by the
        # error-mapping interceptor and traced like any other failed call.
        _principal.set(self._principal(metadata))
        yield no_step


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "hash":
        raise SystemExit("usage: python -m services.gateway.auth hash <key>")
    print(hash_key(sys.argv[2]))
