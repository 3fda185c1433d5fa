"""Open-loop load generation: Poisson (or bursty) arrivals, precomputed, each sent on time.

A target is `async def send() -> None` that raises on failure; the generator times each call,
records its outcome (a gRPC status code name, or the exception's class name) and how late it
left. Open loop means arrivals never wait for responses: a slow server sees a queue build, as
it would from independent users, instead of a politely slowed client (coordinated omission).

The generator shares the machine's cores with the stack it measures, so it stays lean: one
event loop, one task per request, no per-request allocation beyond the outcome record.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from inference_fabric_client.throttle import AdaptiveThrottle, is_accepted

#: A send is late when it leaves this long after its scheduled time.
LATE_THRESHOLD_S = 0.005
#: A window with a larger share of late sends measured the load generator, not the server.
MAX_LATE_FRACTION = 0.01
#: Sends start this long after the run begins, so the first one is not late by construction.
START_LEAD_S = 0.05
#: Status of a call the generator gave up on (its own timeout, or still pending at the end).
CLIENT_TIMEOUT = "CLIENT_TIMEOUT"
OK = "OK"
#: Status of a call a throttled sender refused itself, unsent (`throttled`).
THROTTLED = "THROTTLED"
#: Closed loop: a caller whose call failed waits this long before its next one, unless the
#: server said how long (a `retry-after-ms` hint, honoured up to MAX_RETRY_AFTER_S).
FAILURE_PAUSE_S = 0.02
MAX_RETRY_AFTER_S = 1.0

Send = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request: when it was due, how late it left, how long it took, how it ended."""

    #: Scheduled send time, seconds from the start of the run.
    scheduled_s: float
    #: Actual send time minus scheduled time (>= 0 up to clock resolution).
    lateness_s: float
    latency_s: float
    #: "OK", a gRPC status code name ("RESOURCE_EXHAUSTED"), CLIENT_TIMEOUT, or an exception name.
    status: str

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def late(self) -> bool:
        return self.lateness_s > LATE_THRESHOLD_S

    @property
    def response_s(self) -> float:
        """Its latency as its caller saw it: from when it was due, not when it left (a send
        the generator held back waited as long; counted from the send, the few late sends a
        valid window allows counted as good however late: coordinated omission, bench review)."""
        return self.latency_s + max(0.0, self.lateness_s)


def arrival_schedule(
    rate_per_s: float,
    duration_s: float,
    seed: int,
    max_count: int | None = None,
    burstiness: float = 1.0,
) -> list[float]:
    """Send times (seconds from start, ascending) of arrivals at `rate_per_s` on average,
    bounded by `duration_s` and `max_count`: a Poisson process at `burstiness` 1, otherwise
    gaps drawn from a gamma distribution of that shape and the same mean (vLLM's
    `benchmark_serving --burstiness`): below 1 arrivals come in clumps separated by longer
    lulls (the gaps' coefficient of variation is 1 / sqrt(burstiness): about 3.2 at 0.1),
    above 1 more evenly. Deterministic for a seed: every configuration of one run sees the same
    arrival pattern at the same rate."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    if not 0 < burstiness < math.inf:
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
    rng = random.Random(seed)
    # At 1, the draws of the Poisson process from before gamma gaps: seeded runs still compare.
    exponential, scale = burstiness == 1.0, 1.0 / (rate_per_s * burstiness)
    times: list[float] = []
    at_s = 0.0
    while True:
        at_s += rng.expovariate(rate_per_s) if exponential else rng.gammavariate(burstiness, scale)
        if at_s >= duration_s or (max_count is not None and len(times) >= max_count):
            return times
        times.append(at_s)


class Throttled(Exception):
    """A call a throttled sender refused itself, unsent."""


def status_of(error: BaseException) -> str:
    """The status an error is recorded under: gRPC's code name where there is one."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code().name
    if isinstance(error, Throttled):
        return THROTTLED
    if isinstance(error, TimeoutError):
        return CLIENT_TIMEOUT
    code = getattr(error, "code", None)  # a sync grpc.RpcError, or a peer's error with a code
    if callable(code):
        try:
            return str(code().name)
        except Exception:  # any odd `code` attribute: fall back to the class name
            pass
    return type(error).__name__


