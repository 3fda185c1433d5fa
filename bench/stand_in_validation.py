"""`python -m bench.stand_in_validation`: the simulator's tier model against the real stack
with the GPU-speed stand-in (issue 35's validation), side by side.

The worker serves minilm as the H100 stand-in (bench.fabric.stand_in: real tokenizing,
batches that take the H100's measured time asleep), so the tiers' CPU, not the model, binds,
as on a GPU box. The simulator gets the same curve, and each tier (one gateway, one router,
one worker process) as a queue of CPU work (services/sim/tier_queues.py) whose cost per request
is measured here:

1. Start the stand-in stack (`services.local_stack`, one worker), as `make bench-fabric`'s
   stand-in phase does.
2. Calibrate what the simulator is given:
   - each tier's CPU per request, from its process's CPU seconds over `CALLERS` closed-loop
     callers of one-row requests with the validation's length mix (the costs under load,
     which are lower than one call at a time: a busy loop wakes once for several calls);
   - the hops: one-row requests one at a time, the client's latency less the worker's row
     latency, less the tiers' costs, which the simulated tier queues add back.
3. The capacity: what the planner's closed form says one process per tier serves
   (tier_costs.capacity_per_s, every process at one core), and which tier binds it; and the
   load a plan assigns this fleet, that capacity at the plan's utilization (0.7: the planner
   fills each process to 0.7 of its core, as the CPU HPAs do).
4. For each load (0.5, 0.8 and 1.0 of the planned load; of the full capacity with
   `--full-use`), the same seeded Poisson stream of one-row requests through the stack and
   through the simulator (bench/sim_validation.py's table: goodput within the SLO, p50, p99
   and their ratios; the issue's bound on goodput is 15%).

At full use the gateway's queue is at the edge of stability (its utilization 1 by
construction) and the real stack is bistable there: one run serves nearly all, the next
collapses (docs/benchmarks.md has both); the simulated process, with a core to itself and a
fixed cost per call, keeps up.

The load generator runs on the same two cores as the tiers; its CPU per request is measured
and reported, not simulated: the simulated processes have a core each.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.fabric.measure import closed_loop, wait_quiet
from bench.fabric.observe import Observer
from bench.fabric.stack import BenchStack, start_stack, write_minilm_repository
from bench.fabric.stand_in import STAND_IN_CURVE, worker_args
from bench.sim_validation import (
    HOP_CALLS,
    LENGTH_MIX,
    MODEL,
    QUIET_WAIT_S,
    WARM_UP_CALLS,
    Side,
    compare,
    conclude,
    measure_hops,
    simulate,
    text_of,
)
from bench.sim_validation import capacity_per_s as device_rows_per_s
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.sim.curve import LatencyCurve
from services.sim.fleet_config import FleetConfig
from services.sim.tier_costs import TierCpu, capacity_per_s

#: Closed-loop callers the tiers' costs are measured at (bench.fabric's stand-in figure's).
CALLERS = 64
#: Seconds of the closed loop the costs are measured over (after a third as long of warm-up).
COST_SECONDS = 10.0
#: The issue's loads, as fractions of the planned load (or of the capacity, `--full-use`).
LOADS = (0.5, 0.8, 1.0)


@dataclass(frozen=True)
class StandInCalibration:
    costs: TierCpu
    #: The load generator's CPU seconds per request (it shares the tiers' cores).
    generator_s: float
    #: Client latency less the worker's row latency and the tiers' costs, one call at a time.
    fixed_hops_s: float
    #: The same, the tiers' costs included (what one call at a time measures).
    hops_s: float
    #: The statuses of the closed loop the costs were measured over.
    statuses: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        costs = self.costs
        return {
            "gateway_ms": round(costs.gateway_s_per_request * 1e3, 3),
            "router_ms": round(costs.router_s_per_request * 1e3, 3),
            "worker_ms": round(costs.worker_s_per_request * 1e3, 3),
            "generator_ms": round(self.generator_s * 1e3, 3),
            "hops_ms": round(self.hops_s * 1e3, 3),
            "fixed_hops_ms": round(self.fixed_hops_s * 1e3, 3),
            "cost_statuses": self.statuses,
        }


def _mixed_sender(stub: api_grpc.InferenceServiceStub, seed: int) -> Any:
    """One-row requests with the validation's length mix, one after another."""
    rng = random.Random(seed)
    tokens, weights = zip(*LENGTH_MIX, strict=True)
    requests = [
        api.PredictRequest(model_name=MODEL, inputs=[api.PredictInput(text=text_of(n))])
        for n in rng.choices(tokens, weights, k=1000)
    ]
    cycle = itertools.cycle(requests)

    async def send() -> None:
        await stub.Predict(next(cycle), timeout=30.0)

    return send


