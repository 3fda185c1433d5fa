"""Each caller's share of the calls reaching a door (services.common.caller_shares)."""

from __future__ import annotations

import pytest

from services.common.caller_shares import CallerShares, caller_of

pytestmark = pytest.mark.unit


def test_a_flooding_caller_is_over_its_share_and_a_light_one_is_not() -> None:
    shares = CallerShares(window_s=0.5)
    # The very first call had nothing before it; then the flood sent every call.
    assert [shares.arrived("flood") for _ in range(3)] == [False, True, True]
    # A new caller's first call: first calls are 1 of 3 so far, under an equal share.
    assert shares.arrived("victim") is False
    for _ in range(100):
        shares.arrived("flood")
    assert shares.arrived("victim") is False  # its own first
    assert shares.arrived("flood") is True


def test_callers_sending_alike_are_each_at_their_share() -> None:
    shares = CallerShares()
    for _ in range(10):
        shares.arrived("a")
        shares.arrived("b")
    assert shares.arrived("a") is True
    assert shares.arrived("b") is True


def test_a_flood_rotating_credentials_shares_one_share() -> None:
    shares = CallerShares(max_callers=64)
    for _ in range(20):
        shares.arrived("tenant")
    refused = [shares.arrived(f"junk-{i}") for i in range(1000)]
    # Every junk call is a first call: together they are one caller, soon over its share,
    # and they do not add callers for the tenant's share to be measured against.
    assert sum(refused) >= 950
    assert shares.arrived("tenant") is False


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


def test_the_caller_is_the_credential_as_authentication_reads_it() -> None:
    assert caller_of([("authorization", "Bearer k1")]) == "k1"
    assert caller_of([("authorization", "bearer   k1 ")]) == "k1"
    # authorization wins over x-api-key, whatever the order: a caller cannot dodge its
    # share by adding another header.
    assert caller_of([("x-api-key", "junk"), ("authorization", "Bearer k1")]) == "k1"
    assert caller_of([("authorization", "Bearer k1"), ("x-api-key", "junk")]) == "k1"
    assert caller_of([("x-api-key", "k2")]) == "k2"
    assert caller_of([("user-agent", "x")]) == ""


def test_no_more_callers_are_remembered_per_window_than_its_bound() -> None:
    # A flood presenting 64 new credentials first in each window, then every earlier one
    # again: each window held the bound plus the previous window's callers, and grew window
    # by window. Now at most the bound of new callers and as many of the last window's.
    shares = CallerShares(window_s=0.5, max_callers=64)
    for window in range(6):
        for i in [*range(64 * window, 64 * (window + 1)), *range(64 * window)]:
            shares.arrived(f"key-{i}")
        assert len(shares._current) <= 2 * 64
        shares.roll(0.5 * (window + 1))


def test_a_steady_caller_keeps_its_share_when_new_credentials_fill_the_window() -> None:
    """A flood of fresh credentials fills a window's table before a steady caller's first
    call of it: the caller, known from the last window, is still counted for itself, not
    with the flood's first calls (which are over their share)."""
    shares = CallerShares(window_s=0.5, max_callers=4)
    for _ in range(2):
        shares.arrived("a")
    for _ in range(20):
        shares.arrived("b")
    shares.roll(0.5)
    for i in range(100):
        shares.arrived(f"fresh-{i}")
    assert shares.arrived("a") is False  # before: counted as a first call, over its share
