"""A worker front killed under load, end to end: two workers with two fronts each
(`--front-processes 2`) behind the router. The front that carries the router's stream to one
worker is killed with SIGKILL while callers keep sending; the calls it held fail UNAVAILABLE
at the router, which sends them to a worker that can take them, so no caller sees a failure.
The engine restarts the front, and the worker is routed to again."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common import metric_names as names
from services.common.procfs import descendants, is_alive
from tests.support.fabric_load import ANSWERS_TIMEOUT_S, routed_to
from tests.support.fabric_load import ClosedLoopLoad as Load
from tests.support.metrics import samples, scrape, total
from tests.support.models import write_small_minilm_repository
from tests.support.stack import Stack, WorkerTier, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """SLO 30 s: this is about losing nothing when a front dies, under load two CPU cores
    cannot serve within the default 250 ms."""
    tmp_path = tmp_path_factory.mktemp("front-faults")
    repository = write_small_minilm_repository(tmp_path / "repo")
    stack = start_stack(
        tmp_path,
        num_workers=2,
        model_repository=repository,
        extra_worker_args=("--front-processes", "2"),
    )
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def fronts_of(worker: WorkerTier) -> set[int]:
    return {pid for pid in descendants(worker.pid) if is_alive(pid)}


def carrying_front(worker: WorkerTier) -> int | None:
    """The pid of a front of `worker` relaying a stream now (the router's); None while the
    gauge shows none (a stream between reconnects, or a gauge not told yet)."""
    relaying = samples(scrape(worker.metrics_port), names.WORKER_FRONT_OPEN_STREAMS)
    carriers = sorted(labels["worker_front"] for labels, value in relaying if value > 0)
    if not carriers:
        return None
    for pid in fronts_of(worker):
        if f"front-{carriers[0]}.ready.json" in Path(f"/proc/{pid}/cmdline").read_text():
            return pid
    raise AssertionError(f"front {carriers[0]} of {worker.worker_id} is not running")


async def test_a_front_killed_under_load_loses_no_request(stack: Stack) -> None:
    victim = stack.workers[1]
    assert len(fronts_of(victim)) == 2
    load = Load(stack.gateway.address, concurrency=8)
    await load.answered(30, "before the kill")
    await eventually(
        lambda: routed_to(stack, victim.worker_id) > 0,
        timeout_s=ANSWERS_TIMEOUT_S,
        message="the router sent the victim calls before the kill",
    )
    killed = await eventually(
        lambda: carrying_front(victim), timeout_s=30.0, message="a front relays the router's"
    )
    os.kill(killed, signal.SIGKILL)
    await load.answered(50, "after the kill")

    def restarted() -> bool:
        fronts = fronts_of(victim)
        restarts = total(scrape(victim.metrics_port), names.WORKER_FRONT_RESTARTS_TOTAL)
        return restarts == 1 and len(fronts) == 2 and killed not in fronts

    await eventually(restarted, timeout_s=60.0, message="the engine restarted the killed front")
    # The victim serves again: the router reconnects to its port, which a live front holds.
    routed_before = routed_to(stack, victim.worker_id)
    await eventually(
        lambda: routed_to(stack, victim.worker_id) > routed_before,
        timeout_s=ANSWERS_TIMEOUT_S,
        message="the router routed to the victim again",
    )
    await load.answered(30, "after the restart")
    results = await load.stop()
    failures = [r for r in results if r is not None]
    assert not failures, failures[:3]
    assert all(w.pid and is_alive(w.pid) for w in stack.workers)  # no engine went down


async def test_a_hung_front_is_killed_and_restarted(stack: Stack) -> None:
    """A front stopped (SIGSTOP: alive, its event loop hung, its share of the port still
    drawing connections) no longer beats (beats.beat_file): the engine kills it past
    beats.HUNG_S (15 s) and restarts it, and the worker serves through its fronts again.
    Before, a hung front lived on, orphaned: nothing but a kill by hand ended it."""
    victim = stack.workers[0]
    before = fronts_of(victim)
    assert len(before) == 2
    hung = min(before)
    os.kill(hung, signal.SIGSTOP)
    try:

        def restarted() -> bool:
            fronts = fronts_of(victim)
            restarts = total(scrape(victim.metrics_port), names.WORKER_FRONT_RESTARTS_TOTAL)
            return restarts == 1 and len(fronts) == 2 and hung not in fronts

        await eventually(restarted, timeout_s=60.0, message="the engine restarted the hung front")
    finally:
        if is_alive(hung):
            os.kill(hung, signal.SIGCONT)
    load = Load(stack.gateway.address, concurrency=8)
    routed_before = routed_to(stack, victim.worker_id)
    await load.answered(30, "after the restart")
    await eventually(
        lambda: routed_to(stack, victim.worker_id) > routed_before,
        timeout_s=ANSWERS_TIMEOUT_S,
        message="the router routed to the worker of the hung front",
    )
    results = await load.stop()
    failures = [r for r in results if r is not None]
    assert not failures, failures[:3]
