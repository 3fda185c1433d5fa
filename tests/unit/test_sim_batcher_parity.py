"""The simulated worker drives the real `Batcher` as a worker's driver does: on the same
arrival sequence, a `Batcher` driven directly here makes the same dispatch decisions (same
batches, same instants, same close reasons) as the one inside `SimWorker`.

The direct driver below is the driver's contract written out plainly: poll after every
arrival, every finished batch and every wake-up the batcher asked for; queue a row with
`can_admit` then `add(executor_free_s=predicted end of the running batch)`; a finished batch
teaches the latency model its compute time."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import pytest

from services.gpu_worker.admission import Admitted
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.types import BatcherConfig, Dispatch, QueuedItem
from services.sim.curve import LatencyCurve
from services.sim.events import EventLoop
from services.sim.traffic import Arrival
from services.sim.worker import MIN_WAKE_S, ModelSpec, SimRequest, SimWorker

pytestmark = pytest.mark.unit

SPEC = ModelSpec(name="m", slo_s=0.1, max_batch_size=16, length_buckets=(16, 64))
DRIVER = DriverConfig(upstream_budget_s=0.02, safety_margin_s=0.005, max_wait_cap_s=0.02)
#: Lingering whether or not it pays (min_expected_arrivals 0): the linger and deadline-slack
#: triggers then close batches too, and the parity covers them.
ALWAYS_LINGERS = dataclasses.replace(DRIVER, min_expected_arrivals=0.0)
CURVE = LatencyCurve.linear((16, 64), (1, 2, 4, 8, 16), fixed_s=0.004, per_token_s=5e-6)
TIMEOUT_S = 0.08

#: (dispatch time, bucket, item ids, close reason)
Batch = tuple[float, int, tuple[int, ...], str]


def make_arrivals(seed: int, *, rate_per_s: float, num: int) -> list[Arrival]:
    """Poisson arrivals with occasional bursts of near-simultaneous rows, two lengths."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    time_s = 0.0
    while len(arrivals) < num:
        time_s += rng.expovariate(rate_per_s)
        for _ in range(rng.choice((1, 1, 1, 5))):
            time_s += 1e-5
            tokens = rng.choice((10, 10, 10, 50))
            arrivals.append(Arrival(time_s, "m", "t", "interactive", tokens, TIMEOUT_S))
    return arrivals


def simulated_batches(
    arrivals: list[Arrival], driver: DriverConfig = DRIVER
) -> tuple[list[Batch], list[str]]:
    loop = EventLoop()
    outcomes: list[str] = []
    worker = SimWorker(
        "w", [(SPEC, CURVE)], driver, loop, lambda _t, _r, outcome: outcomes.append(outcome),
        keep_batches=True,
    )  # fmt: skip
    refusals: list[str] = []

    def submit(now_s: float, arrival: Arrival) -> None:
        reason = worker.submit(SimRequest(arrival, now_s + TIMEOUT_S), now_s)
        if reason is not None:
            refusals.append(reason.value)

    for arrival in arrivals:
        loop.at(arrival.at_s, submit, arrival)
    loop.run(arrivals[-1].at_s + 1.0)
    return worker.batches, refusals


@dataclass
class DirectDriver:
    """A real Batcher and LatencyModel, driven by hand in time order."""

    batcher: Batcher
    latency: LatencyModel
    truth: LatencyModel
    running: Dispatch | None = None
    running_since_s: float = 0.0
    running_until_s: float | None = None
    finish_s: float = math.inf
    wake_s: float = math.inf

    def poll(self, now_s: float, batches: list[Batch]) -> None:
        action = self.batcher.poll(now_s, executor_idle=self.running is None).action
        if isinstance(action, Dispatch):
            size = len(action.items)
            ids = tuple(item.item_id for item in action.items)
            batches.append((now_s, action.key.bucket, ids, action.reason.value))
            self.running, self.running_since_s = action, now_s
            self.running_until_s = now_s + self.latency.predict(action.key, size)
            self.finish_s = now_s + self.truth.predict(action.key, size)
        elif action.until_s is not None:
            self.wake_s = max(action.until_s, now_s + MIN_WAKE_S)

    def finish(self, now_s: float) -> None:
        assert self.running is not None
        dispatch = self.running
        self.running, self.running_until_s, self.finish_s = None, None, math.inf
        self.latency.observe(dispatch.key, len(dispatch.items), now_s - self.running_since_s)


