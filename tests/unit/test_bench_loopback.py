"""bench.loopback's reading of a process's context switches (bench.server_calls reports them)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from bench.loopback import switches_between, thread_switches

pytestmark = pytest.mark.unit


def test_switches_are_counted_by_thread_the_main_ones_apart() -> None:
    """Each sleep is a voluntary switch of the thread that sleeps: 20 of a helper thread's count
    among the others', 10 of this (main) thread's as its own."""
    slept, stop = threading.Event(), threading.Event()

    def sleeper() -> None:
        for _ in range(20):
            time.sleep(0.001)
        slept.set()
        stop.wait()

    before = thread_switches(os.getpid())
    helper = threading.Thread(target=sleeper)
    helper.start()
    try:
        assert slept.wait(10)
        for _ in range(10):
            time.sleep(0.001)
        after = thread_switches(os.getpid())
    finally:
        stop.set()
        helper.join()
    main, others = switches_between(os.getpid(), before, after)
    assert others >= 20
    assert main >= 10


def test_a_thread_gone_between_two_readings_is_left_out_and_a_new_one_counts_from_zero() -> None:
    before = {100: 50, 101: 1_000, 102: 7}  # 101 ends; 103 begins
    after = {100: 60, 102: 9, 103: 4}
    assert switches_between(100, before, after) == (10, 2 + 4)
