"""Cancelling a generation mid-stream in a test without racing the generation's end.

A test cancels a generation once it runs (its first token arrived, or the worker reports it
running). On a loaded machine the way there can take longer than the rest of the generation:
400 tokens of tiny-llama take about half a second. The first token's trip to the client most
likely took longer once in CI, as it did in 2-6 attempts in 200 here, with three to six busy
loops beside the stack on two cores: the worker had generated every token before the
client's cancel reached it. A cancel that arrives after the last token stops nothing, so
that attempt shows nothing either way: it is tried again. A cancel that never reaches the
worker fails every attempt; one lost only now and then would pass on a later attempt.

Attempts go on for PATIENCE_S rather than a fixed count. CI once lost three attempts in a
row (at 10b0f6e), while here 70 in 70 won, 40 of them with four busy loops beside the
stack: the load that delays a cancel comes in spells (another module's stack starting takes
30-40 s of both cores), and attempts must outlast one.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable

from services.common import metric_names as names
from tests.support.waiting import eventually

#: Seconds of attempts (at least one) before the test fails because no cancel beat its
#: generation's end.
PATIENCE_S = 60.0
#: Seconds between attempts, so that they spread over a spell of load rather than fill it.
PAUSE_S = 1.0


async def cancel_before_the_end(
    start_and_cancel: Callable[[], Awaitable[None]],
    worker_total: Callable[[str], float],
    *,
    timeout_s: float = 30.0,
) -> int:
    """Runs `start_and_cancel` (one generation started, then cancelled mid-stream) until the
    worker counts its sequence cancelled rather than finished, for at most PATIENCE_S; returns
    the attempts it took. `worker_total(name)`: the worker's metric `name`, summed over its
    labels. Each attempt waits, bounded by `timeout_s` (the cancel crosses every tier), for
    one of the two outcomes."""
    give_up_at = time.monotonic() + PATIENCE_S
    attempt = 0
    while attempt == 0 or time.monotonic() < give_up_at:
        if attempt:
            await asyncio.sleep(PAUSE_S)
        attempt += 1
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
        f"each of {attempt} generations in {PATIENCE_S:.0f}s finished before its cancel"
        " reached the worker"
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
