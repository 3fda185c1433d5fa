"""Generation metrics (per model version): TTFT, TPOT, KV blocks, preemptions, queue sizes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        model = ["model", "version"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, model, buckets=buckets, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, model, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*model, *extra], registry=registry)

        self.ttft_seconds = histogram(
            "inference_generation_time_to_first_token_seconds",
            "From admission to the first generated token.",
            _SECONDS,
        )
        self.tpot_seconds = histogram(
            "inference_generation_time_per_output_token_seconds",
            "Between consecutive tokens of one sequence.",
            _SECONDS,
        )
        self.step_seconds = histogram(
            "inference_generation_step_seconds", "One engine step (one forward).", _SECONDS
        )
        self.step_tokens = histogram(
            "inference_generation_step_tokens", "Tokens computed in one step.", _TOKENS
        )
        self.kv_blocks_free = gauge("inference_generation_kv_blocks_free", "Free KV-cache blocks.")
        self.kv_blocks_used = gauge("inference_generation_kv_blocks_used", "Used KV-cache blocks.")
        self.running_sequences = gauge(
            "inference_generation_running_sequences", "Sequences holding KV blocks."
        )
        self.waiting_sequences = gauge(
            "inference_generation_waiting_sequences", "Sequences waiting for admission."
        )
        self.preemptions_total = counter(
            "inference_generation_preemptions_total",
            "Sequences preempted (blocks freed, recomputed later) because KV blocks ran out.",
        )
        self.tokens_total = counter("inference_generation_tokens_total", "Tokens streamed.")
        self.finished_total = counter(
            "inference_generation_finished_total", "Sequences finished, by reason.", ("reason",)
        )
        self.cancelled_total = counter(
            "inference_generation_cancelled_total", "Streams cancelled by the caller."
        )
        self.rejected_total = counter(
            "inference_generation_rejected_total", "Requests refused at admission."
        )
