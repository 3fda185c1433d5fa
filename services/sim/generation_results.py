"""What a simulated generation run measured: per-stream outcomes and the summary.

As for the embedding runs, only arrivals after the warm-up count. Latencies are the client's:
TTFT from arrival at the gateway to its first token back (hops included), TPOT the mean gap
between its tokens, end to end to its last token back. Output tokens per second count every
token emitted inside the measured window, whoever asked. Goodput counts streams that ran to
the end with their TTFT within the SLO, per second.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.sim.generation import SimGenerationWorker, SimStream


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    """One stream that ran to its end, as its client saw it (seconds)."""

    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float
    #: Mean time between its tokens; None for a single-token reply.
    tpot_s: float | None
    e2e_s: float
    num_preemptions: int


class GenerationRecorder:
    """Collects outcomes as the run produces them."""

    def __init__(self, *, ttft_slo_s: float, warmup_s: float, duration_s: float) -> None:
        self.ttft_slo_s = ttft_slo_s
        self.warmup_s = warmup_s
        self.duration_s = duration_s
        self.num_arrivals = 0
        #: Streams that ran to the end, arrived after the warm-up.
        self.outcomes: list[StreamOutcome] = []
        self.refusals: Counter[str] = Counter()
        #: Tokens emitted inside [warmup_s, duration_s).
        self.num_window_tokens = 0

    def arrived(self, arrival_s: float) -> None:
        if arrival_s >= self.warmup_s:
            self.num_arrivals += 1

    def refused(self, arrival_s: float, reason: str) -> None:
        if arrival_s >= self.warmup_s:
            self.refusals[reason] += 1

    def tokens(self, now_s: float, num_tokens: int) -> None:
        if self.warmup_s <= now_s < self.duration_s:
            self.num_window_tokens += num_tokens

    def finished(self, stream: SimStream, *, downstream_s: float) -> None:
        """`stream` ran to its end; its tokens reach the client `downstream_s` after the
        worker emits them."""
        arrival_s = stream.arrival.at_s
        first_s, last_s = stream.first_token_s, stream.last_token_s
        if arrival_s < self.warmup_s or first_s is None or last_s is None:
            return
        num_tokens = stream.num_emitted
        self.outcomes.append(
            StreamOutcome(
                arrival_s=arrival_s,
                num_prompt_tokens=stream.arrival.num_tokens,
                num_output_tokens=num_tokens,
                ttft_s=first_s + downstream_s - arrival_s,
                tpot_s=(last_s - first_s) / (num_tokens - 1) if num_tokens > 1 else None,
                e2e_s=last_s + downstream_s - arrival_s,
                num_preemptions=stream.num_preemptions,
            )
        )


def summarize_generation(
    recorder: GenerationRecorder,
    workers: Sequence[SimGenerationWorker],
    *,
    wall_s: float,
    num_events: int,
) -> dict[str, Any]:
    """The JSON summary of one generation run (step counts are the whole run's)."""
    window_s = max(recorder.duration_s - recorder.warmup_s, 1e-9)
    outcomes = recorder.outcomes
    ttfts = [o.ttft_s for o in outcomes]
    tpots = [o.tpot_s for o in outcomes if o.tpot_s is not None]
    e2es = [o.e2e_s for o in outcomes]
    num_good = sum(o.ttft_s <= recorder.ttft_slo_s for o in outcomes)
    arrivals = recorder.num_arrivals
    num_refused = sum(recorder.refusals.values())
    steps = sum(w.num_steps for w in workers)
    return {
        "simulated_s": recorder.duration_s,
        "measured_s": window_s,
        "wall_s": round(wall_s, 3),
        "events": num_events,
        "workers": len(workers),
        "offered_per_s": arrivals / window_s,
        "answered": len(outcomes),
        # Admitted, and neither finished nor expired when the run's drain ended.
        "unfinished": arrivals - len(outcomes) - num_refused,
        "goodput_per_s": num_good / window_s,
        "ttft_slo_attainment": num_good / arrivals if arrivals else math.nan,
        "ttft_ms": _ms(ttfts),
        "tpot_ms": _ms(tpots),
        "e2e_ms": _ms(e2es),
        "output_tokens_per_s": recorder.num_window_tokens / window_s,
        "mean_output_tokens": (
            sum(o.num_output_tokens for o in outcomes) / len(outcomes) if outcomes else 0.0
        ),
        "refusals": dict(sorted(recorder.refusals.items())),
        "preemptions": sum(w.num_preemptions for w in workers),
        "streams_preempted": sum(o.num_preemptions > 0 for o in outcomes),
        "steps": steps,
        "mean_running_seqs": (
            sum(w.num_scheduled_total for w in workers) / steps if steps else 0.0
        ),
        "mean_batched_tokens": (
            sum(w.num_batched_tokens_total for w in workers) / steps if steps else 0.0
        ),
        "mean_step_ms": sum(w.busy_s_total for w in workers) / steps * 1e3 if steps else 0.0,
    }


def _ms(values: Sequence[float]) -> dict[str, float]:
    """p50 and p99 in milliseconds; NaN with no values."""
    if not values:
        return {"p50": math.nan, "p99": math.nan}
    p50, p99 = np.percentile(np.asarray(values), (50, 99))
    return {"p50": float(p50) * 1e3, "p99": float(p99) * 1e3}
