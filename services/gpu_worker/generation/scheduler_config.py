"""The configuration of a generation model's scheduler (services.gpu_worker.generation.
scheduler): seats, the token budget of a step, the KV cache's blocks, and its checks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationSchedulerConfig:
    """The slice of a generation model's configuration that the scheduler needs."""

    #: Most sequences running (holding KV blocks) at once.
    max_num_seqs: int
    #: Token budget of one step: decode tokens plus prefill-chunk tokens.
    max_num_batched_tokens: int
    #: KV-cache blocks in the whole cache.
    num_blocks: int
    #: Token slots per KV block.
    block_size: int
    #: Longest sequence (prompt + generated tokens) the model accepts.
    max_model_len: int
    #: Free blocks kept back when admitting while others run, so running sequences can grow a
    #: few steps before anyone is preempted.
    watermark_blocks: int = 0
    #: Benchmark baseline: admit a batch only when nothing runs, prefill all of it, then decode
    #: it to completion.
    is_static: bool = False
    #: Share the KV of leading full blocks that sequences of one cache salt have in common.
    enable_prefix_caching: bool = False


def check_config(config: GenerationSchedulerConfig) -> None:
    c = config
    if min(c.max_num_seqs, c.max_num_batched_tokens, c.num_blocks, c.block_size,
           c.max_model_len) < 1:  # fmt: skip
        raise ValueError(
            "max_num_seqs, max_num_batched_tokens, num_blocks, block_size and max_model_len"
            " must be >= 1"
        )
    if config.watermark_blocks < 0:
        raise ValueError("watermark_blocks must be >= 0")
