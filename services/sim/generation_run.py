"""One simulated generation run: streams into a fleet of generation workers through the real
router table, on one event loop.

Each worker heartbeats its generation record every `heartbeat_period_s` (as the real worker's
publisher does: free KV blocks, prompt tokens waiting, the moving mean step time); one router
reads the records every `refresh_period_s` into a real `RouteTable` and routes each stream by
its prompt tokens, which stay reserved until the stream ends, as the forwarder does. The
stream reaches its worker `upstream_s` later; tokens reach the client `downstream_s` after the
step that made them.

Not modelled for generation: the gateway's throttle, retries (no worker fails here),
autoscaling, draining and worker loss.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.priority import PriorityClass
from services.common.registry_schema import WorkerRecord
from services.router.routing import Reject, RouteTable
from services.sim.events import EventLoop
from services.sim.fleet_config import FleetConfig
from services.sim.generation import GenerationSpec, SimGenerationWorker, SimStream, StepCost
from services.sim.generation_results import GenerationRecorder, summarize_generation
from services.sim.traffic import Arrival, LengthMix, Traffic, schedule_arrivals

#: A stream's (model, tenant, priority): how an arrival finds its stream's output lengths.
StreamKey = tuple[str, str, str]


@dataclass(frozen=True)
class GenerationScenario:
    """Everything one generation run needs."""

    name: str
    spec: GenerationSpec
    cost: StepCost
    traffic: Traffic
    #: Output tokens (max_tokens) per stream; arrivals of other streams (a trace) draw from
    #: `default_output_lengths`.
    output_lengths: Mapping[StreamKey, LengthMix] = field(default_factory=dict)
    default_output_lengths: LengthMix = field(default_factory=lambda: LengthMix((64,), (1.0,)))
    duration_s: float = 60.0
    #: Arrivals before this are not in the summary.
    warmup_s: float = 5.0
    seed: int = 1
    #: Used: workers, upstream_s, downstream_s, heartbeat_period_s, refresh_period_s, routing.
    fleet: FleetConfig = field(default_factory=FleetConfig)
    #: After the last arrival the run goes on at most this long, so streams in flight finish.
    drain_s: float = 60.0


@dataclass
class GenerationRunResult:
    scenario: GenerationScenario
    summary: dict[str, Any]
    recorder: GenerationRecorder
    workers: list[SimGenerationWorker]
    num_events: int


class GenerationFleet:
    """Generation workers, their registry and one router on one event loop."""

    def __init__(
        self, scenario: GenerationScenario, loop: EventLoop, recorder: GenerationRecorder
    ) -> None:
        self._scenario = scenario
        self._loop = loop
        self._recorder = recorder
        config = scenario.fleet
        rng = random.Random(scenario.seed)
        self.workers = [
            SimGenerationWorker(f"g{i:04d}", scenario.spec, scenario.cost, loop, self)
            for i in range(config.workers)
        ]
        self._by_id = {worker.worker_id: worker for worker in self.workers}
        self._table = RouteTable(config.routing, random.Random(rng.random()))
        #: worker_id -> (last heartbeat record, its time): what Redis holds.
        self._registry: dict[str, tuple[WorkerRecord, float]] = {}
        # Output lengths come from their own generator, so they do not shift the arrivals.
        lengths_rng = random.Random(f"output-lengths/{scenario.seed}")
        self._lengths: dict[StreamKey, Iterator[int]] = {
            key: mix.sampler(lengths_rng) for key, mix in scenario.output_lengths.items()
        }
        self._default_lengths = scenario.default_output_lengths.sampler(lengths_rng)
        loop.every(config.heartbeat_period_s, self._heartbeat, start_s=0.0)
        offset_s = rng.uniform(0, config.refresh_period_s)
        loop.every(config.refresh_period_s, self._refresh, start_s=offset_s)

    def _heartbeat(self, now_s: float, _: object) -> None:
        for worker in self.workers:
            self._registry[worker.worker_id] = (worker.record(now_s), now_s)

    def _refresh(self, now_s: float, _: object) -> None:
        self._table.update(list(self._registry.values()), now_s)

    # -- a stream's path -------------------------------------------------------------------

    def arrive(self, now_s: float, arrival: Arrival) -> None:
        self._recorder.arrived(now_s)
        spec = self._scenario.spec
        key = (arrival.model, arrival.tenant, arrival.priority)
        num_output_tokens = next(self._lengths.get(key, self._default_lengths))
        timeout_s = spec.default_timeout_s if arrival.timeout_s is None else arrival.timeout_s
        stream = SimStream(arrival, num_output_tokens, now_s + timeout_s)
        decision = self._table.route(
            spec.name,
            spec.version,
            arrival.num_tokens,
            timeout_s,
            now_s,
            is_batch=_is_batch(arrival.priority),
        )
        if isinstance(decision, Reject):
            self._recorder.refused(now_s, f"router_{decision.reason.value}")
            return
        stream.worker_id = decision.worker_id
        stream.reservation_id = decision.reservation_id
        self._loop.at(now_s + self._scenario.fleet.upstream_s, self._at_worker, stream)

    def _at_worker(self, now_s: float, stream: SimStream) -> None:
        reason = self._by_id[stream.worker_id].submit(stream, now_s)
        if reason is not None:
            self._table.release(stream.reservation_id)
            self._recorder.refused(stream.arrival.at_s, f"worker_{reason}")

    # -- StreamSink ------------------------------------------------------------------------

    def tokens(self, now_s: float, num_tokens: int) -> None:
        self._recorder.tokens(now_s, num_tokens)

    def done(self, now_s: float, stream: SimStream, outcome: str) -> None:
        self._table.release(stream.reservation_id)
        if outcome == "ok":
            self._recorder.finished(stream, downstream_s=self._scenario.fleet.downstream_s)
        else:
            self._recorder.refused(stream.arrival.at_s, f"worker_{outcome}")


def run_generation(scenario: GenerationScenario) -> GenerationRunResult:
    """Runs `scenario` to its end, then up to `drain_s` more for the streams in flight."""
    started = time.perf_counter()
    loop = EventLoop()
    recorder = GenerationRecorder(
        ttft_slo_s=scenario.spec.ttft_slo_s,
        warmup_s=scenario.warmup_s,
        duration_s=scenario.duration_s,
    )
    fleet = GenerationFleet(scenario, loop, recorder)
    schedule_arrivals(
        loop, fleet.arrive, scenario.traffic.arrivals(scenario.seed, scenario.duration_s)
    )
    loop.run(scenario.duration_s)
    # Heartbeats never stop: drain in slices (the first also lands streams still on their
    # hop), until no stream is left or drain_s is spent.
    end_s = scenario.duration_s + scenario.drain_s
    while loop.now_s < end_s:
        loop.run(min(loop.now_s + 1.0, end_s))
        if not any(w.num_streams for w in fleet.workers):
            break
    summary = summarize_generation(
        recorder, fleet.workers, wall_s=time.perf_counter() - started, num_events=loop.num_events
    )
    summary["scenario"] = scenario.name
    summary["mode"] = scenario.spec.mode
    return GenerationRunResult(scenario, summary, recorder, fleet.workers, loop.num_events)


@functools.cache
def _is_batch(priority: str) -> bool:
    """Batch-class streams wait behind every other class (the router's `is_batch`)."""
    return PriorityClass.parse(priority) is PriorityClass.BATCH
