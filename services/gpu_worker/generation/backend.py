"""A loaded generation model version: model runner, tokenizer, scheduler and engine."""

from __future__ import annotations

import logging

import torch

from services.common.model_repository import ModelConfigError, ModelVersion
from services.common.registry_schema import ModelRecord
from services.common.text import TextEncoder
from services.gpu_worker.backends.base import fingerprint_of
from services.gpu_worker.batching.failure_streak import FailingConfig, FailureStreak
from services.gpu_worker.generation.attention_backends import AttentionBackends
from services.gpu_worker.generation.block_allocator import num_blocks_for
from services.gpu_worker.generation.engine import GenerationEngine
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.generation.model_runner import ModelRunner, SequenceBatchItem
from services.gpu_worker.generation.scheduler import GenerationScheduler
from services.gpu_worker.generation.scheduler_config import GenerationSchedulerConfig
from services.gpu_worker.generation.standing_shedding import StandingShedding
from services.gpu_worker.served_model import BatchLoads, ServedModel
from services.gpu_worker.thread_choice import ThreadChoice, thread_options

log = logging.getLogger(__name__)


def serving_dtype(device: torch.device) -> torch.dtype:
    """The weights' and KV cache's dtype: bf16 on a GPU (memory bandwidth is the decode
    bottleneck), fp32 on the CPU (bf16 matmuls are slow there, and the reference comparison
    is exact)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class GenerationBackend(ServedModel):
    """A loaded generation model version, stepped by its own engine."""

    def __init__(
        self,
        version: ModelVersion,
        device: torch.device,
        metrics: GenerationMetrics,
        *,
        is_static: bool = False,
        attention: AttentionBackends | None = None,
        cuda_graphs: bool = True,
        graph_prompts: bool = True,
        host_threads: int = 0,
        failing_steps_to_mark: int = FailingConfig.batches_to_mark,
    ) -> None:
        """`is_static` selects run-to-completion batching: the baseline benchmarks compare
        continuous batching against; never used for serving. `attention` fixes the SDPA
        kernels (None: measured at warm-up), `cuda_graphs` False keeps every step eager on a
        GPU and `graph_prompts` False every step with a prompt: all for benchmarks'
        side-by-side runs. On a CPU the engine chooses each step's torch threads up to
        `host_threads` (0: torch's count on this thread). `failing_steps_to_mark`: failed
        steps in a row that mark the version failing in the heartbeat (0: never)."""
        config = version.config
        settings = config.generation
        if settings is None:
            raise ModelConfigError(f"{config.name}: generation models need a [generation] table")
        weights = version.weights_dir
        files = [weights / "config.json", weights / "model.safetensors", weights / "tokenizer.json"]
        missing = [str(p) for p in files if not p.exists()]
        if missing:
            raise ModelConfigError(f"{config.name}/{version.version}: missing {missing}")
        self.version = version
        self.config = config
        self._metrics = metrics
        self._attention = attention
        self._cuda_graphs = cuda_graphs
        self._graph_prompts = graph_prompts
        self.settings = settings
        self.text = TextEncoder(weights, config)
        dtype = serving_dtype(device)
        # Before the engine: nothing may fail once its step thread runs (`discard` after).
        self._fingerprint = fingerprint_of(config, files, str(dtype))
        self.runner = ModelRunner(
            weights,
            device=device,
            dtype=dtype,
            num_blocks=settings.num_kv_blocks,
            block_size=settings.block_size,
        )
        self._max_model_len = min(settings.max_model_len, self.runner.max_model_len)
        self.scheduler = GenerationScheduler(
            GenerationSchedulerConfig(
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                num_blocks=settings.num_kv_blocks,
                block_size=settings.block_size,
                max_model_len=self._max_model_len,
                is_static=is_static,
                watermark_blocks=settings.watermark_blocks,
                enable_prefix_caching=settings.prefix_caching != "off",
            )
        )
        # On a CPU the steps' thread count is measured per step size (thread_choice); a GPU's
        # kernels leave the cores to the event loop.
        self.thread_choice = (
            ThreadChoice(
                thread_options(host_threads or torch.get_num_threads()),
                detects_busy_host=False,  # a step's cost follows what it holds
            )
            if device.type == "cpu"
            else None
        )
        self.engine = GenerationEngine(
            self.runner,
            self.text.tokenizer,
            self.scheduler,
            metrics,
            labels=(config.name, version.version),
            eos_token_ids=frozenset(self.runner.config.eos_token_ids),
            max_model_len=self._max_model_len,
            is_cache_per_tenant=settings.prefix_caching == "per_tenant",
            thread_choice=self.thread_choice,
            # Online requests refused while the waiting queue stands, as the lanes' rows are.
            shedding=(shedding := StandingShedding(config.slo_s)),
            failures=(failures := FailureStreak(FailingConfig(failing_steps_to_mark))),
        )
        # Standing while it holds something: an idle engine observes nothing, and its last
        # observation may be a hold's (as the lanes' `_stands`). The function holds the
        # rule and the scheduler, never the backend: an unloaded version's tensors must be
        # freed (hot_swap.unload), and its series then goes (GenerationMetrics.forget).
        scheduler, clock = self.scheduler, self.engine.clock
        metrics.queue_standing.labels(config.name, version.version).set_function(
            lambda: int(shedding.queue.is_standing and scheduler.num_waiting > 0)
        )
        metrics.model_failing.labels(config.name, version.version).set_function(
            lambda: int(failures.is_failing(clock()))
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.text.fingerprint

    @property
    def max_input_tokens(self) -> int:
        return self.text.max_tokens

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.text.encode_many([text])[0]]

    def warm_up(self) -> None:
        """On the thread that runs the engine's steps: one prefill and one decode through the
        runner (lazy init, allocator; the slower sets the floor of the step watchdog), then the
        attention kernels' choice and, on a GPU, the decode steps' CUDA graphs."""
        block_size, num_blocks = self.runner.block_size, self.runner.num_blocks
        # Past a block where the cache holds two, and never past the cache or the context (a
        # cache of one-token blocks: a fixed two-block table failed the load).
        longest = min(block_size + 1, num_blocks * block_size - 1, self._max_model_len - 1)
        prompt = tuple(range(1, max(1, longest) + 1))
        blocks = tuple(range(num_blocks_for(len(prompt) + 1, block_size)))
        self.engine.steps.warm_up(
            [
                [SequenceBatchItem(prompt, 0, blocks)],
                [SequenceBatchItem((1,), len(prompt), blocks)],
            ]
        )
        self.engine.steps.call(self._prepare_steps)

    def discard(self) -> None:
        """Leaves this version out after its engine was made (its warm-up failed, at start or
        while serving): its step thread is let go, waiting for no call in flight (it ends after
        it), and it exports no standing gauge (whose function reads its scheduler)."""
        self.engine.steps.abandon()
        self._metrics.forget(self.config.name, self.version.version)

    def _prepare_steps(self) -> None:
        labels = (self.config.name, self.version.version)
        if self._attention is None:
            times = self.runner.choose_attention(self._representative_steps())
        else:
            self.runner.attention, times = self._attention, {}
        measured = ", ".join(f"{name} {s * 1000:.2f} ms" for name, s in times.items())
        log.info(
            "generation attention of %s: %s (%s)",
            "/".join(labels),
            self.runner.attention.name,
            f"warm-up steps: {measured}" if times else "not measured",
        )
        self._metrics.attention_backends.labels(*labels, self.runner.attention.name).set(1)
        graphs = (
            self.runner.capture_graphs(
                self.settings.max_num_seqs,
                self._max_model_len,
                self.settings.max_num_batched_tokens if self._graph_prompts else 0,
            )
            if self._cuda_graphs
            else 0
        )
        self._metrics.cuda_graphs.labels(*labels).set(graphs)
        if graphs:
            log.info("generation of %s: %d decode CUDA graphs", "/".join(labels), graphs)

    def _representative_steps(self) -> list[list[SequenceBatchItem]]:
        """A full decode step (up to 32 sequences of half the model's length, at most 256
        positions) and a 128-token prompt, within the cache's blocks: what the attention
        kernels are timed on. Their keys and values go to blocks no sequence holds yet."""
        block_size, settings = self.runner.block_size, self.settings
        # Within the cache however small: the positions its blocks hold, less the decoded one.
        room = settings.num_kv_blocks * block_size
        context = max(1, min(self._max_model_len // 2, 256, room - 1))
        per_seq = num_blocks_for(context + 1, block_size)
        count = max(1, min(settings.max_num_seqs, 32, settings.num_kv_blocks // per_seq))
        decode = [
            SequenceBatchItem((1,), context, tuple(range(i * per_seq, (i + 1) * per_seq)))
            for i in range(count)
        ]
        length = max(1, min(128, settings.max_num_batched_tokens, self._max_model_len, room))
        blocks = tuple(range(num_blocks_for(length, block_size)))
        return [decode, [SequenceBatchItem((1,) * length, 0, blocks)]]

    def model_record(self, *, is_ready: bool, batching: BatchLoads) -> ModelRecord:
        step_s = self.engine.mean_step_s
        return self._record(
            is_ready=is_ready,
            max_batch_size=self.settings.max_num_seqs,
            # Prefill cost per prompt token, and one step as the floor of time to first token.
            per_row_s=step_s / self.settings.max_num_batched_tokens,
            min_batch_s=step_s,
            queued_rows=self.engine.num_waiting_tokens,
            kv_blocks_free=self.scheduler.num_free_blocks,
            kv_block_size=self.settings.block_size,
            max_model_len=self.max_model_len,
            is_failing=self.engine.failures.is_failing(self.engine.clock()),
        )
