"""API-key files for e2e stacks."""

from __future__ import annotations

from pathlib import Path

from services.gateway.auth import hash_key


def write_keys_with_tight_tenant(path: Path, *, tenant: str, key: str, tight_key: str) -> Path:
    """A keys file with `key` for `tenant` and `tight_key` for tenant "tight", whose quota is
    one request of burst refilled every 100 s: its second inference call is refused (429)."""
    path.write_text(
        f'[[keys]]\ntenant = "{tenant}"\nsha256 = "{hash_key(key)}"\n'
        f'[[keys]]\ntenant = "tight"\nsha256 = "{hash_key(tight_key)}"\n'
        "[tenants.tight]\nrequests_per_s = 0.01\nburst_s = 100.0\n"
    )
    return path
