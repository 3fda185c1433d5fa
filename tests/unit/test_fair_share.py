"""ComputeLedger: weighted compute per tenant, and no credit banked while idle."""

from __future__ import annotations

import collections

import pytest

from services.gpu_worker.batching import fair_share
from services.gpu_worker.batching.fair_share import ComputeLedger

pytestmark = pytest.mark.unit


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