async def calibrate(stub: api_grpc.InferenceServiceStub, stack: BenchStack) -> StandInCalibration:
    # A stack fresh from start-up answers its first calls slower (bench/sim_validation.py):
    # they would inflate the hops' mean.
    warm_up = _mixed_sender(stub, seed=3)
    for _ in range(WARM_UP_CALLS):
        await warm_up()
    hops_s, _ = await measure_hops(stub, stack, HOP_CALLS)
    observer = Observer(stack.pids(), stack.metrics_ports())
    run = await closed_loop(_mixed_sender(stub, seed=7), CALLERS, COST_SECONDS, observer=observer)
    # Every call answered counts, refused ones too (a refusal costs the tiers CPU as well);
    # the statuses are in the report.
    sent = run["sent_in_windows"]
    cpu: dict[str, float] = run["cpu_s"]
    worker_s = sum(seconds for name, seconds in cpu.items() if name.startswith("worker"))
    costs = TierCpu(
        gateway_s_per_request=cpu["gateway"] / sent,
        router_s_per_request=cpu["router"] / sent,
        worker_s_per_request=worker_s / sent,
        provenance=f"bench.stand_in_validation: {CALLERS} closed-loop callers, this run",
    )
    tiers_s = costs.gateway_s_per_request + costs.router_s_per_request + costs.worker_s(1.0)
    return StandInCalibration(
        costs=costs,
        generator_s=cpu["bench"] / sent,
        fixed_hops_s=max(0.0, hops_s - tiers_s),
        hops_s=hops_s,
        statuses=dict(run["statuses"]),
    )


def fleet_of(calibration: StandInCalibration) -> FleetConfig:
    """One worker of one process, one gateway, one router, their costs measured here."""
    return FleetConfig(
        workers=1,
        startup_s=0.0,
        upstream_s=calibration.fixed_hops_s * 2 / 3,
        downstream_s=calibration.fixed_hops_s / 3,
        tier_cpu=calibration.costs,
        gateways=1,
        routers=1,
        worker_processes=1,
    )


async def validate(args: argparse.Namespace, state_dir: Path) -> dict[str, Any]:
    repository = write_minilm_repository(state_dir / "repo").parent.parent
    stack = start_stack(repository, state_dir / "stack", extra_worker_args=worker_args())
    curve = LatencyCurve.load(STAND_IN_CURVE)
    try:
        async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            await wait_quiet(lambda line: print(line, flush=True), QUIET_WAIT_S)
            print("calibrating the tiers' costs and the hops ...", flush=True)
            calibration = await calibrate(stub, stack)
            capacity, binds = capacity_per_s(
                calibration.costs,
                device_rows_per_s=device_rows_per_s(curve),
                worker_processes=1,
                gateway_processes=1,
                routers=1,
            )
            planned = capacity if args.full_use else capacity * calibration.costs.utilization
            print(f"calibration {json.dumps(calibration.as_dict())}", flush=True)
            print(
                f"capacity: {capacity:.0f} requests/s ({binds} binds); loads are fractions "
                f"of {planned:.0f}/s",
                flush=True,
            )
            fleet = fleet_of(calibration)

            def simulated(rate: float, seed: int) -> tuple[Side, dict[str, Any]]:
                return simulate(curve, fleet, rate, args.duration_s, args.warmup_s, seed)

            rates = tuple(load * planned for load in args.loads)
            rows = await compare(stub, stack, rates, planned, args, simulated)
    finally:
        stack.stop()
    return {
        "calibration": calibration.as_dict(),
        "capacity_per_s": capacity,
        "binds": binds,
        "loads_of_per_s": planned,
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stand_in_validation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--loads",
        type=lambda text: tuple(float(x) for x in text.split(",")),
        default=LOADS,
        help="offered rates as fractions of the planned load (comma-separated)",
    )
    parser.add_argument(
        "--full-use",
        action="store_true",
        help="loads as fractions of the capacity at full use (utilization 1), not of the "
        "load a plan assigns the fleet",
    )
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=1, help="runs per load, each its own seed")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stand-in-validation-") as tmp:
        report = asyncio.run(validate(args, Path(tmp)))
    conclude(report, ("goodput_ratio",), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
