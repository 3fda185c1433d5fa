"""Lanes coming and going while the batching driver serves: building a lane for a version,
waiting until an unloading lane has answered every row it admitted, and handing the device
memory of an unloaded version back.

The driver calls these from `add_backend` / `remove_backend` (hot load and unload, see
services.gpu_worker.hot_swap); warm-up and the memory release run on the driver's executor
thread, so they never overlap a batch on the device."""

from __future__ import annotations

import asyncio
import gc

import torch

from services.gpu_worker.backends.base import Backend
from services.gpu_worker.batching.driver_config import DriverConfig
from services.gpu_worker.batching.failure_streak import FailingConfig, FailureStreak
from services.gpu_worker.batching.fair_share import ComputeLedger
from services.gpu_worker.batching.lane import Lane
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.slo_shedding import SloShedding
from services.gpu_worker.batching.types import BatcherConfig
from services.gpu_worker.metrics import WorkerMetrics
from services.gpu_worker.thread_choice import ThreadChoice, thread_options


def new_lane(
    backend: Backend, config: DriverConfig, metrics: WorkerMetrics, ledger: ComputeLedger
) -> Lane:
    """A lane for `backend`: its batcher (the model's limits, the worker's batching settings,
    the worker-wide fair-share `ledger`) and an empty latency model. Raises ValueError for a
    model whose SLO leaves the worker no time (not above the worker's upstream budget): each
    of its rows would be admitted already past its SLO bound."""
    model = backend.config
    if model.slo_s <= config.upstream_budget_s:
        raise ValueError(
            f"model {model.name}: its SLO ({model.slo_p99_ms} ms) must exceed the worker's"
            f" upstream budget ({config.upstream_budget_s * 1000:g} ms, --upstream-budget-ms)"
        )
    batcher_config = BatcherConfig(
        max_batch_size=model.max_batch_size,
        max_queue_size=model.max_queue_size,
        slo_s=model.slo_s,
        upstream_budget_s=config.upstream_budget_s,
        safety_margin_s=config.safety_margin_s,
        max_wait_cap_s=config.max_wait_cap_s,
        max_batch_tokens=model.max_batch_tokens,
        min_expected_arrivals=config.min_expected_arrivals,
        tenant_weights=config.tenant_weights,
    )
    latency = LatencyModel(spread_weight=config.prediction_spreads)
    metrics.declare_model(model.name, backend.version.version)
    shedding = SloShedding.for_model(model.slo_s, model.shed_past_slo, config)
    batcher = Batcher(batcher_config, latency, ledger)
    options = thread_options(config.model_threads or torch.get_num_threads())
    threads = ThreadChoice(options) if backend.computes_on_host and len(options) > 1 else None
    return Lane(
        backend=backend,
        batcher=batcher,
        latency=latency,
        shedding=shedding,
        threads=threads,
        failures=FailureStreak(FailingConfig(batches_to_mark=config.failing_batches_to_mark)),
    )


async def settle(lane: Lane) -> None:
    """Returns once every caller `lane` has admitted rows of so far is answered (its rows
    run, one of them failed or expired, or withdrawn by the caller). The lane must already be
    draining: it admits nothing new, and the driver dispatches what it holds at once."""
    futures = {pending.outputs.future for pending in lane.pending.values()}
    if futures:
        # `wait`, not `gather`: cancelling the unload must not cancel the callers' rows.
        await asyncio.wait(futures)


def release_device_memory() -> None:
    """Frees what an unloaded version left behind: its tensors once unreferenced, and the
    allocator's cached blocks on a GPU. Run it on the executor thread, after the version's
    last batch."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
