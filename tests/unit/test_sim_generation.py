"""The simulated generation worker drives the real `GenerationScheduler` as the engine does: its
steps equal a scheduler driven by hand on the same arrivals; a stream's latencies are its steps
plus the hops; continuous batching beats static on mixed lengths; KV exhaustion preempts and
over-large requests are refused as the scheduler decides; runs are reproducible; the scenario
form and the command line. (That it imports no asyncio or gRPC is checked in a fresh interpreter,
in tests/integration/test_sim_processes.py.)"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from services.gpu_worker.generation.first_token import FIRST_TOKEN_DEADLINE, STANDING_QUEUE
from services.gpu_worker.generation.scheduler import GenerationScheduler
from services.gpu_worker.generation.sequence import SchedulerOutput, Sequence
from services.sim.__main__ import main
from services.sim.events import EventLoop
from services.sim.fleet_config import FleetConfig
from services.sim.generation import (
    GenerationSpec,
    SimGenerationWorker,
    SimStream,
    StepCost,
)
from services.sim.generation_run import GenerationScenario, run_generation
from services.sim.scenario import load_scenario, parse_generation_scenario
from services.sim.traffic import Arrival, LengthMix, Traffic

pytestmark = pytest.mark.unit

SCENARIOS = Path(__file__).resolve().parents[2] / "services" / "sim" / "scenarios"
COST = StepCost(
    fixed_s=0.002, per_prefill_token_s=1e-5, per_decode_seq_s=1e-4, per_context_token_s=1e-6
)


def make_spec(**overrides: Any) -> GenerationSpec:
    fields: dict[str, Any] = {"max_model_len": 256, "block_size": 4, "num_kv_blocks": 64}
    fields.update(overrides)
    return GenerationSpec(**fields)


def make_arrival(at_s: float, *, num_tokens: int, priority: str = "interactive") -> Arrival:
    return Arrival(at_s, "llm", "t", priority, num_tokens)


class Sink:
    """Records what a worker reports."""

    def __init__(self) -> None:
        self.ended: list[tuple[float, SimStream, str]] = []
        self.num_tokens = 0

    def tokens(self, now_s: float, num_tokens: int) -> None:
        self.num_tokens += num_tokens

    def done(self, now_s: float, stream: SimStream, outcome: str) -> None:
        self.ended.append((now_s, stream, outcome))


def drive_worker(
    arrivals: list[tuple[Arrival, int]], spec: GenerationSpec, *, deadline_s: float = 1e9
) -> tuple[SimGenerationWorker, Sink, list[str]]:
    """Submits (arrival, output tokens) pairs to one worker at their times; runs to the end."""
    loop = EventLoop()
    sink = Sink()
    worker = SimGenerationWorker("w", spec, COST, loop, sink, keep_steps=True)
    refusals: list[str] = []

    def submit(now_s: float, stream: SimStream) -> None:
        reason = worker.submit(stream, now_s)
        if reason is not None:
            refusals.append(reason)

    for arrival, num_output in arrivals:
        loop.at(arrival.at_s, submit, SimStream(arrival, num_output, arrival.at_s + deadline_s))
    loop.run(1e4)
    return worker, sink, refusals


def make_scenario(
    trace: tuple[Arrival, ...], *, output_tokens: int, **overrides: Any
) -> GenerationScenario:
    fields: dict[str, Any] = {
        "name": "g",
        "spec": make_spec(),
        "cost": COST,
        "traffic": Traffic(trace=trace),
        "default_output_lengths": LengthMix((output_tokens,), (1.0,)),
        "duration_s": 5.0,
        "warmup_s": 0.0,
        "fleet": FleetConfig(workers=1, upstream_s=0.002, downstream_s=0.001),
    }
    fields.update(overrides)
    return GenerationScenario(**fields)


# -- latencies on simulated time ------------------------------------------------------------


def test_a_lone_streams_ttft_is_its_prefill_step_plus_the_hops_exactly() -> None:
    # At 1 s the router has read a heartbeat; the worker is idle.
    scenario = make_scenario((make_arrival(1.0, num_tokens=100),), output_tokens=5)
    result = run_generation(scenario)
    (outcome,) = result.recorder.outcomes
    prefill_s = 0.002 + 100 * 1e-5 + 100 * 1e-6
    # Decode k (k = 1..4) computes position 99 + k: its context is 100 + k tokens.
    decodes_s = [0.002 + 1e-4 + (100 + k) * 1e-6 for k in range(1, 5)]
    assert outcome.ttft_s == pytest.approx(0.002 + prefill_s + 0.001, abs=1e-12)
    assert outcome.tpot_s == pytest.approx(sum(decodes_s) / 4, abs=1e-12)
    assert outcome.e2e_s == pytest.approx(0.003 + prefill_s + sum(decodes_s), abs=1e-12)
    assert outcome.num_output_tokens == 5
    assert result.summary["steps"] == 5
    assert result.summary["refusals"] == {}


def test_a_long_prompt_prefills_in_chunks_of_the_token_budget_before_its_first_token() -> None:
    spec = make_spec(max_num_batched_tokens=64)
    scenario = make_scenario((make_arrival(1.0, num_tokens=150),), output_tokens=1, spec=spec)
    (outcome,) = run_generation(scenario).recorder.outcomes
    # Chunks of 64, 64 and 22 tokens, each attending to everything computed so far.
    chunks_s = [0.002 + n * 1e-5 + end * 1e-6 for n, end in ((64, 64), (64, 128), (22, 150))]
    assert outcome.ttft_s == pytest.approx(0.003 + sum(chunks_s), abs=1e-12)
    assert outcome.tpot_s is None


# -- parity with the scheduler driven by hand -----------------------------------------------


def step_seconds(output: SchedulerOutput) -> float:
    """The cost model written out: a decode is one new token after cached context."""
    num_prefill = num_decode = num_context = 0
    for item in output.scheduled:
        is_decode = len(item.token_ids) == 1 and item.start_position > 0
        num_decode += is_decode
        num_prefill += 0 if is_decode else len(item.token_ids)
        num_context += item.start_position + len(item.token_ids)
    return (
        COST.fixed_s
        + COST.per_prefill_token_s * num_prefill
        + COST.per_decode_seq_s * num_decode
        + COST.per_context_token_s * num_context
    )


def hand_driven_steps(arrivals: list[tuple[Arrival, int]], spec: GenerationSpec) -> list[Any]:
    """The engine's loop in plain code: add what has arrived, schedule, step, sample one
    token per sampling sequence, finish those at max_tokens; sleep to the next arrival."""
    scheduler = GenerationScheduler(spec.scheduler_config())
    pending = deque(arrivals)
    max_tokens: dict[int, int] = {}
    steps: list[Any] = []
    now_s, seq_id = 0.0, 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][0].at_s <= now_s:
            arrival, num_output = pending.popleft()
            seq_id += 1
            max_tokens[seq_id] = num_output
            prompt = (1,) * arrival.num_tokens
            scheduler.add(Sequence(seq_id, prompt, num_output, priority=1, tenant="t",
                                   arrival_s=arrival.at_s))  # fmt: skip
        output = scheduler.schedule()
        if not output.scheduled:
            now_s = pending[0][0].at_s
            continue
        end_s = now_s + step_seconds(output)
        scheduler.update_from_output({s.seq_id: 1 for s in output.scheduled if s.samples})
        for item in output.scheduled:
            seq = scheduler.get(item.seq_id)
            if (
                item.samples
                and seq is not None
                and len(seq.output_token_ids) >= max_tokens[item.seq_id]
            ):
                scheduler.finish(item.seq_id)
        work = tuple((s.seq_id, len(s.token_ids)) for s in output.scheduled)
        steps.append((now_s, end_s, work, output.preempted))
        now_s = end_s
    return steps


def random_arrivals(seed: int, num: int) -> list[tuple[Arrival, int]]:
    """Poisson arrivals faster than one worker serves, mixed prompt and output lengths."""
    rng = random.Random(seed)
    at_s, out = 0.0, []
    for _ in range(num):
        at_s += rng.expovariate(300.0)
        prompt = rng.choice((5, 12, 40, 90))
        out.append((make_arrival(at_s, num_tokens=prompt), rng.choice((3, 8, 30, 60))))
    return out


@pytest.mark.parametrize("mode", ["continuous", "static"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_simulated_steps_equal_the_scheduler_driven_by_hand(mode: str, seed: int) -> None:
    # A small cache and token budget: chunked prefills and preemptions happen.
    spec = make_spec(mode=mode, num_kv_blocks=40, max_num_batched_tokens=48, max_num_seqs=6)
    arrivals = random_arrivals(seed, 40)
    worker, sink, refusals = drive_worker(arrivals, spec)
    expected = hand_driven_steps(arrivals, spec)
    actual = [(s.start_s, s.end_s, s.work, s.preempted) for s in worker.steps]
    assert refusals == []
    assert [a[2:] for a in actual] == [e[2:] for e in expected]
    times = [t for step in actual for t in step[:2]]
    assert times == pytest.approx([t for step in expected for t in step[:2]], abs=1e-9)
    assert any(step.preempted for step in worker.steps)
    assert any(n > 1 and n < 48 for s in worker.steps for _, n in s.work)
    assert sorted(s.num_emitted for _, s, _ in sink.ended) == sorted(n for _, n in arrivals)


# -- KV blocks, refusals and deadlines ------------------------------------------------------


def test_kv_exhaustion_preempts_and_every_stream_still_gets_all_its_tokens() -> None:
    # 8 blocks of 4 slots: two 10-token prompts fit (3 blocks each); grown to 30 tokens they
    # need 8 blocks each, so the later one is preempted and recomputed.
    spec = make_spec(num_kv_blocks=8)
    arrivals = [(make_arrival(0.001 * i, num_tokens=10), 20) for i in range(1, 4)]
    worker, sink, refusals = drive_worker(arrivals, spec)
    assert refusals == []
    assert worker.num_preemptions > 0
    assert [s.num_emitted for _, s, _ in sink.ended] == [20, 20, 20]
    assert sum(s.num_preemptions for _, s, _ in sink.ended) == worker.num_preemptions
    assert worker.scheduler.num_free_blocks == 8


def test_requests_the_scheduler_can_never_run_are_refused_with_its_reasons() -> None:
    spec = make_spec(num_kv_blocks=8, max_model_len=64)
    trace = (make_arrival(1.0, num_tokens=30), make_arrival(1.1, num_tokens=60))
    # 30 + 8 tokens need 10 blocks of the 8 there are; 60 + 8 exceed max_model_len.
    summary = run_generation(make_scenario(trace, output_tokens=8, spec=spec)).summary
    assert summary["refusals"] == {"worker_exceeds_kv_cache": 1, "worker_too_long": 1}
    assert summary["answered"] == 0


def test_a_busy_worker_refuses_a_stream_predicted_to_miss_its_first_token_limit() -> None:
    spec = make_spec(shed_past_slo=True, ttft_slo_s=0.005)
    arrivals = [(make_arrival(0.0, num_tokens=10), 50), (make_arrival(0.001, num_tokens=10), 5)]
    _, sink, refusals = drive_worker(arrivals, spec)
    # Idle, the first is admitted; behind it, one step of the 10 ms starting mean is too late.
    assert refusals == [FIRST_TOKEN_DEADLINE]
    assert [s.num_emitted for _, s, _ in sink.ended] == [50]


def test_a_stream_past_its_deadline_is_cancelled_and_its_blocks_freed() -> None:
    spec = make_spec()
    arrivals = [(make_arrival(0.0, num_tokens=10), 200)]
    worker, sink, _ = drive_worker(arrivals, spec, deadline_s=0.05)
    ((ended_s, stream, outcome),) = sink.ended
    assert (ended_s, outcome) == (0.05, "expired")
    assert 0 < stream.num_emitted < 200
    assert not worker.scheduler.has_unfinished()
    assert worker.scheduler.num_free_blocks == spec.num_kv_blocks
    # The step in flight at the deadline ran; none after it.
    assert worker.steps[-1].start_s < 0.05 <= worker.steps[-1].end_s


# -- modes, fleets, reproducibility ---------------------------------------------------------


def shipped(mode: str, **overrides: Any) -> GenerationScenario:
    scenario = load_scenario(SCENARIOS / f"generation_{mode}.toml")
    assert isinstance(scenario, GenerationScenario)
    return dataclasses.replace(scenario, **overrides)


def test_the_two_shipped_scenarios_differ_only_in_mode() -> None:
    continuous, static = shipped("continuous"), shipped("static")
    assert (continuous.spec.mode, static.spec.mode) == ("continuous", "static")
    same = dataclasses.replace(static, name=continuous.name, spec=continuous.spec)
    assert same == continuous


def test_continuous_batching_beats_static_on_mixed_lengths() -> None:
    continuous = run_generation(shipped("continuous", duration_s=20.0, warmup_s=5.0)).summary
    static = run_generation(shipped("static", duration_s=20.0, warmup_s=5.0)).summary
    assert continuous["offered_per_s"] == static["offered_per_s"]
    # Static batches serve less than is offered; continuous ones keep up.
    assert continuous["output_tokens_per_s"] > 1.1 * static["output_tokens_per_s"]
    assert continuous["ttft_ms"]["p99"] < static["ttft_ms"]["p50"]
    assert continuous["goodput_per_s"] > 1.5 * static["goodput_per_s"]
    assert continuous["refusals"] == {}  # its waiting queue never stands
    # Static batches' queue stands: online streams are refused or dropped unrun, and those
    # served see their first token within the SLO (p99 3.1 s here before the rule, 1.4 s after).
    assert set(static["refusals"]) == {f"worker_{STANDING_QUEUE}"}
    assert static["ttft_ms"]["p99"] <= 1000 * shipped("static").spec.ttft_slo_s


def test_a_fleet_spreads_streams_over_its_workers_through_the_router() -> None:
    scenario = shipped("continuous", duration_s=6.0, warmup_s=1.0)
    scenario = dataclasses.replace(scenario, fleet=dataclasses.replace(scenario.fleet, workers=2))
    result = run_generation(scenario)
    assert all(w.num_steps > 0 for w in result.workers)
    assert result.summary["refusals"] == {}
    assert result.summary["unfinished"] == 0


def test_a_run_is_reproducible_for_a_seed() -> None:
    def summary(seed: int) -> dict[str, Any]:
        out = run_generation(shipped("static", duration_s=8.0, warmup_s=1.0, seed=seed)).summary
        out.pop("wall_s")
        return out

    first = summary(3)
    assert summary(3) == first
    assert summary(4) != first


# -- the scenario form and the command line -------------------------------------------------


def raw_scenario(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "generation": {"mode": "static", "step_cost": {"fixed_ms": 2.0}},
        "traffic": {"streams": [{"rate_per_s": 5, "output_lengths": [[4, 1.0]]}]},
    }
    raw.update(overrides)
    return raw


def test_a_generation_table_parses_into_a_generation_scenario() -> None:
    raw = raw_scenario()
    raw["generation"].update(ttft_slo_ms=500, num_kv_blocks=99)
    scenario = parse_generation_scenario(raw, base_dir=Path("."), default_name="x")
    assert scenario.spec.scheduler_config().is_static
    assert scenario.spec.ttft_slo_s == 0.5
    assert scenario.spec.scheduler_config().num_blocks == 99
    assert scenario.cost == StepCost(fixed_s=0.002)
    assert scenario.output_lengths == {("llm", "default", "interactive"): LengthMix((4,), (1.0,))}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"generation": {"mode": "dynamic", "step_cost": {"fixed_ms": 1}}}, "mode"),
        ({"generation": {"step_cost": {"fixed_ms": 1, "per_token_us": 1}}}, "per_token_us"),
        ({"generation": {"max_num_seqs": 4}}, "step_cost"),
        ({"fleet": {"cell_size": 4}}, "cell_size"),
        ({"hpa": {"metric": "cpu"}}, "hpa"),
    ],
)
def test_a_bad_generation_scenario_is_refused_naming_the_problem(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_generation_scenario(raw_scenario(**overrides), base_dir=Path("."), default_name="x")


def test_the_command_line_runs_a_generation_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(SCENARIOS / "generation_continuous.toml")
    assert main(["run", path, "--duration-s", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "TTFT p50 / p99 (ms)" in out and "output tokens/s" in out
    assert (tmp_path / "summary.json").exists()
    assert (tmp_path / "streams.csv").read_text().startswith("arrival_s,prompt_tokens")
    assert main(["plan", path]) == 2


def test_a_flood_is_refused_and_dropped_as_the_engine_does_and_a_quiet_tenant_served() -> None:
    """The simulated worker applies the engine's standing-queue rule (standing_shedding): one
    tenant's flood past two seats stands its queue, is refused at admission and dropped unrun
    once it waited past the SLO; a tenant sending one stream every 250 ms is served whole."""
    spec = make_spec(max_num_seqs=2, ttft_slo_s=0.3)
    flood = [(Arrival(i * 0.005, "llm", "flood", "interactive", 10), 32) for i in range(400)]
    quiet = [(Arrival(0.05 + i * 0.25, "llm", "quiet", "interactive", 10), 32) for i in range(8)]
    _, sink, refusals = drive_worker(sorted(flood + quiet, key=lambda a: a[0].at_s), spec)

    assert refusals and set(refusals) == {STANDING_QUEUE}
    outcomes = {(s.arrival.tenant, outcome) for _, s, outcome in sink.ended}
    assert outcomes == {("flood", "ok"), ("flood", STANDING_QUEUE), ("quiet", "ok")}
    served_quietly = [s.num_emitted for _, s, _ in sink.ended if s.arrival.tenant == "quiet"]
    assert served_quietly == [32] * 8
