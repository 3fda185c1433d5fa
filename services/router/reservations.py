"""The rows this router has sent to each worker and not yet seen answered, by tenant.

A worker's heartbeat is up to a period old; these reservations are fresh, so routing counts
them (`RouteTable`), and they say whose rows a worker's queue holds: the worker's batcher
serves tenants by weighted fair share, so a request waits only for the part of the queue fair
share puts ahead of it (`services.common.fair_rows`). Pure: no clock, no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

from services.common.fair_rows import rows_ahead

#: (worker_id, "name@version", is_batch): where rows are reserved; a worker runs batch-class
#: rows after every other class, so they are kept apart.
Slot = tuple[str, str, bool]


class Reservations:
    """Reserved rows per slot, in all and per tenant; released by reservation id."""

    def __init__(self) -> None:
        self._rows: dict[Slot, int] = {}
        self._by_tenant: dict[Slot, Counter[str]] = {}
        # Tenants with rows reserved anywhere: their rows, and the fair-share weight their
        # latest request carried (forgotten with their last row: the maps stay bounded).
        self._tenant_rows: Counter[str] = Counter()
        self._weights: dict[str, float] = {}
        # reservation_id -> (slot, rows, tenant).
        self._reservations: dict[int, tuple[Slot, int, str]] = {}
        self._ids = itertools.count(1)

    def rows(self, slot: Slot) -> int:
        """Rows reserved in `slot`."""
        return self._rows.get(slot, 0)

    def place_rows(self, place: tuple[str, str]) -> int:
        """Rows reserved at `place` (worker_id, "name@version"), every class."""
        return self.rows((*place, False)) + self.rows((*place, True))

    def worker_rows(self, worker_id: str) -> int:
        """Rows reserved on `worker_id`, all models."""
        return sum(rows for (w, _, _), rows in self._rows.items() if w == worker_id)

    def reserve(self, slot: Slot, num_rows: int, tenant: str, weight: float) -> int:
        """Reserves `num_rows` rows of `tenant` (at fair-share `weight`); returns the id."""
        reservation_id = next(self._ids)
        self._reservations[reservation_id] = (slot, num_rows, tenant)
        self._rows[slot] = self._rows.get(slot, 0) + num_rows
        by_tenant = self._by_tenant.get(slot)
        if by_tenant is None:
            by_tenant = self._by_tenant[slot] = Counter()
        by_tenant[tenant] += num_rows
        self._tenant_rows[tenant] += num_rows
        self._weights[tenant] = weight
        return reservation_id

    def release(self, reservation_id: int) -> None:
        """Returns a reservation's rows. Idempotent: unknown or released ids are ignored."""
        reservation = self._reservations.pop(reservation_id, None)
        if reservation is None:
            return
        slot, num_rows, tenant = reservation
        remaining_rows = self._rows[slot] - num_rows
        if remaining_rows > 0:
            self._rows[slot] = remaining_rows
        else:
            del self._rows[slot]
        by_tenant = self._by_tenant[slot]
        by_tenant[tenant] -= num_rows
        if by_tenant[tenant] <= 0:
            del by_tenant[tenant]
            if not by_tenant:
                del self._by_tenant[slot]
        self._tenant_rows[tenant] -= num_rows
        if self._tenant_rows[tenant] <= 0:
            del self._tenant_rows[tenant], self._weights[tenant]

    def queue_ahead(
        self,
        place: tuple[str, str],
        reported: tuple[int, int] | None,
        is_batch: bool,
        tenant: str,
        weight: float,
    ) -> tuple[int, int]:
        """The rows queued at `place` (worker_id, "name@version") that one more row of
        `tenant`'s class waits behind, and those of them its batcher serves before it (fair
        share): this router's reservations, or the worker's `reported` (online, batch) counts
        where larger (the max is a conservative blend of the two; None: the report is too old
        to count). Batch-class rows run after every other class, so they are ahead of batch
        rows only: counted ahead of online ones too, a batch job's rows held through this
        router priced every online call as waiting behind them (review finding)."""
        online, batch = (*place, False), (*place, True)
        queued = self.rows(online) if reported is None else max(reported[0], self.rows(online))
        if not is_batch:
            return queued, self.fair_share_of(queued, online, tenant, weight)
        batch_rows = self.rows(batch) if reported is None else max(reported[1], self.rows(batch))
        ahead = queued + self.fair_share_of(batch_rows, batch, tenant, weight)
        return queued + batch_rows, ahead

    def fair_share_of(self, queued_rows: int, slot: Slot, tenant: str, weight: float) -> int:
        """Of `queued_rows` on a worker, those its batcher serves before one more row of
        `tenant` (at `weight`): the reservations in `slot` show which tenants the rows belong
        to, and the rest of the queue (other routers' traffic, counted in the heartbeat) is
        taken to be made up alike. All of them without a tenant, or with only its own rows."""
        by_tenant = self._by_tenant.get(slot)
        if not tenant or not by_tenant or by_tenant.keys() == {tenant}:
            return queued_rows
        (ahead,) = rows_ahead({slot: by_tenant}, tenant, weight, self._weights).values()
        return math.ceil(queued_rows * ahead / self._rows[slot])
