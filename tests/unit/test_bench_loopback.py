"""bench.loopback's reading of a process's context switches (bench.server_calls reports them)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from bench.loopback import thread_switches

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

    main_before, others_before = thread_switches(os.getpid())
    helper = threading.Thread(target=sleeper)
    helper.start()
    try:
        assert slept.wait(10)
        for _ in range(10):
            time.sleep(0.001)
        main_after, others_after = thread_switches(os.getpid())
    finally:
        stop.set()
        helper.join()
    assert others_after - others_before >= 20
    assert main_after - main_before >= 10
