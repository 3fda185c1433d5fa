"""Generation metrics (per model version): TTFT, TPOT, KV blocks, preemptions, queue sizes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from services.common import metric_names as names
from services.common.telemetry import (
    SECONDS_BUCKETS,
    Children,
    MetricFactory,
    Retirement,
    observe_counts,
    remove_series,
    remove_version_series,
)

if TYPE_CHECKING:  # they import this module
    from services.gpu_worker.generation.request_stream import RequestStream
    from services.gpu_worker.generation.scheduler import GenerationScheduler
    from services.gpu_worker.generation.sequence import ScheduledSequence, SchedulerOutput

_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_MODEL = ("model", "version")


class TenantCharge(Protocol):
    def __call__(self, tenant: str, *, compute_s: float, num_tokens: int = 0) -> None: ...


class RequestsBySeq(Protocol):
    def get(self, seq_id: int, /) -> RequestStream | None: ...


def charge_tenants(
    charge: TenantCharge | None,
    scheduled: Sequence[ScheduledSequence],
    requests: RequestsBySeq,
    step_s: float,
) -> None:
    """Splits a step's time over its sequences' tenants (`requests`, by sequence id) by tokens
    computed (the fair-share measure of generation), for the per-tenant compute metrics: one
    charge per tenant a step, not per sequence (a step holds up to max_num_seqs of them)."""
    num_tokens = sum(len(s.token_ids) for s in scheduled)
    if charge is None or num_tokens == 0:
        return
    tokens_of: dict[str, int] = {}
    for item in scheduled:
        request = requests.get(item.seq_id)
        if request is not None:
            tokens_of[request.tenant] = tokens_of.get(request.tenant, 0) + len(item.token_ids)
    for tenant, tokens in tokens_of.items():
        charge(tenant, compute_s=step_s * tokens / num_tokens, num_tokens=tokens)


class GenerationMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        watchdog_expired_total: Counter | None = None,
        charge_tenant: TenantCharge | None = None,
        device_busy_seconds_total: Counter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`watchdog_expired_total`: the worker's count of model calls past the executor
        watchdog (`WorkerMetrics`, whose registry this shares), which wedged generation steps
        add to; `charge_tenant`: the worker's per-tenant compute record
        (`WorkerMetrics.charge_tenant`); `device_busy_seconds_total`: the worker's count of
        device seconds (`WorkerMetrics`), which steps add to. None (an engine on its own)
        leaves them uncounted."""
        self._retirement = Retirement(partial(remove_version_series, self), clock)
        new = MetricFactory(registry)
        self.watchdog_expired_total = watchdog_expired_total
        self.device_busy_seconds_total = device_busy_seconds_total
        self.charge_tenant = charge_tenant
        self.ttft_seconds = new.histogram(
            names.GENERATION_TTFT_SECONDS,
            "From admission to the first generated token, of online (critical and interactive) "
            "streams: batch-class ones wait on purpose.",
            _MODEL,
            buckets=SECONDS_BUCKETS,
        )
        self.tpot_seconds = new.histogram(
            names.GENERATION_TPOT_SECONDS,
            "Between consecutive tokens of one sequence.",
            _MODEL,
            buckets=SECONDS_BUCKETS,
        )
        self.step_seconds = new.histogram(
            names.GENERATION_STEP_SECONDS,
            "One engine step: from its launch until its logits are in hand (with the last"
            " step's tokens streamed meanwhile on a device, until that is done if it is later).",
            _MODEL,
            buckets=SECONDS_BUCKETS,
        )
        self.step_tokens = new.histogram(
            names.GENERATION_STEP_TOKENS, "Tokens computed in one step.", _MODEL, buckets=_TOKENS
        )
        self.kv_blocks_free = new.gauge(
            names.GENERATION_KV_BLOCKS_FREE, "Free KV-cache blocks.", _MODEL
        )
        self.kv_blocks_used = new.gauge(
            names.GENERATION_KV_BLOCKS_USED, "Used KV-cache blocks.", _MODEL
        )
        self.running_sequences = new.gauge(
            names.GENERATION_RUNNING_SEQUENCES, "Sequences holding KV blocks.", _MODEL
        )
        self.waiting_sequences = new.gauge(
            names.GENERATION_WAITING_SEQUENCES, "Sequences waiting for admission.", _MODEL
        )
        self.preemptions_total = new.counter(
            names.GENERATION_PREEMPTIONS_TOTAL,
            "Sequences preempted (blocks freed, recomputed later) because KV blocks ran out.",
            _MODEL,
        )
        self.prefix_cache_queried_tokens_total = new.counter(
            names.GENERATION_PREFIX_CACHE_QUERIED_TOKENS_TOTAL,
            "Known tokens of admitted sequences, looked up in the prefix cache.",
            _MODEL,
        )
        self.prefix_cache_hit_tokens_total = new.counter(
            names.GENERATION_PREFIX_CACHE_HIT_TOKENS_TOTAL,
            "Tokens of admitted sequences whose KV the prefix cache held (not computed again);"
            " over ..._queried_tokens_total, the hit rate.",
            _MODEL,
        )
        self.prefix_cache_blocks = new.gauge(
            names.GENERATION_PREFIX_CACHE_BLOCKS,
            "KV blocks the prefix cache remembers, owned or free (free ones are reused first"
            " to last freed).",
            _MODEL,
        )
        self.tokens_total = new.counter(names.GENERATION_TOKENS_TOTAL, "Tokens streamed.", _MODEL)
        self.attention_backends = new.gauge(
            names.GENERATION_ATTENTION_BACKENDS,
            "1 for the set of SDPA kernels the model's steps run on, chosen at warm-up.",
            (*_MODEL, "backends"),
        )
        self.cuda_graphs = new.gauge(
            names.GENERATION_CUDA_GRAPHS,
            "CUDA graphs captured for the model's decode-only steps (0 on a CPU or when off).",
            _MODEL,
        )
        self.finished_total = new.counter(
            names.GENERATION_FINISHED_TOTAL, "Sequences finished, by reason.", (*_MODEL, "reason")
        )
        self.cancelled_total = new.counter(
            names.GENERATION_CANCELLED_TOTAL, "Streams cancelled by the caller.", _MODEL
        )
        self.rejected_total = new.counter(
            names.GENERATION_REJECTED_TOTAL, "Requests refused at admission.", _MODEL
        )
        self.dropped_total = new.counter(
            names.GENERATION_DROPPED_TOTAL,
            "Online requests dropped unrun while the waiting queue stood: they had waited past"
            " the time-to-first-token SLO with no token (generation/standing_shedding.py).",
            _MODEL,
        )
        self.queue_standing = new.gauge(
            names.GENERATION_QUEUE_STANDING,
            "1 while the waiting queue stands: online requests are refused, and those that"
            " waited past the time-to-first-token SLO dropped (generation/standing_shedding.py).",
            _MODEL,
        )

        self.model_failing = new.gauge(
            names.GENERATION_MODEL_FAILING,
            "1 while the version's steps all fail on this worker (each failed for every"
            " sequence in it): its heartbeat says so, and routers send its streams to other"
            " workers.",
            _MODEL,
        )

    def forget(self, model: str, version: str) -> None:
        """A version unloaded, or that failed to load after its engine was made, exports none
        of its gauges: they said what its engine holds (free KV blocks summed over versions
        would count a gone one's), and the standing one's function read its scheduler. A load
        made again sets new ones. Its counters and histograms stay RETIRED_SERIES_S, then go
        at a later unload (Retirement)."""
        gauges = (
            self.queue_standing,
            self.model_failing,
            self.kv_blocks_free,
            self.kv_blocks_used,
            self.running_sequences,
            self.waiting_sequences,
            self.prefix_cache_blocks,
            self.cuda_graphs,
            self.attention_backends,  # one child per kernel set named: each of the version's
        )
        for gauge in gauges:
            remove_series(gauge, (model, version))
        self._retirement.retire(model, version)

    def bind(self, labels: tuple[str, str]) -> BoundGenerationMetrics:
        """This model version's children of every per-model metric, looked up once:
        `labels()` takes a lock and a dict lookup per call, and the engine records per token."""
        self._retirement.revive(*labels)
        return BoundGenerationMetrics(self, labels)


