"""Fair share and priority classes on the worker, end to end: tenant weights from the gateway's
keys file split contended compute, on one model and across models; `batch` traffic fills what
`interactive` leaves. The whole stack as separate processes, two real TorchScript models."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest

from services.common import metric_names as names
from services.gateway.auth import hash_key
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import types_pb2
from tests.support.metrics import scrape, total
from tests.support.models import write_affine_model
from tests.support.stack import Stack, start_stack

pytestmark = pytest.mark.e2e

KEYS = {"gold": "key-gold", "bronze": "key-bronze", "online": "key-online", "filler": "key-f"}
TENANTS = """
[tenants.gold]
weight = 3
[tenants.bronze]
weight = 1
[tenants.online]
[tenants.filler]
default_priority = "batch"
"""
#: Burn iterations per model call. Measured here, a 4-row batch of "heavy" takes about 15 ms
#: and one of "light" about 10 ms (much of it fixed per call): the executor serves about 275
#: rows/s, far more compute than serving them costs the tiers, so the worker's executor is
#: what the tenants contend for and both tenants' queues stay deep. With "heavy" at 24
#: iterations (10 ms batches, 400 rows/s) the tiers took nearly as much CPU as the model, the
#: favoured tenant's queue ran dry now and then, and rejoining at the floor cost it its share:
#: 2.85 alone, 2.67-2.70 in the suite (3.00-3.01 now). "quick" is
#: cheap: the priority test's batches are short next to the interactive latency.
MODELS = {"heavy": (96, 4), "light": (24, 4), "quick": (4, 8)}
TIMEOUT_S = 20.0
#: Alternating windows of interactive traffic alone and beside batch traffic (priority test).
NUM_PAIRS = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("fair-share")
    keys = "\n".join(
        f'[[keys]]\ntenant = "{tenant}"\nsha256 = "{hash_key(key)}"\n'
        for tenant, key in KEYS.items()
    )
    keys_path = tmp / "api-keys.toml"
    keys_path.write_text(keys + TENANTS)
    repository = tmp / "repo"
    for name, (iters, max_batch_size) in MODELS.items():
        write_affine_model(
            repository,
            name,
            work_iters=iters,
            max_batch_size=max_batch_size,
            slo_p99_ms=5000,
            max_queue_size=256,
        )
    stack = start_stack(
        tmp, model_repository=repository, extra_gateway_args=(f"--api-keys-file={keys_path}",)
    )
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def request(model: str, value: float) -> api.PredictRequest:
    row = np.array([value, 1.0, 2.0, 3.0], dtype=np.float32)
    tensor = types_pb2.Tensor(dtype=types_pb2.DATA_TYPE_FP32, shape=[4], raw_data=row.tobytes())
    return api.PredictRequest(model_name=model, inputs=[api.PredictInput(tensor=tensor)])


@dataclass
class Outcomes:
    """What one closed-loop caller group saw: latencies of OK calls, and error codes."""

    latencies_s: list[float] = field(default_factory=list)
    errors: list[grpc.StatusCode] = field(default_factory=list)

    def p99_s(self) -> float:
        return float(np.percentile(self.latencies_s, 99))

    def add(self, other: Outcomes) -> None:
        """Pools `other`'s outcomes into these."""
        self.latencies_s += other.latencies_s
        self.errors += other.errors


async def closed_loop(
    stub: api_grpc.InferenceServiceStub, tenant: str, model: str, concurrency: int, until: float
) -> Outcomes:
    """`concurrency` callers of `tenant`, each sending one request after another until `until`."""
    outcomes = Outcomes()
    metadata = (("authorization", f"Bearer {KEYS[tenant]}"),)

    async def caller(n: int) -> None:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                await stub.Predict(request(model, n + 0.5), metadata=metadata, timeout=TIMEOUT_S)
                outcomes.latencies_s.append(time.monotonic() - started)
            except grpc.aio.AioRpcError as error:
                outcomes.errors.append(error.code())
                await asyncio.sleep(0.01)

    await asyncio.gather(*(caller(n) for n in range(concurrency)))
    return outcomes


def compute_s(stack: Stack, tenant: str) -> float:
    metrics = scrape(stack.workers[0].metrics_port)
    return total(metrics, names.WORKER_TENANT_COMPUTE_SECONDS_TOTAL, tenant=tenant)


