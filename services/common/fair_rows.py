"""How many queued rows weighted fair share serves before one more row of a tenant.

Shared by the worker's admission (what is ahead of a new row in its queue) and the router's
(what is ahead of it on a worker, from the rows this router sent there): a tenant flooding a
queue must not make a light tenant's request look late. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import TypeVar

#: Weight of a tenant that neither its request nor the tenant configuration sets.
DEFAULT_WEIGHT = 1.0

K = TypeVar("K")


def rows_ahead(
    per_key: Mapping[K, Mapping[str, int]],
    tenant: str,
    weight: float,
    weights: Mapping[str, float],
) -> dict[K, int]:
    """Of the rows queued per key and tenant, how many fair share serves before one more row
    of `tenant` (at `weight`): all of the tenant's own, and of each other tenant u the share
    w_u / weight of as many rows as `tenant` has queued, plus one (weighted turns), capped at
    what u has queued, spread over u's keys in proportion. An approximation: it ignores how
    far apart the tenants' virtual times are now."""
    totals: Counter[str] = Counter()
    for counts in per_key.values():
        totals.update(counts)
    own = totals[tenant] + 1
    fraction = {
        u: min(1.0, own * weights.get(u, DEFAULT_WEIGHT) / (weight * n))
        for u, n in totals.items()
        if u != tenant and n > 0
    }
    return {
        key: sum(
            n if u == tenant else math.ceil(fraction[u] * n) for u, n in counts.items() if n > 0
        )
        for key, counts in per_key.items()
    }