class BoundGenerationMetrics:
    """`GenerationMetrics` children of one (model, version); `finished(reason)` for the one
    metric with a further label."""

    def __init__(self, metrics: GenerationMetrics, labels: tuple[str, str]) -> None:
        def child(metric: Any) -> Any:
            return metric.labels(*labels)

        self.ttft_seconds = child(metrics.ttft_seconds)
        self.tpot_seconds = child(metrics.tpot_seconds)
        self.step_seconds = child(metrics.step_seconds)
        self.step_tokens = child(metrics.step_tokens)
        self.kv_blocks_free = child(metrics.kv_blocks_free)
        self.kv_blocks_used = child(metrics.kv_blocks_used)
        self.running_sequences = child(metrics.running_sequences)
        self.waiting_sequences = child(metrics.waiting_sequences)
        self.preemptions_total = child(metrics.preemptions_total)
        self.prefix_cache_queried_tokens_total = child(metrics.prefix_cache_queried_tokens_total)
        self.prefix_cache_hit_tokens_total = child(metrics.prefix_cache_hit_tokens_total)
        self.prefix_cache_blocks = child(metrics.prefix_cache_blocks)
        self.tokens_total = child(metrics.tokens_total)
        self.cancelled_total = child(metrics.cancelled_total)
        self.rejected_total = child(metrics.rejected_total)
        self.dropped_total = child(metrics.dropped_total)
        # Created at load (at zero) like the fixed-cost models' series: the duty cycle's.
        busy = metrics.device_busy_seconds_total
        self.device_busy_seconds_total = (
            None if busy is None else busy.labels(*labels, names.WORK_ONLINE)
        )
        self._finished = Children(metrics.finished_total)
        self._labels = labels
        self._charge_tenant = metrics.charge_tenant
        #: Tokens streamed since `flush_tokens`, and their times per output token with how
        #: many had each: a step's tokens share their sampling time, so most share a value.
        self._num_tokens = 0
        self._tpot_counts: dict[float, int] = {}

    def streamed(self, num_tokens: int, tpot_s: float | None) -> None:
        """A delta of `num_tokens` streamed (0: a stop token's), `tpot_s` after its stream's
        last (None: its first), recorded at the next `flush_tokens`: a counter's and a
        histogram's locked writes a token were a tenth of the engine's loop."""
        self._num_tokens += num_tokens
        if tpot_s is not None:
            self._tpot_counts[tpot_s] = self._tpot_counts.get(tpot_s, 0) + 1

    def flush_tokens(self) -> None:
        """Records what `streamed` has counted since the last flush."""
        if self._num_tokens:
            self.tokens_total.inc(self._num_tokens)
            self._num_tokens = 0
        if self._tpot_counts:
            counts, self._tpot_counts = self._tpot_counts, {}
            observe_counts(self.tpot_seconds, counts.items())

    def finished(self, reason: str) -> Counter:
        """The finished-sequences counter of `reason`."""
        return self._finished[(*self._labels, reason)]

    def stepped(self, step_s: float, output: SchedulerOutput, requests: RequestsBySeq) -> None:
        """A step of `output`'s plan took `step_s`: observed, and charged to its tenants."""
        self.step_seconds.observe(step_s)
        self.step_tokens.observe(output.num_batched_tokens)
        charge_tenants(self._charge_tenant, output.scheduled, requests, step_s)

    def scheduled(
        self, output: SchedulerOutput, scheduler: GenerationScheduler, num_blocks: int
    ) -> None:
        """A step planned (`output`): its preemptions and prefix-cache lookups counted, the
        gauges of the `scheduler` it leaves (a cache of `num_blocks` KV blocks), and the tokens
        streamed since the last step (`flush_tokens`; the engine streams between its plans)."""
        self.flush_tokens()
        if output.preempted:
            self.preemptions_total.inc(len(output.preempted))
        if output.num_prefix_queried_tokens:
            self.prefix_cache_queried_tokens_total.inc(output.num_prefix_queried_tokens)
            self.prefix_cache_hit_tokens_total.inc(output.num_prefix_hit_tokens)
        free = scheduler.num_free_blocks
        self.kv_blocks_free.set(free)
        self.kv_blocks_used.set(num_blocks - free)
        self.running_sequences.set(scheduler.num_running)
        self.waiting_sequences.set(scheduler.num_waiting)
        self.prefix_cache_blocks.set(scheduler.num_cached_blocks)
