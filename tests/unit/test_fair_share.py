"""ComputeLedger: weighted compute per tenant, and no credit banked while idle."""

from __future__ import annotations

import collections
import itertools

import pytest

from services.gpu_worker.batching import fair_share
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.fairness import TenantQueues
from services.gpu_worker.batching.types import BatchKey, QueuedItem

pytestmark = pytest.mark.unit

KEY = BatchKey(model="m", version="1", fingerprint="f", bucket=16)


def test_charges_are_divided_by_weight() -> None:
    ledger = ComputeLedger()
    ledger.join("a")
    ledger.join("b")
    ledger.charge("a", 0.3, weight=3.0)
    ledger.charge("b", 0.3, weight=1.0)

    assert ledger.virtual_s("a") == pytest.approx(0.1)
    assert ledger.virtual_s("b") == pytest.approx(0.3)
    assert ledger.floor_s() == pytest.approx(0.1)


def test_an_idle_tenant_rejoins_at_the_floor_and_banks_no_credit() -> None:
    ledger = ComputeLedger()
    ledger.join("busy")
    ledger.charge("busy", 5.0, weight=1.0)
    ledger.join("idle")  # first seen while "busy" is at 5 s: it starts there, not at 0

    assert ledger.virtual_s("idle") == pytest.approx(5.0)


def test_a_tenant_keeps_its_debt_across_a_short_idle_spell() -> None:
    ledger = ComputeLedger()
    ledger.join("a")
    ledger.join("b")
    ledger.charge("a", 2.0, weight=1.0)
    ledger.leave("a")
    ledger.join("a")

    assert ledger.virtual_s("a") == pytest.approx(2.0), "leaving must not wipe what a used"


def test_the_floor_never_moves_back() -> None:
    ledger = ComputeLedger()
    ledger.join("a")
    ledger.charge("a", 1.0, weight=1.0)
    assert ledger.floor_s() == pytest.approx(1.0)
    ledger.leave("a")
    ledger.join("new")

    assert ledger.floor_s() == pytest.approx(1.0)
    assert ledger.virtual_s("new") == pytest.approx(1.0)


def test_reading_the_lowest_keeps_no_floor() -> None:
    """`lowest_s` is what `floor_s` returns, without keeping it: a reader (the generation
    engine's standing rule, asking where a tenant would join) lifts no one later."""
    ledger = ComputeLedger()
    ledger.join("a")
    ledger.charge("a", 5.0, 1.0)
    assert ledger.lowest_s() == 5.0
    ledger.leave("a")
    assert ledger.floor_s() == 0.0  # read, not kept
    ledger.join("a")
    assert ledger.floor_s() == 5.0
    ledger.leave("a")
    assert ledger.floor_s() == ledger.lowest_s() == 5.0  # kept


def test_idle_tenants_at_the_floor_are_forgotten_past_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fair_share, "MAX_REMEMBERED_TENANTS", 3)
    ledger = ComputeLedger()
    for name in "abcde":
        ledger.join(name)
    ledger.charge("e", 1.0, weight=1.0)
    for name in "abcd":
        ledger.leave(name)

    assert ledger.num_tenants <= 3
    assert ledger.virtual_s("e") == pytest.approx(1.0)


@pytest.mark.parametrize("weight", [0.0, -1.0, float("inf"), float("nan")])
def test_rejects_a_weight_that_is_not_positive_and_finite(weight: float) -> None:
    with pytest.raises(ValueError, match="positive and finite"):
        ComputeLedger().charge("a", 1.0, weight=weight)


def test_a_batchs_rows_are_charged_once_per_tenant_and_weight() -> None:
    """charge_rows: what charging each row alone would come to, one charge per tenant and
    weight of the batch."""
    Row = collections.namedtuple("Row", "tenant weight")
    rows = [Row("a", 1.0)] * 3 + [Row("b", 2.0)] * 4 + [Row("a", 4.0)]
    together, alone = ComputeLedger(), ComputeLedger()
    together.charge_rows(rows, 0.01)
    for row in rows:
        alone.charge(row.tenant, 0.01, row.weight)
    for tenant in ("a", "b"):
        assert together.virtual_s(tenant) == pytest.approx(alone.virtual_s(tenant))
    assert together.virtual_s("a") == pytest.approx(0.03 + 0.0025)
    assert together.virtual_s("b") == pytest.approx(0.02)
    with pytest.raises(ValueError, match="weight"):
        together.charge_rows([Row("c", 0.0)], 0.01)