@pytest.mark.parametrize(
    "models", [("heavy", "heavy"), ("heavy", "light")], ids=["same-model", "different-models"]
)
async def test_weights_3_to_1_split_contended_compute_3_to_1(
    stack: Stack, models: tuple[str, str]
) -> None:
    gold_model, bronze_model = models
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        warm_up_s, window_s = 3.0, 8.0
        until = time.monotonic() + warm_up_s + window_s + 1.0
        load = asyncio.gather(
            closed_loop(stub, "gold", gold_model, 48, until),
            closed_loop(stub, "bronze", bronze_model, 48, until),
        )
        await asyncio.sleep(warm_up_s)
        before = {t: compute_s(stack, t) for t in ("gold", "bronze")}
        await asyncio.sleep(window_s)
        after = {t: compute_s(stack, t) for t in ("gold", "bronze")}
        gold, bronze = await load
    served = {t: after[t] - before[t] for t in after}
    assert served["bronze"] > 0, "bronze was starved"
    # The premise: the executor was the contended resource (busy most of the window).
    assert sum(served.values()) >= 0.8 * window_s, served
    ratio = served["gold"] / served["bronze"]
    assert ratio == pytest.approx(3.0, rel=0.1), served
    assert gold.latencies_s and bronze.latencies_s


@dataclass(frozen=True)
class PriorityRun:
    """Interactive traffic alone and beside saturating `batch` traffic, and batch's share."""

    alone_p99_s: float
    with_p99_s: float
    #: Batch calls per second beside interactive, and what interactive left of capacity.
    filler_goodput_per_s: float
    left_over_per_s: float


@pytest.fixture(scope="module")
def priority_run(stack: Stack) -> PriorityRun:
    """Alone and beside-batch windows alternate (NUM_PAIRS of each) and each side's p99 is over
    all its windows' latencies: a p99 of one short window is a few samples and drifts with the
    machine."""
    return asyncio.run(_measure_priorities(stack))


async def _measure_priorities(stack: Stack) -> PriorityRun:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        run_s = 6.0
        # Capacity for batch traffic alone, then interactive alone and beside batch, in turn.
        filler_alone = await closed_loop(stub, "filler", "quick", 32, time.monotonic() + run_s)
        online_alone, online_with, filler_with = Outcomes(), Outcomes(), Outcomes()
        for _ in range(NUM_PAIRS):
            online_alone.add(
                await closed_loop(stub, "online", "quick", 2, time.monotonic() + run_s)
            )
            until = time.monotonic() + run_s
            online, filler = await asyncio.gather(
                closed_loop(stub, "online", "quick", 2, until),
                closed_loop(stub, "filler", "quick", 32, until),
            )
            online_with.add(online)
            filler_with.add(filler)
    assert not online_with.errors, online_with.errors
    capacity = len(filler_alone.latencies_s) / run_s
    run = PriorityRun(
        alone_p99_s=online_alone.p99_s(),
        with_p99_s=online_with.p99_s(),
        filler_goodput_per_s=len(filler_with.latencies_s) / (NUM_PAIRS * run_s),
        left_over_per_s=capacity - len(online_with.latencies_s) / (NUM_PAIRS * run_s),
    )
    print(
        f"interactive p99 alone {run.alone_p99_s * 1000:.1f} ms, beside batch "
        f"{run.with_p99_s * 1000:.1f} ms; batch {run.filler_goodput_per_s:.1f}/s of "
        f"{run.left_over_per_s:.1f}/s left over"
    )
    return run


def test_batch_priority_gets_at_least_half_of_what_interactive_leaves(
    priority_run: PriorityRun,
) -> None:
    assert priority_run.filler_goodput_per_s >= 0.5 * priority_run.left_over_per_s


@pytest.mark.xfail(
    reason="known gap (issue 12), measured on 2 shared cores: interactive p99 beside saturating "
    "batch traffic was 1.14x-1.42x of alone over three runs, within 1.1x in a fourth; 1.47x-2.34x "
    "over five runs this stop, some with the worker at one torch thread of the two cores. "
    "The batch traffic here is 32 callers of one-row calls (~800/s) through the gateway and "
    "router, which share those cores with the interactive calls; on the worker, interactive "
    "rows close at once beside batch rows and wait at most one small backfill batch",
    strict=False,
)
def test_batch_priority_moves_interactive_p99_by_at_most_10_percent(
    priority_run: PriorityRun,
) -> None:
    assert priority_run.with_p99_s <= 1.1 * priority_run.alone_p99_s, priority_run
