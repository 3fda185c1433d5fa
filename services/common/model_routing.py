"""Runtime version labels and traffic weights: which version `stable` and `canary` mean, and how
requests that name no version split between labels.

The authoritative copy lives in Redis, one field per model in the hash `<prefix>:rollout`
(services.rollout writes it; every gateway reads it every half second, services.gateway
.routing_sync). A model without a field uses its repository's `[labels]` and `[traffic]`: the
file only seeds. Each field carries a revision that only grows, so a gateway applies a change
once and never goes back to an older one.

Sticky choice: a request that carries a request id gets the label that hashing (model, id,
the weighted labels with their versions and weights) picks, so retries and related calls with
the same id see the same version until the weights change; without an id the choice is
random. Pure: no I/O.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.errors import MALFORMED_RECORD_ERRORS

_LABEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def is_label_name(label: object) -> bool:
    """Whether `label` may name a version (lower case, digits, `_`, `-`; 32 at most)."""
    return isinstance(label, str) and _LABEL_RE.match(label) is not None


def routing_key(prefix: str) -> str:
    """The Redis hash holding every model's routing (field: model name)."""
    return f"{prefix}:rollout"


@dataclass(frozen=True)
class ModelRouting:
    """One model's labels (label -> version number) and traffic weights (label -> weight)."""

    labels: Mapping[str, int]
    traffic: Mapping[str, float] = field(default_factory=dict)
    #: Grows with every change; 0 for what a model repository seeds.
    revision: int = 0

    def __post_init__(self) -> None:
        """Raises ValueError unless labels are well formed, versions positive, and weights
        finite, >= 0 and for labels that exist."""
        for label, version in self.labels.items():
            if not _LABEL_RE.match(label):
                raise ValueError(f"label {label!r}: lower-case letters, digits, - and _")
            if not (isinstance(version, int) and version > 0):
                raise ValueError(f"label {label!r}: version must be a positive integer")
        for label, weight in self.traffic.items():
            if label not in self.labels:
                raise ValueError(f"traffic weight for {label!r}, which is not a label")
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"traffic weight of {label!r} must be finite and >= 0")
        if not math.isfinite(sum(self.traffic.values())):  # 1e308 twice: every call to one
            raise ValueError("traffic weights must add up to a finite number")
        if self.revision < 0:
            raise ValueError("revision must be >= 0")

    def dumps(self) -> str:
        return json.dumps(
            {"revision": self.revision, "labels": dict(self.labels), "traffic": dict(self.traffic)},
            sort_keys=True,
        )

    @classmethod
    def loads(cls, raw: str | bytes) -> ModelRouting:
        """Parses a stored field; ValueError if it is not one."""
        try:
            parsed = json.loads(raw)
            labels = {str(k): _whole(v) for k, v in dict(parsed["labels"]).items()}
            traffic = {str(k): float(v) for k, v in dict(parsed.get("traffic", {})).items()}
            revision = _whole(parsed["revision"])
        except MALFORMED_RECORD_ERRORS as error:  # 1e400, JSON nested past the limit, ...
            raise ValueError(f"not a model routing record: {error!r}") from None
        return cls(labels, traffic, revision)

    def check_versions(self, versions: set[int]) -> None:
        """Raises ValueError if a label names a version not in `versions`."""
        unknown = {f"{label}={v}" for label, v in self.labels.items() if v not in versions}
        if unknown:
            raise ValueError(f"labels name versions that do not exist: {sorted(unknown)}")

    def weighted_label(self, model: str, sticky_key: str | None, rng: random.Random) -> str | None:
        """The label a request naming no version goes to; None without positive weights.
        With `sticky_key`, a deterministic choice (see the module docstring)."""
        weighted, total, split = self._split
        if not weighted:
            return None
        if sticky_key:
            digest = hashlib.sha256(f"{model}\0{sticky_key}\0{split}".encode()).digest()
            point = int.from_bytes(digest[:8], "big") / 2**64 * total
        else:
            point = rng.random() * total
        for label, weight in weighted:
            point -= weight
            if point < 0:
                return label
        return weighted[-1][0]

    @functools.cached_property
    def _split(self) -> tuple[list[tuple[str, float]], float, str]:
        """The labels with positive weights, sorted, their total, and the split as text: what
        a sticky choice is hashed with, not the record's revision, which every write bumps (a
        label added, a promotion written again), and half of a 50:50 split's ids moved
        version at each (review finding). Computed once per record, not per call."""
        weighted = sorted((label, w) for label, w in self.traffic.items() if w > 0)
        total = sum(w for _, w in weighted)
        split = ",".join(f"{label}={self.labels.get(label)}:{w!r}" for label, w in weighted)
        return weighted, total, split


def _whole(value: object) -> int:
    """`value` as a whole number; ValueError for anything else (2.5 is not version 2)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)
