"""What a gateway makes once per model version and keeps while the version is in use (bundle
tokenizers, chat templates): versions come and go with rollouts, so each value made first
drops those whose key is no longer kept, and the memo holds about the versions in use."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class VersionMemo(Generic[K, V]):
    """Values by key, made once; `is_kept(key)` says whether a key's version is still in use
    (a miss drops those it no longer is: one dropped is made again if its version comes
    back)."""

    def __init__(self, is_kept: Callable[[K], bool]) -> None:
        self._is_kept = is_kept
        self._made: dict[K, V] = {}

    def __len__(self) -> int:
        return len(self._made)

    def get(self, key: K, make: Callable[[], V]) -> V:
        value = self._made.get(key)
        if value is None:
            for gone in [k for k in self._made if not self._is_kept(k)]:
                del self._made[gone]
            value = self._made[key] = make()
        return value
