"""A recurring event logged at most once a period per key, the ones left out counted in the
next line: ordinary outcomes on a per-call path (a retry, a refusal) or a per-period one (a
refresh that keeps failing) flooded the log at the call rate, or twice a second, for as long as
a fault lasted, each line costing the event loop that is the bottleneck then (review finding).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

#: Keys kept before those quiet for a period are dropped (a worker id's, a model version's).
MAX_KEYS = 1024


class SparseLog:
    """`warning` / `error` / `exception` of `logger`, each key at most once per `period_s`."""

    def __init__(
        self,
        logger: logging.Logger,
        period_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._period_s = period_s
        self._clock = clock
        #: By key: when it was last logged, and how many were left out since.
        self._last: dict[Hashable, tuple[float, int]] = {}

    def warning(self, key: Hashable, message: str, *args: Any) -> None:
        self._log(logging.WARNING, key, message, args)

    def error(self, key: Hashable, message: str, *args: Any) -> None:
        self._log(logging.ERROR, key, message, args)

    def exception(self, key: Hashable, message: str, *args: Any) -> None:
        self._log(logging.ERROR, key, message, args, exc_info=True)

    def failure(self, key: Hashable, error: BaseException, message: str, *args: Any) -> None:
        """`error` logged with its traceback (one caught earlier, not the one being handled)."""
        self._log(logging.ERROR, key, message, args, exc_info=error)

    def _log(
        self,
        level: int,
        key: Hashable,
        message: str,
        args: tuple[Any, ...],
        exc_info: bool | BaseException = False,
    ) -> None:
        now_s, last = self._clock(), self._last.get(key)
        if last is not None and now_s - last[0] < self._period_s:
            self._last[key] = (last[0], last[1] + 1)
            return
        if last is None and len(self._last) >= MAX_KEYS:
            self._last = {k: v for k, v in self._last.items() if now_s - v[0] < self._period_s}
        self._last[key] = (now_s, 0)
        if last is not None and last[1]:
            message += f" ({last[1]} more like it in the last {now_s - last[0]:.0f}s)"
        self._logger.log(level, message, *args, exc_info=exc_info)
