"""by_urgency: which lane an idle executor serves first, and when a lingering lane is forced to
close its batch so that fair share holds across models."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from services.gpu_worker.admission import Admitted
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.lane import Lane, by_urgency
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.types import BatcherConfig, BatchKey, CloseReason, QueuedItem

pytestmark = pytest.mark.unit

CONFIG = BatcherConfig(
    max_batch_size=4,
    max_queue_size=100,
    slo_s=1.0,
    upstream_budget_s=0.0,
    safety_margin_s=0.0,
    max_wait_cap_s=0.05,
)


def lane(name: str, ledger: ComputeLedger) -> Lane:
    """A lane of model `name` with only a batcher: all by_urgency reads."""
    return cast(Lane, SimpleNamespace(name=name, batcher=Batcher(CONFIG, LatencyModel(), ledger)))


def queue(target: Lane, tenant: str, count: int, *, first_id: int, priority: int = 1) -> None:
    key = BatchKey(model=cast(SimpleNamespace, target).name, version="1", fingerprint="f", bucket=1)
    for i in range(count):
        item = QueuedItem(
            item_id=first_id + i,
            key=key,
            tenant=tenant,
            num_tokens=1,
            arrival_s=0.0,
            deadline_s=60.0,
            priority=priority,
        )
        assert target.batcher.add(item, 0.0) == Admitted()


def names(turns: list[tuple[Lane, bool]]) -> list[tuple[str, bool]]:
    return [(cast(SimpleNamespace, lane).name, force) for lane, force in turns]


def test_the_lane_of_the_tenant_below_its_share_goes_first() -> None:
    ledger = ComputeLedger()
    a, b = lane("a", ledger), lane("b", ledger)
    queue(a, "heavy-user", 4, first_id=0)
    queue(b, "light-user", 4, first_id=100)
    ledger.charge("heavy-user", 1.0, weight=1.0)

    assert names(by_urgency([a, b], 0.0)) == [("b", False), ("a", False)]


def test_a_lingering_lane_with_the_most_urgent_work_is_forced_to_close() -> None:
    ledger = ComputeLedger()
    full, lingering = lane("full", ledger), lane("lingering", ledger)
    queue(full, "over-share", 4, first_id=0)  # a full batch: ready
    queue(lingering, "under-share", 1, first_id=100)  # one row, would linger
    queue(lingering, "under-share", 1, first_id=101)
    ledger.charge("over-share", 1.0, weight=1.0)
    assert lingering.batcher.urgency(0.001) is None, "premise: it would rather linger"

    turns = by_urgency([full, lingering], 0.001)

    assert names(turns) == [("lingering", True), ("full", False)]
    poll = lingering.batcher.poll(0.001, executor_idle=True, force=True)
    assert getattr(poll.action, "reason", None) is CloseReason.FAIR_SHARE


def test_priority_outranks_fair_share_across_lanes() -> None:
    ledger = ComputeLedger()
    online, batch = lane("online", ledger), lane("batch", ledger)
    queue(batch, "idle-tenant", 4, first_id=0, priority=2)
    queue(online, "busy-tenant", 4, first_id=100, priority=1)
    ledger.charge("busy-tenant", 5.0, weight=1.0)

    assert names(by_urgency([batch, online], 0.0))[0] == ("online", False)


def test_nothing_is_forced_while_nothing_is_ready() -> None:
    ledger = ComputeLedger()
    a, b = lane("a", ledger), lane("b", ledger)
    queue(a, "t", 1, first_id=0)
    queue(a, "t", 1, first_id=1)

    assert names(by_urgency([a, b], 0.001)) == [("a", False), ("b", False)]
