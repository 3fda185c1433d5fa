"""SparseLog: a recurring event at most once a period per key, the ones left out counted."""

from __future__ import annotations

import logging

import pytest

from services.common import sparse_log
from services.common.sparse_log import SparseLog

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_key_is_logged_once_a_period_and_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fault that fails every call (1,000 here within one period) wrote a line each; it
    writes one, and the next, a period on, says how many were left out."""
    clock, logger = Clock(), logging.getLogger("sparse-test")
    sparse = SparseLog(logger, period_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="sparse-test"):
        for _ in range(1_000):
            sparse.warning("w1", "worker %s unavailable", "w1")
        sparse.warning("w2", "worker %s unavailable", "w2")  # another key: its own line
        clock.now_s = 10.0
        sparse.warning("w1", "worker %s unavailable", "w1")
        clock.now_s = 30.0
        sparse.error("w1", "worker %s unavailable", "w1")
    assert [r.getMessage() for r in caplog.records] == [
        "worker w1 unavailable",
        "worker w2 unavailable",
        "worker w1 unavailable (999 more like it in the last 10s)",
        "worker w1 unavailable",
    ]
    assert caplog.records[-1].levelno == logging.ERROR


def test_keys_quiet_for_a_period_are_dropped_past_max_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sparse_log, "MAX_KEYS", 4)
    clock = Clock()
    sparse = SparseLog(logging.getLogger("sparse-test"), period_s=1.0, clock=clock)
    for key in range(4):
        sparse.warning(key, "k")
    clock.now_s = 5.0
    sparse.warning("new", "k")
    assert list(sparse._last) == ["new"]