def test_a_tenant_with_only_batch_rows_queued_holds_no_urgent_floor() -> None:
    """J keeps a job's `batch` rows queued (served as backfill, seldom charged) while A and B
    are served interactive work for a long time. The floor was the least virtual time of any
    tenant with rows queued: J's. A tenant joining with interactive rows (or J itself) was
    lifted only to it and took the executor from A and B for as long as that lead lasted
    (review finding). Urgent rows join at the floor of the tenants with urgent rows."""
    ledger = ComputeLedger()
    ledger.join("j")
    for tenant in ("a", "b"):
        ledger.join(tenant, is_urgent=True)
        ledger.charge(tenant, 300.0, weight=1.0)
    ledger.charge("j", 5.0, weight=1.0)
    ledger.join("c", is_urgent=True)
    assert ledger.virtual_s("c") == pytest.approx(300.0)
    ledger.join("j", is_urgent=True)  # J's own interactive rows: no lead either
    assert ledger.virtual_s("j") == pytest.approx(300.0)
    # A batch newcomer joins the floor of everything queued, as before.
    ledger.join("k")
    assert ledger.virtual_s("k") == pytest.approx(300.0)


def test_a_tenant_with_urgent_rows_queued_keeps_its_place_when_it_sends_a_critical_one() -> None:
    """Critical and interactive rows share one floor: T, queued interactive at 50 beside A's
    critical rows at 80, sending a critical row is not lifted to 80 (a floor per rank lifted
    it, and its interactive rows fell behind B's)."""
    ledger = ComputeLedger()
    for tenant, used_s in (("t", 50.0), ("b", 50.0), ("a", 80.0)):
        ledger.join(tenant, is_urgent=True)
        ledger.charge(tenant, used_s, weight=1.0)
    ledger.join("t", is_urgent=True)
    assert ledger.virtual_s("t") == pytest.approx(50.0)


def test_a_newcomer_gets_its_share_of_interactive_batches_beside_a_backfilled_job() -> None:
    """The same through TenantQueues, as a batcher takes rows: with J's batch rows queued, C
    joins A and B and gets about a third of the next interactive rows, not all of them."""
    ledger = ComputeLedger()
    queues = TenantQueues(ledger)
    ids = itertools.count()

    def push(tenant: str, priority: int, count: int) -> None:
        for _ in range(count):
            queues.push(
                QueuedItem(next(ids), KEY, tenant, 12, 0.0, 1e9, priority=priority, weight=1.0)
            )

    push("j", 2, 50)
    push("a", 1, 400)
    push("b", 1, 400)
    for _ in range(20):  # A and B served long: 0.01 s a row
        ledger.charge_rows(queues.take(16, 0.01), 0.01)
    push("c", 1, 400)
    taken = collections.Counter()
    for _ in range(10):
        batch = queues.take(12, 0.01)
        ledger.charge_rows(batch, 0.01)
        taken.update(item.tenant for item in batch)
    assert taken["c"] <= 0.5 * sum(taken.values()), taken
    assert taken["a"] > 0 and taken["b"] > 0, taken


def test_taking_from_one_class_keeps_the_counts_a_row_by_row_pop_keeps() -> None:
    """A batch taken from a queue holding one class (one priority, one tenant) forgets its rows'
    counts at once: the queue's counts by rank, class and tenant, and the ledger's queued rows,
    are those of the rows left, through takes of every size; the tenant's last row leaving
    takes it out of the rotation and the ledger (it rejoins behind tenants already queued)."""
    ledger = ComputeLedger()
    queues = TenantQueues(ledger)
    ids = itertools.count()
    for _ in range(37):
        queues.push(QueuedItem(next(ids), KEY, "a", 12, 0.0, 1e9, priority=1, weight=1.0))
    left = 37
    for size in (1, 16, 7, 16):
        taken = queues.take(size, 0.01)
        left -= len(taken)
        assert len(taken) == min(size, len(taken) + left)
        assert (len(queues), queues.tenant_rows("a"), queues.count_at_most(1)) == (left,) * 3
        assert queues.rows_by_tenant(2) == (collections.Counter({"a": left}) if left else {})
        assert ledger.has_queued_other_than("b") is (left > 0)
    assert left == 0 and list(queues.tenants()) == []
    # Gone from the rotation: queued again after another tenant (no compute charged to
    # either), it is taken after it.
    queues.push(QueuedItem(next(ids), KEY, "b", 12, 0.0, 1e9, priority=1, weight=1.0))
    queues.push(QueuedItem(next(ids), KEY, "a", 12, 0.0, 1e9, priority=1, weight=1.0))
    assert [item.tenant for item in queues.take(2, 0.01)] == ["b", "a"]
