"""Hot load and unload: one model version enters or leaves a worker while it serves the rest.

Load: a version whose weights would not fit in the free memory is refused first
(services.gpu_worker.memory_budget), so a load never takes the serving versions down with it.
Then weights are read off the event loop (a daemon thread), the version is warmed up where it
will run (fixed-cost versions on the batching driver's executor thread, between batches;
generation versions on their engine's step thread before the engine starts), each warm-up call
(each forward, for a generation version) bounded at WARMUP_MULTIPLE x the watchdog (past it
the worker stops serving, as for a call that never returns while serving), and only then
does it join `LoadedModels`, which the servicer resolves from and the next registry heartbeat
advertises. A version that fails to load is logged, counted
(`inference_worker_model_load_failures_total`) and recorded in `LoadedModels.failed`; the
worker serves the rest as before.

Unload: the version leaves `LoadedModels` first (new calls get NOT_FOUND, the next heartbeat,
sent at once, no longer lists it), then its admitted work finishes (a lane-level drain, or its
engine's drain), then its memory is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from services.common.model_repository import ModelVersion
from services.common.procfs import available_memory_bytes
from services.gpu_worker.backends import DEFAULT_LOAD, LoadOptions
from services.gpu_worker.backends.base import Backend
from services.gpu_worker.batching.driver import BatchingDriver
from services.gpu_worker.batching.lane_changes import release_device_memory
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.loaded_models import LoadedModels, LoadFailure, load_version, one_line
from services.gpu_worker.memory_budget import (
    check_fits,
    free_memory_bytes,
    kv_cache_bytes,
    weights_bytes,
)
from services.gpu_worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


class ModelSwapper:
    """Loads and unloads single versions of a serving worker. Not re-entrant: one change at a
    time (the repository follower applies its actions in order)."""

    def __init__(
        self,
        *,
        models: LoadedModels,
        batching: BatchingDriver,
        device: torch.device,
        worker_metrics: WorkerMetrics,
        generation_metrics: GenerationMetrics,
        on_fatal: Callable[[Exception], None],
        on_change: Callable[[], None],
        watchdog_s: float,
        options: LoadOptions = DEFAULT_LOAD,
    ) -> None:
        self._models = models
        self._batching = batching
        self._device = device
        self._worker_metrics = worker_metrics
        self._generation_metrics = generation_metrics
        self._on_fatal = on_fatal
        #: Called after the served set changed (publish the registry record now).
        self._on_change = on_change
        #: The configured bound on one generation step (seconds), as at start.
        self._watchdog_s = watchdog_s
        #: How versions load (WorkerConfig.load_options).
        self._options = options

    async def load(self, version: ModelVersion, *, revision: int = 0) -> bool:
        """Loads, warms up and serves `version`; False (reported, not raised) if it failed,
        the failure marked with `revision`, the model's desired-state revision it followed."""
        label = f"{version.config.name}/{version.version}"
        try:
            model = await self._load(version)
        except Exception as error:  # any loader or warm-up error: the rest keeps serving
            log.error("model %s failed to load; not served: %s", label, error, exc_info=True)
            self._worker_metrics.model_load_failures_total.labels(*_labels(version)).inc()
            self._models.add_failure(LoadFailure(*_labels(version), one_line(error), revision))
        else:
            self._models.add(model)
            self._on_change()
            log.info("model %s loaded while serving (fingerprint %s)", label, model.fingerprint)
            return True
        # What the failed version took (its weights, a generation version's whole KV cache)
        # is unreferenced now: give it back, or the next load is refused for memory it holds.
        try:
            await self._batching.between_batches(release_device_memory)
        except Exception as error:  # the worker is stopping: nothing more to load
            log.warning("memory of %s not released after its failed load: %r", label, error)
        return False

    async def _load(self, version: ModelVersion) -> Backend | GenerationBackend:
        weights = await asyncio.to_thread(weights_bytes, version.weights_dir)
        kv_cache = await asyncio.to_thread(kv_cache_bytes, version, self._device)
        free, host_free = free_memory_bytes(self._device), available_memory_bytes()
        check_fits(
            weights=weights, free=free, device=self._device, kv_cache=kv_cache, host_free=host_free
        )
        model = await in_daemon_thread(
            lambda: load_version(version, self._device, self._generation_metrics, self._options)
        )
        if isinstance(model, GenerationBackend):
            try:
                await self._warm_up_generation(model)
                model.engine.start(on_fatal=self._on_fatal, watchdog_s=self._watchdog_s)
            except BaseException:
                model.discard()
                raise
        else:
            await self._batching.add_backend(model)
        return model

    async def _warm_up_generation(self, model: GenerationBackend) -> None:
        """Warms a generation version up on its engine's step thread, each forward bounded at
        WARMUP_MULTIPLE x the watchdog. Past it, the worker stops serving, as for a serving
        step past the watchdog (a step that never returns may have hung the device), and the
        load fails. A warm-up that failed or was cancelled (the worker stops) lets its thread
        go (`_load` discards the version): nothing queued runs, and the call in flight, if
        any, is not waited for."""
        steps = model.engine.steps
        try:
            await steps.warm_up_within(in_daemon_thread(model.warm_up), self._watchdog_s)
        except BaseException as error:
            if steps.is_wedged and isinstance(error, Exception):  # the bound's Unavailable
                self._on_fatal(error)
            raise

    async def unload(self, model_name: str, model_version: str) -> None:
        """Stops serving a version, finishes its admitted work, then frees it."""
        model = self._models.remove(model_name, model_version)
        self._on_change()
        log.info("unloading %s/%s: draining its admitted work", model_name, model_version)
        if isinstance(model, GenerationBackend):
            # Shielded: a worker's stop cancels this follower, and its own drain (within the
            # grace) takes this one over (it stays in `unloading`) instead of cutting its
            # streams.
            self._models.unloading.add(model)
            await asyncio.shield(model.engine.drain())
            self._models.unloading.discard(model)
            self._generation_metrics.forget(model_name, model_version)
        elif isinstance(model, Backend):
            await self._batching.remove_backend(model)
        # Its last reference: the release can free its tensors only once it is gone (on a
        # GPU they went back to the allocator's cache, still counted used by the next load).
        del model
        await self._batching.between_batches(release_device_memory)
        log.info("model %s/%s unloaded", model_name, model_version)


def _labels(version: ModelVersion) -> tuple[str, str]:
    return (version.config.name, version.version)


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """Runs blocking `fn` in a daemon thread: a SIGTERM during a model load must not wait for
    the load to finish before the process can exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle_result(result: T) -> None:
        if not future.done():
            future.set_result(result)

    def settle_error(error: BaseException) -> None:
        if not future.done():
            future.set_exception(error)

    def settle(settle_as: Callable[[Any], None], outcome: object) -> None:
        # The loop may have closed meanwhile (the process stopping): no one awaits then.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle_as, outcome)

    def target() -> None:
        try:
            result = fn()
        except BaseException as error:  # delivered to the awaiting coroutine
            settle(settle_error, error)
        else:
            settle(settle_result, result)

    threading.Thread(target=target, name="model-loader", daemon=True).start()
    return await future