def direct_batches(
    arrivals: list[Arrival], driver_config: DriverConfig = DRIVER
) -> tuple[list[Batch], list[str]]:
    keys = {bucket: SPEC.key(bucket) for bucket in SPEC.length_buckets}
    latency = LatencyModel(spread_weight=driver_config.prediction_spreads)
    CURVE.seed(latency, keys)
    config = BatcherConfig(
        max_batch_size=SPEC.max_batch_size,
        max_queue_size=SPEC.max_queue_size,
        slo_s=SPEC.slo_s,
        upstream_budget_s=driver_config.upstream_budget_s,
        safety_margin_s=driver_config.safety_margin_s,
        max_wait_cap_s=driver_config.max_wait_cap_s,
        min_expected_arrivals=driver_config.min_expected_arrivals,
    )
    driver = DirectDriver(Batcher(config, latency), latency, CURVE.truth(keys))
    batches: list[Batch] = []
    refusals: list[str] = []
    next_id, index = 1, 0
    end_s = arrivals[-1].at_s + 1.0
    while True:
        arrival_s = arrivals[index].at_s if index < len(arrivals) else math.inf
        now_s = min(arrival_s, driver.finish_s, driver.wake_s)
        if now_s > end_s:
            return batches, refusals
        if now_s == driver.finish_s:
            driver.finish(now_s)
        elif now_s == arrival_s:
            arrival = arrivals[index]
            index += 1
            key = SPEC.key(SPEC.bucket_for(arrival.num_tokens))
            item = QueuedItem(next_id, key, "t", arrival.num_tokens, now_s, now_s + TIMEOUT_S)
            decision = driver.batcher.can_admit(1)
            if isinstance(decision, Admitted):
                next_id += 1
                decision = driver.batcher.add(item, now_s, executor_free_s=driver.running_until_s)
            if not isinstance(decision, Admitted):
                refusals.append(decision.reason.value)
                continue
        else:
            driver.wake_s = math.inf
        driver.poll(now_s, batches)


@pytest.mark.parametrize("driver", [DRIVER, ALWAYS_LINGERS], ids=["default", "always-lingers"])
@pytest.mark.parametrize(("seed", "rate_per_s"), [(1, 200.0), (2, 800.0), (3, 2500.0)])
def test_simulated_worker_and_direct_batcher_dispatch_the_same_batches(
    seed: int, rate_per_s: float, driver: DriverConfig
) -> None:
    arrivals = make_arrivals(seed, rate_per_s=rate_per_s, num=1500)
    simulated, simulated_refusals = simulated_batches(arrivals, driver)
    direct, direct_refusals = direct_batches(arrivals, driver)
    assert len(simulated) > 50
    assert simulated == direct
    assert simulated_refusals == direct_refusals


def test_the_arrival_sequences_exercise_every_decision_the_parity_compares() -> None:
    light, light_refusals = simulated_batches(make_arrivals(1, rate_per_s=200.0, num=1500))
    heavy, heavy_refusals = simulated_batches(make_arrivals(3, rate_per_s=2500.0, num=1500))
    lingering = [
        simulated_batches(make_arrivals(seed, rate_per_s=rate, num=1500), ALWAYS_LINGERS)[0]
        for seed, rate in ((1, 200.0), (3, 2500.0))
    ]
    assert {"idle", "full"} <= {reason for *_, reason in light + heavy}
    assert {"linger", "deadline"} <= {reason for *_, reason in lingering[0] + lingering[1]}
    assert max(len(ids) for _, _, ids, _ in heavy) == SPEC.max_batch_size
    assert {bucket for _, bucket, _, _ in light} == {16, 64}
    assert light_refusals == []
    assert "deadline" in heavy_refusals
