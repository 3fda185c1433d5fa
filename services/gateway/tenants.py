"""Tenant configuration: what each tenant may use and how much of the fleet it gets.

Read from the API keys file (services.gateway.auth), next to the keys, and reloaded with them::

    [tenants.search]
    weight = 3.0               # share of contended compute, relative to other tenants (default 1)
    requests_per_s = 200       # token bucket refill, fleet-wide (default: no limit)
    rows_per_s = 2000          # input rows (texts, tensors, prompts) per second, fleet-wide
    burst_s = 1.0              # bucket depth, in seconds of the rate (default 1)
    max_concurrency = 64       # calls in flight at once, fleet-wide (default: no limit)
    models = ["minilm"]        # models it may use (default: all); a key's own list narrows it
    default_priority = "interactive"
    priorities = ["interactive", "batch"]   # classes it may ask for (default: these two)

A tenant without a table gets `TenantPolicy(name)`: weight 1, no limits, interactive by
default, interactive and batch allowed. `critical` must be granted explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.priority import DEFAULT_PRIORITY, PriorityClass

#: Classes a tenant may ask for unless its table says otherwise.
DEFAULT_PRIORITIES = frozenset({PriorityClass.INTERACTIVE, PriorityClass.BATCH})
#: Most tenants that get their own metric label values; the rest are counted as `other`.
MAX_LABELLED_TENANTS = 64
OTHER_TENANT_LABEL = "other"


@dataclass(frozen=True)
class TenantPolicy:
    name: str
    #: Relative share of contended compute (workers' cost-weighted fair share).
    weight: float = 1.0
    #: Fleet-wide request and row rates, per second; None: unlimited.
    requests_per_s: float | None = None
    rows_per_s: float | None = None
    #: Bucket depth in seconds of each rate: how far above its rate a burst may go.
    burst_s: float = 1.0
    #: Fleet-wide calls in flight at once; None: unlimited.
    max_concurrency: int | None = None
    #: Models the tenant may use; None: every model.
    models: frozenset[str] | None = None
    default_priority: PriorityClass = DEFAULT_PRIORITY
    priorities: frozenset[PriorityClass] = field(default=DEFAULT_PRIORITIES)

    @property
    def is_limited(self) -> bool:
        return (
            self.requests_per_s is not None
            or self.rows_per_s is not None
            or self.max_concurrency is not None
        )

    def is_granted(self, priority: PriorityClass) -> bool:
        return priority in self.priorities

    def priority_for(self, requested: PriorityClass | None) -> PriorityClass:
        """The class a call runs at: the one asked for, else the tenant's default. Raises
        PermissionDenied for a class the tenant was not granted."""
        # Imported here: services.common.errors needs grpc, and this module must load without
        # it (the fleet simulator runs these policies and never imports asyncio or grpc).
        from services.common.errors import PermissionDenied

        if requested is None:
            return self.default_priority
        if not self.is_granted(requested):
            granted = ", ".join(sorted(p.value for p in self.priorities))
            raise PermissionDenied(
                f"tenant {self.name!r} may not use priority {requested.value!r} "
                f"(granted: {granted})"
            )
        return requested


def parse_tenants(raw: Any, source: str) -> dict[str, TenantPolicy]:
    """The `[tenants.NAME]` tables of a keys file; ValueError naming what is wrong."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: tenants must be [tenants.NAME] tables")
    return {name: _policy(name, table, f"{source}: tenant {name!r}") for name, table in raw.items()}


_KEYS = {
    "weight",
    "requests_per_s",
    "rows_per_s",
    "burst_s",
    "max_concurrency",
    "models",
    "default_priority",
    "priorities",
}


def _policy(name: str, table: Any, where: str) -> TenantPolicy:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a table")
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown settings {unknown}; known: {sorted(_KEYS)}")
    models = table.get("models")
    if models is not None and not (
        isinstance(models, list) and all(isinstance(m, str) for m in models)
    ):
        raise ValueError(f"{where}: models must be a list of names")
    listed = table.get("priorities", [])
    if not isinstance(listed, list):
        raise ValueError(f"{where}: priorities must be a list of class names")
    try:
        priorities = frozenset(PriorityClass.parse(p) for p in listed) or DEFAULT_PRIORITIES
        default = PriorityClass.parse(table.get("default_priority", DEFAULT_PRIORITY.value))
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{where}: {error}") from None
    if default not in priorities:
        priorities = priorities | {default}
    max_concurrency = table.get("max_concurrency")
    if max_concurrency is not None and (
        isinstance(max_concurrency, bool)
        or not isinstance(max_concurrency, int)
        or max_concurrency < 1
    ):
        raise ValueError(f"{where}: max_concurrency must be an integer >= 1")
    return TenantPolicy(
        name=name,
        weight=_positive(table, "weight", 1.0, where),
        requests_per_s=_positive(table, "requests_per_s", None, where),
        rows_per_s=_positive(table, "rows_per_s", None, where),
        burst_s=_positive(table, "burst_s", 1.0, where),
        max_concurrency=max_concurrency,
        models=frozenset(models) if models is not None else None,
        default_priority=default,
        priorities=priorities,
    )


def _positive(table: Mapping[str, Any], key: str, default: Any, where: str) -> Any:
    value = table.get(key, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {key} must be a number")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: {key} must be positive and finite")
    return float(value)


class TenantLabels:
    """Bounded metric label values: configured tenants by name (at most
    MAX_LABELLED_TENANTS), everyone else as `other`."""

    def __init__(self, tenants: Mapping[str, TenantPolicy] | None = None) -> None:
        self.update(tenants or {})

    def update(self, tenants: Mapping[str, TenantPolicy]) -> None:
        self._names = frozenset(sorted(tenants)[:MAX_LABELLED_TENANTS])

    def __call__(self, tenant: str) -> str:
        return tenant if tenant in self._names else OTHER_TENANT_LABEL