def noting_errors(send: Send, errors: list[str]) -> Send:
    """`send`, noting each failed gRPC call's status and details in `errors` (who refused it:
    an Outcome keeps the status only)."""

    async def noted() -> None:
        try:
            await send()
        except grpc.aio.AioRpcError as error:
            errors.append(f"{error.code().name}: {error.details()}")
            raise

    return noted


def throttled(send: Send, throttle: AdaptiveThrottle, rng: random.Random | None = None) -> Send:
    """`send` as the slim client sends a predict (inference_fabric_client.throttle, without
    retries): refused here, unsent (THROTTLED), with the throttle's probability; every call
    sent tells the throttle whether the gateway refused it (`is_accepted` of its status; a
    call cut short on this side, by its timeout or the end of a run, was not refused). The
    throttle's draws come from `rng` (a fresh generator without one)."""

    draw = (rng or random.Random()).random

    async def send_throttled() -> None:
        if not throttle.admits(time.monotonic(), draw()):
            raise Throttled()
        is_refused = False
        try:
            await send()
        except grpc.aio.AioRpcError as error:
            is_refused = not is_accepted(error.code().name)
            raise
        finally:
            throttle.record(time.monotonic(), accepted=not is_refused)

    return send_throttled


def retry_after_of(error: BaseException | None) -> float | None:
    """The server's `retry-after-ms` hint on a failed gRPC call, in seconds, if it sent one."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return None
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            with contextlib.suppress(ValueError):
                return int(value) / 1000.0
    return None


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection for the duration. Why: the process that generates load may
    hold torch's, grpc's and a test suite's many objects (with every test module imported, a
    full collection takes 170 ms on an idle 2-core machine), and a collection stops its event
    loop, which shows up as late sends and as latency the server never had. The garbage of a
    run (asyncio tasks, RPC errors with tracebacks) is collected once afterwards; existing
    objects are frozen first so that sweep stays short."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()
        gc.collect()


async def _timed(send: Send, timeout_s: float | None) -> tuple[float, str, BaseException | None]:
    """Runs one send; returns (latency, status, the error if it failed). Never raises except
    on cancellation."""
    start = time.monotonic()
    failure: BaseException | None = None
    try:
        if timeout_s is None:
            await send()
        else:
            # asyncio.timeout costs a timer handle, not an extra task like wait_for.
            async with asyncio.timeout(timeout_s):
                await send()
        status = OK
    except asyncio.CancelledError:
        raise
    except Exception as error:  # every failure is an outcome, not a crash
        status = status_of(error)
        failure = error
    return time.monotonic() - start, status, failure


async def run_open_loop(
    send: Send,
    schedule: Sequence[float],
    *,
    timeout_s: float | None = None,
    drain_timeout_s: float = 10.0,
    at_offsets: Sequence[tuple[float, Callable[[], Awaitable[None]]]] = (),
) -> list[Outcome]:
    """Sends at each scheduled time (seconds from start) and returns one outcome per send, in
    schedule order. `timeout_s` bounds each call on the client side; calls still pending
    `drain_timeout_s` after the last send are cancelled and recorded as CLIENT_TIMEOUT (the run
    is bounded in time as well as count). `at_offsets` are (time, coroutine function) hooks run
    concurrently at those offsets, e.g. to scrape metrics at a window boundary. The collector is
    paused for the run (`paused_gc`)."""
    with paused_gc():
        return await _open_loop(send, schedule, timeout_s, drain_timeout_s, at_offsets)


async def _open_loop(
    send: Send,
    schedule: Sequence[float],
    timeout_s: float | None,
    drain_timeout_s: float,
    at_offsets: Sequence[tuple[float, Callable[[], Awaitable[None]]]],
) -> list[Outcome]:
    loop = asyncio.get_running_loop()
    start = loop.time() + START_LEAD_S
    outcomes: list[Outcome | None] = [None] * len(schedule)

    async def one(index: int, offset: float, due: float) -> None:
        lateness = loop.time() - due  # measured when the task runs: loop congestion counts
        latency, status, _ = await _timed(send, timeout_s)
        outcomes[index] = Outcome(offset, lateness, latency, status)

    async def hook(offset_s: float, fn: Callable[[], Awaitable[None]]) -> None:
        await asyncio.sleep(max(0.0, start + offset_s - loop.time()))
        await fn()

    hooks = [asyncio.create_task(hook(offset, fn)) for offset, fn in at_offsets]
    tasks: list[asyncio.Task[None]] = []
    for index, offset in enumerate(schedule):
        due = start + offset
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        # When behind, the loop keeps creating tasks without sleeping; each task measures its
        # own lateness when it first runs, so a congested loop shows up as late sends.
        tasks.append(asyncio.create_task(one(index, offset, due)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    await asyncio.gather(*hooks)
    end = loop.time()
    return [
        o if o is not None else Outcome(s, 0.0, end - (start + s), CLIENT_TIMEOUT)
        for o, s in zip(outcomes, schedule, strict=True)
    ]


@dataclass
class ClosedLoopResult:
    """Throughput of `concurrency` callers that each send again as soon as a reply arrives."""

    concurrency: int
    elapsed_s: float
    ok: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)

    @property
    def ok_per_s(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s > 0 else 0.0


async def run_closed_loop(
    send: Send,
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.0,
    timeout_s: float | None = None,
) -> ClosedLoopResult:
    """Runs `concurrency` send loops for `warmup_s + duration_s`; counts only calls that
    finish after the warm-up. A throughput probe (secondary view): it cannot show queueing.
    The collector is paused for the run (`paused_gc`)."""
    loop = asyncio.get_running_loop()
    result = ClosedLoopResult(concurrency=concurrency, elapsed_s=duration_s)
    # The window opens once the collector is paused: its collection first can take longer
    # than a short run (hundreds of ms in a process holding a test suite, on busy cores).
    measure_from = stop_at = 0.0

    async def caller() -> None:
        while loop.time() < stop_at:
            latency, status, failure = await _timed(send, timeout_s)
            if status != OK:
                # A refusing target answers at once; without a pause (as a client backing off
                # would take) the callers spin and starve the server they share the cores
                # with. A well-behaved client waits as long as the server asked it to.
                hint_s = retry_after_of(failure)
                pause_s = FAILURE_PAUSE_S if hint_s is None else min(hint_s, MAX_RETRY_AFTER_S)
                await asyncio.sleep(pause_s)
            if loop.time() < measure_from:
                continue
            result.statuses[status] = result.statuses.get(status, 0) + 1
            if status == OK:
                result.ok += 1
                result.latencies_s.append(latency)

    with paused_gc():
        measure_from = loop.time() + warmup_s
        stop_at = measure_from + duration_s
        await asyncio.gather(*(caller() for _ in range(concurrency)))
    # Calls that were in flight at stop_at finish a little later; the window is stretched to
    # include them so the rate is not overstated.
    result.elapsed_s = max(duration_s, loop.time() - measure_from)
    return result


def split_windows(
    outcomes: Sequence[Outcome], warmup_s: float, window_s: float, num_windows: int
) -> list[list[Outcome]]:
    """Outcomes grouped into measured windows by scheduled time; warm-up sends are dropped."""
    windows: list[list[Outcome]] = [[] for _ in range(num_windows)]
    for outcome in outcomes:
        index = int((outcome.scheduled_s - warmup_s) // window_s)
        if 0 <= index < num_windows:
            windows[index].append(outcome)
    return windows
