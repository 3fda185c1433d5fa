"""Each caller's share of the calls reaching a door (services.common.caller_shares)."""

from __future__ import annotations

import pytest

from services.common.caller_shares import CallerShares

pytestmark = pytest.mark.unit


def test_a_flooding_caller_is_over_its_share_and_a_light_one_is_not() -> None:
    shares = CallerShares(window_s=0.5)
    assert [shares.arrived("flood") for _ in range(3)] == [False, True, True]
    # A caller seen for the first time has sent nothing yet.
    assert shares.arrived("victim") is False
    for _ in range(100):
        shares.arrived("flood")
    # 1 of 104 calls, 2 callers: under an equal share; the flood far over it.
    assert shares.arrived("victim") is False
    assert shares.arrived("flood") is True


def test_callers_sending_alike_are_each_at_their_share() -> None:
    shares = CallerShares()
    for _ in range(10):
        shares.arrived("a")
        shares.arrived("b")
    assert shares.arrived("a") is True  # 10 of 20, 2 callers: an equal share
    assert shares.arrived("b") is False  # 10 of 21: just under it
    assert shares.arrived("b") is True  # 11 of 22


def test_shares_are_of_the_last_two_windows() -> None:
    shares = CallerShares(window_s=0.5)
    for _ in range(50):
        shares.arrived("flood")
    shares.roll(0.5)  # the flood's calls are now the previous window's: still counted
    assert shares.arrived("victim") is False
    assert shares.arrived("flood") is True
    shares.roll(0.8)  # not half a second since the last roll: nothing moves
    assert shares.arrived("flood") is True
    shares.roll(1.0)
    shares.roll(1.5)  # two windows later the flood is forgotten: a caller seen anew
    assert shares.arrived("flood") is False
