"""The outputs of one caller's rows on the batching driver, filled in as their batches finish."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np


class SliceOutputs:
    """The outputs of one caller's rows (a slice, or a request of its own), filled in as their
    batches finish. `future` resolves to them all, in the caller's order, once the last is
    in, or fails with the first failure among them, and then `on_failed` runs at once (the
    driver withdraws the caller's rows still queued: their outputs would go nowhere). One
    future a caller, not a row: a bundle's wait, its cancels and its answer touch each caller
    once."""

    __slots__ = ("_left", "_outputs", "future", "on_failed")

    def __init__(self, future: asyncio.Future[list[np.ndarray]], num_rows: int) -> None:
        self.future = future
        self._outputs: list[np.ndarray | None] = [None] * num_rows
        self._left = num_rows
        self.on_failed: Callable[[], None] | None = None
        if num_rows == 0:
            future.set_result([])

    def is_answered(self, index: int) -> bool:
        """Whether row `index` has its output, or will get none (the caller's answer is set)."""
        return self._outputs[index] is not None or self.future.done()

    def answer(self, index: int, output: np.ndarray) -> None:
        """Row `index`'s output; the last one resolves the future."""
        if self.is_answered(index):
            return
        self._outputs[index] = output
        self._left -= 1
        if self._left == 0:
            self.future.set_result(self._outputs)  # type: ignore[arg-type]  # none is None

    def fail(self, error: BaseException) -> None:
        """Fails the caller's rows with `error`, unless its answer is already set."""
        if self.future.done():
            return
        self.future.set_exception(error)
        if self.on_failed is not None:
            self.on_failed()
