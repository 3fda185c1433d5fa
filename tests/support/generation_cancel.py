"""Cancelling a generation mid-stream in a test without racing the generation's end.

A test cancels a generation once it runs (its first token arrived, or the worker reports it
running). On a loaded machine the way there can take longer than the rest of the generation:
400 tokens of tiny-llama take about half a second. The first token's trip to the client most
likely took longer once in CI, as it did in 2-6 attempts in 200 here, with three to six busy
loops beside the stack on two cores: the worker had generated every token before the
client's cancel reached it. A cancel that arrives after the last token stops nothing, so
that attempt shows nothing either way: it is tried again. A cancel that never reaches the
worker fails every attempt; one lost only now and then would pass on a later attempt.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from services.common import metric_names as names
from tests.support.waiting import eventually

#: Attempts made before the test fails because no cancel beat its generation's end.
ATTEMPTS = 3


async def cancel_before_the_end(
    start_and_cancel: Callable[[], Awaitable[None]],
    worker_total: Callable[[str], float],
    *,
    timeout_s: float = 30.0,
) -> int:
    """Runs `start_and_cancel` (one generation started, then cancelled mid-stream) until the
    worker counts its sequence cancelled rather than finished, at most ATTEMPTS times; returns
    the attempts it took. `worker_total(name)`: the worker's metric `name`, summed over its
    labels. Each attempt waits, bounded by `timeout_s` (the cancel crosses every tier), for
    one of the two outcomes."""
    for attempt in range(1, ATTEMPTS + 1):
        cancelled = worker_total(names.GENERATION_CANCELLED_TOTAL)
        finished = worker_total(names.GENERATION_FINISHED_TOTAL)
        await start_and_cancel()
        ended = await eventually(
            functools.partial(_outcome, worker_total, cancelled, finished),
            timeout_s=timeout_s,
            message="the sequence neither finished nor was cancelled",
        )
        if ended == "cancelled":
            assert worker_total(names.GENERATION_CANCELLED_TOTAL) == cancelled + 1
            return attempt
    raise AssertionError(
        f"each of {ATTEMPTS} generations finished before its cancel reached the worker"
    )


def _outcome(worker_total: Callable[[str], float], cancelled: float, finished: float) -> str | None:
    """How the attempt's sequence ended, from the counters read before it started (None: not
    yet). The two are exclusive for one sequence; cancelled is checked first so that another
    sequence finishing meanwhile cannot hide this one's cancel."""
    if worker_total(names.GENERATION_CANCELLED_TOTAL) > cancelled:
        return "cancelled"
    if worker_total(names.GENERATION_FINISHED_TOTAL) > finished:
        return "finished"
    return None
