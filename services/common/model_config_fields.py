"""A model config's fields, read and checked one by one (services.common.model_repository):
the error a config that does not read raises, and what a required, optional or positive field
must be."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """A model directory or config file is invalid. The message names the file."""


def require(raw: Mapping[str, Any], key: str, kind: type, path: Path) -> Any:
    if key not in raw:
        raise ModelConfigError(f"{path}: missing required field {key!r}")
    value = raw[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ModelConfigError(f"{path}: {key!r} must be {kind.__name__}, got {value!r}")
    return value


def optional(raw: Mapping[str, Any], key: str, kind: type, default: Any, path: Path) -> Any:
    return require(raw, key, kind, path) if key in raw else default


#: The largest count or duration in milliseconds a model may set: the APIs carry them as
#: int32 (Triton's model config) or uint32 (a larger one broke the router's model list for
#: every model).
MAX_SETTING = 2**31 - 1


def positive(value: int, key: str, path: Path, least: int = 1) -> int:
    if not least <= value <= MAX_SETTING:
        raise ModelConfigError(f"{path}: {key!r} must be in [{least}, {MAX_SETTING}], got {value}")
    return value


def batch_tokens(raw: Mapping[str, Any], buckets: Sequence[int], path: Path) -> int:
    """`max_batch_tokens` (0: no cap), at least the longest length bucket: below it a row of
    that bucket ran alone, past the cap it set, and silently (review finding)."""
    value = positive(optional(raw, "max_batch_tokens", int, 0, path), "max_batch_tokens", path, 0)
    if 0 < value < max(buckets, default=0):
        raise ModelConfigError(
            f"{path}: max_batch_tokens ({value}) must be 0 or at least the longest length bucket"
            f" ({max(buckets)}): one row of it would pass it alone"
        )
    return value
