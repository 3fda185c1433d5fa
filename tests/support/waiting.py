"""`eventually`: wait, bounded, for a condition that cannot be awaited.

Some state lives in another process or behind a background loop (a heartbeat read, a cancel
travelling through three tiers, a process exiting that is not our child). Tests poll for it here,
never with a fixed sleep: the wait ends as soon as the condition holds, and a condition that never
holds fails with a message instead of passing by luck.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_INTERVAL_S = 0.05


async def eventually(
    condition: Callable[[], T | Awaitable[T]],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    message: str = "",
) -> T:
    """Calls `condition` (plain or async) every `interval_s` until it returns something truthy,
    and returns that; raises AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]  # awaited above
        _fail_if_past(deadline, condition, timeout_s, message)
        await asyncio.sleep(interval_s)


def eventually_sync(
    condition: Callable[[], T],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    message: str = "",
) -> T:
    """`eventually` for plain test functions: blocks the thread between checks."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        _fail_if_past(deadline, condition, timeout_s, message)
        time.sleep(interval_s)


def _fail_if_past(
    deadline: float, condition: Callable[[], object], timeout_s: float, message: str
) -> None:
    """Raises AssertionError once `deadline` (time.monotonic) has passed."""
    if time.monotonic() < deadline:
        return
    what = message or getattr(condition, "__qualname__", repr(condition))
    raise AssertionError(f"not true within {timeout_s} s: {what}")


async def thread_ends(name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Waits until no thread called `name` is alive (a daemon thread let go ends on its own)."""
    await eventually(
        lambda: name not in {t.name for t in threading.enumerate()},
        timeout_s=timeout_s,
        interval_s=0.02,
        message=f"the thread {name} ended",
    )
