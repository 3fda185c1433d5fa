"""The worker's entry in the router registry: what it serves, how loaded it is, whether it
drains. Published by a heartbeat task; never on the request path."""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.heartbeat import HeartbeatPublisher, connect
from services.common.registry import ModelRecord, RegistryKeys, WorkerRecord
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.loaded_models import LoadedModels
from services.gpu_worker.scheduler import BatchScheduler

log = logging.getLogger(__name__)


class Registration:
    def __init__(
        self,
        config: WorkerConfig,
        address: str,
        models: LoadedModels,
        scheduler: BatchScheduler,
    ) -> None:
        assert config.redis_url is not None
        self._worker_id = config.worker_id
        self._address = address
        self._models = models
        self._scheduler = scheduler
        self._is_draining = False
        self._client = connect(config.redis_url)
        self._publisher = HeartbeatPublisher(
            self._client, RegistryKeys(config.registry_prefix), config.heartbeat, self.record
        )
        self._task: asyncio.Task[None] | None = None

    def _generation_record(self, backend: GenerationBackend) -> ModelRecord:
        engine = backend.engine
        settings = backend.settings
        step_s = engine.mean_step_s
        return ModelRecord(
            name=backend.config.name,
            version=backend.version.version,
            fingerprint=backend.fingerprint,
            tokenizer_fingerprint=backend.tokenizer_fingerprint,
            kind=backend.config.kind.value,
            max_batch_size=settings.max_num_seqs,
            slo_p99_ms=backend.config.slo_p99_ms,
            # Prefill cost per prompt token, and one step as the floor of time to first token.
            per_row_s=step_s / settings.max_num_batched_tokens,
            min_batch_s=step_s,
            queued_rows=engine.num_waiting_tokens,
            is_ready=not self._is_draining,
            kv_blocks_free=engine.num_free_blocks,
            kv_block_size=settings.block_size,
            max_model_len=backend.max_model_len,
            shed_past_slo=backend.config.shed_past_slo,
        )

    def record(self) -> WorkerRecord:
        models = [self._generation_record(b) for b in self._models.generation]
        for backend in self._models.fixed_cost:
            load = self._scheduler.load_report(backend)
            models.append(
                ModelRecord(
                    name=backend.config.name,
                    version=backend.version.version,
                    fingerprint=backend.fingerprint,
                    tokenizer_fingerprint=backend.tokenizer_fingerprint,
                    kind=backend.config.kind.value,
                    max_batch_size=backend.config.max_batch_size,
                    slo_p99_ms=backend.config.slo_p99_ms,
                    per_row_s=load.per_row_s,
                    min_batch_s=load.min_batch_s,
                    queued_rows=load.queued_rows,
                    is_ready=not self._is_draining,
                    shed_past_slo=backend.config.shed_past_slo,
                )
            )
        return WorkerRecord(
            worker_id=self._worker_id,
            address=self._address,
            is_draining=self._is_draining,
            sent_at_ms=int(time.time() * 1000),
            models=tuple(models),
        )

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._publisher.run(), name="heartbeat")

    def mark_draining(self) -> None:
        """Routers stop choosing this worker at their next registry refresh."""
        self._is_draining = True
        self._publisher.publish_soon()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._publisher.deregister(self._worker_id)
        await self._client.aclose()
