"""The event loop a tier's process runs on: uvloop by default, asyncio's own on request.

Every call a tier serves is a chain of event-loop callbacks: grpc.aio's completions, the
handler's task, its futures and timers, a stream's writer. asyncio's loop runs each in Python
(`Handle._run`, `call_soon`, its timer heap); uvloop (libuv, in Cython) runs them in C, as
vLLM's API server does. Measured with `python -m bench.server_calls bare stages door`, three
alternations of whole runs in one session (server CPU a call): a bare grpc.aio echo 536-588
-> 465-498 us, the gateway's stages 623-698 -> 542-639 us, the stages behind the door 684-757
-> 622-684 us (9-15% less); the stand-in worker's CPU a bundle (`python -m
bench.worker_feed --sizes 1,16`) 2,792-2,844 -> 2,252-2,682 us at 16 rows, about the same at
one row.

What differs for the code (checked where the tiers read the loop's clock or wait on it):
- `loop.time()` counts whole milliseconds, so durations measured within a process use
  `time.monotonic()` (services.common.loop_lag, the door's probe, the streams' gaps);
- a timer is rounded to the nearest millisecond of a clock that counts whole ones, so it may
  fire up to about 1.5 ms before it is due, and one under half a millisecond runs at once:
  nothing may take a timer's firing as proof that its time has passed (deadline timers end a
  call up to that much early, inside the router's and worker's slack), and a loop that waits
  for a time under a millisecond away waits a whole one (the worker's batching driver), or it
  would spin until it is due; a stream's 1 ms write linger lasts 0-1 ms.

The gateway, the router and the worker (its fronts too) take `--event-loop asyncio` to run
asyncio's loop instead, as does a machine where uvloop cannot be imported (logged). The jobs
runner, a client of the gateway, stays on asyncio's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The loops a tier may run on, the default first.
EVENT_LOOPS = ("uvloop", "asyncio")


def parse_event_loop(text: str) -> str:
    """One of EVENT_LOOPS, any case."""
    value = text.strip().lower()
    if value not in EVENT_LOOPS:
        raise ValueError(f"expected one of {', '.join(EVENT_LOOPS)}, got {text!r}")
    return value


def run(main: Coroutine[Any, Any, _T], event_loop: str = EVENT_LOOPS[0]) -> _T:
    """Runs `main` to completion on a new loop of kind `event_loop`, as asyncio.run does."""
    if event_loop == "uvloop":
        try:
            import uvloop
        except ImportError as error:
            log.warning("uvloop cannot be imported (%s): running on asyncio's event loop", error)
        else:
            log.info("running on uvloop's event loop")
            return uvloop.run(main)
    log.info("running on asyncio's event loop")
    return asyncio.run(main)
