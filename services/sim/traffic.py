"""Simulated traffic: Poisson streams per (model, tenant, priority), length mixes, a diurnal
curve and bursts, or a recorded trace of arrival times.

Rates vary in time as base rate x diurnal factor x burst multipliers; arrivals of that
non-homogeneous Poisson process come from thinning a homogeneous one at the peak rate (Lewis &
Shedler), so a seed fixes the whole sequence. Lengths are tokens; the worker maps them to its
length buckets, as the real one does.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any

from services.sim.events import EventLoop

DEFAULT_PRIORITY = "interactive"


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as it reaches the gateway."""

    at_s: float
    model: str
    tenant: str
    priority: str
    num_tokens: int
    #: The caller's deadline, seconds after arrival (None: the model's default timeout).
    timeout_s: float | None = None


@dataclass(frozen=True)
class LengthMix:
    """Input lengths in tokens and their weights (a discrete distribution)."""

    tokens: tuple[int, ...] = (16,)
    weights: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.weights) or not self.tokens:
            raise ValueError("a length mix needs as many weights as lengths, at least one")
        if min(self.tokens) < 1 or min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError("lengths must be >= 1 token and weights >= 0, not all 0")

    def sampler(self, rng: random.Random) -> Iterator[int]:
        total = sum(self.weights)
        cumulative = list(accumulate(w / total for w in self.weights))
        tokens = self.tokens
        while True:
            yield tokens[min(bisect.bisect_left(cumulative, rng.random()), len(tokens) - 1)]

    def mean_tokens(self) -> float:
        return sum(t * w for t, w in zip(self.tokens, self.weights, strict=True)) / sum(
            self.weights
        )


@dataclass(frozen=True)
class Stream:
    """Poisson arrivals of one (model, tenant, priority) at `rate_per_s` (before the curve)."""

    model: str
    rate_per_s: float
    tenant: str = "default"
    priority: str = DEFAULT_PRIORITY
    lengths: LengthMix = field(default_factory=LengthMix)
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s >= 0):
            raise ValueError(f"a stream's rate_per_s must be finite and >= 0: {self.rate_per_s}")


@dataclass(frozen=True)
class Diurnal:
    """Rate factor 1 + amplitude x cos(2 pi (t - peak_at_s) / period_s)."""

    amplitude: float = 0.0
    period_s: float = 86400.0
    peak_at_s: float = 0.0

    def factor(self, time_s: float) -> float:
        phase = 2.0 * math.pi * (time_s - self.peak_at_s) / self.period_s
        return max(0.0, 1.0 + self.amplitude * math.cos(phase))


@dataclass(frozen=True)
class Burst:
    """Between start_s and start_s + duration_s, the streams matching (all when empty) run at
    `multiplier` times their rate."""

    start_s: float
    duration_s: float
    multiplier: float
    tenant: str = ""

    def applies(self, time_s: float, stream: Stream) -> bool:
        in_window = self.start_s <= time_s < self.start_s + self.duration_s
        return in_window and (not self.tenant or self.tenant == stream.tenant)


@dataclass(frozen=True)
class Traffic:
    """The offered load: streams shaped by a diurnal curve and bursts, or a recorded trace."""

    streams: tuple[Stream, ...] = ()
    diurnal: Diurnal = field(default_factory=Diurnal)
    bursts: tuple[Burst, ...] = ()
    trace: tuple[Arrival, ...] = ()

    def rate_per_s(self, time_s: float, stream: Stream) -> float:
        rate = stream.rate_per_s * self.diurnal.factor(time_s)
        for burst in self.bursts:
            if burst.applies(time_s, stream):
                rate *= burst.multiplier
        return rate

    def mean_rate_per_s(self, stream: Stream, duration_s: float) -> float:
        """The stream's rate averaged over [0, `duration_s`): the diurnal curve integrated
        piecewise between the bursts' edges, where each burst's multiplier is constant (a
        fixed grid of midpoints missed a burst between two of them, or counted one as long as
        a whole step: simulator review)."""
        edges = {0.0, duration_s}
        for burst in self.bursts:
            edges.update(t for t in (burst.start_s, burst.start_s + burst.duration_s)
                         if 0.0 < t < duration_s)  # fmt: skip
        bounds = sorted(edges)
        total = 0.0
        for start_s, end_s in pairwise(bounds):
            width_s = end_s - start_s
            # Midpoints a 64th of a diurnal period apart at most: within 0.1% of the curve's
            # integral.
            steps = max(1, math.ceil(64 * width_s / self.diurnal.period_s))
            step_s = width_s / steps
            total += step_s * sum(
                self.rate_per_s(start_s + (i + 0.5) * step_s, stream) for i in range(steps)
            )
        return total / duration_s

    def total_rate_per_s(self, time_s: float) -> float:
        return sum(self.rate_per_s(time_s, s) for s in self.streams)

    def peak_rate_per_s(self, stream: Stream) -> float:
        """An upper bound of the stream's rate over any time (the thinning envelope)."""
        multiplier = 1.0
        for burst in self.bursts:
            if not burst.tenant or burst.tenant == stream.tenant:
                multiplier *= max(1.0, burst.multiplier)
        return stream.rate_per_s * (1.0 + abs(self.diurnal.amplitude)) * multiplier

    def scaled(self, factor: float, seed: int = 0) -> Traffic:
        """The same shape at `factor` times every stream's rate; a trace's arrivals each
        replayed `factor` times on average (its whole part, and once more with the rest as
        chance, drawn from `seed`: 1.2 replays a fifth of them twice), in time order."""
        streams = tuple(replace(s, rate_per_s=s.rate_per_s * factor) for s in self.streams)
        if not self.trace or factor == 1.0:
            return replace(self, streams=streams)
        rng, whole = random.Random(seed), int(factor)
        trace = tuple(
            arrival
            for arrival in self.trace
            for _ in range(whole + (rng.random() < factor - whole))
        )
        return replace(self, streams=streams, trace=trace)

    def arrivals(self, seed: int, until_s: float) -> Iterator[Arrival]:
        """Arrivals in time order before `until_s`: the trace, else the streams thinned."""
        if self.trace:
            yield from (a for a in self.trace if a.at_s < until_s)
            return
        rng = random.Random(seed)
        envelopes = [self.peak_rate_per_s(s) for s in self.streams]
        total = sum(envelopes)
        if total <= 0:
            return
        cumulative = list(accumulate(e / total for e in envelopes))
        lengths = [s.lengths.sampler(rng) for s in self.streams]
        time_s = 0.0
        while True:
            time_s += rng.expovariate(total)
            if time_s >= until_s:
                return
            index = min(bisect.bisect_left(cumulative, rng.random()), len(envelopes) - 1)
            stream = self.streams[index]
            if rng.random() * envelopes[index] >= self.rate_per_s(time_s, stream):
                continue
            yield Arrival(
                time_s,
                stream.model,
                stream.tenant,
                stream.priority,
                next(lengths[index]),
                stream.timeout_s,
            )


def load_trace(path: Path, *, default_model: str) -> tuple[Arrival, ...]:
    """Arrivals from a CSV (header row) or JSONL file: `at_s` required; `model`, `tenant`,
    `priority`, `num_tokens`, `timeout_s` optional. Sorted by time."""
    if path.suffix == ".jsonl":
        rows: list[Mapping[str, Any]] = [
            json.loads(line) for line in path.read_text().splitlines() if line.strip()
        ]
    else:
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
    arrivals = [_arrival(row, default_model) for row in rows]
    return tuple(sorted(arrivals, key=lambda a: a.at_s))


def _arrival(row: Mapping[str, Any], default_model: str) -> Arrival:
    if "at_s" not in row:
        raise ValueError(f"trace row without at_s: {dict(row)}")
    timeout = row.get("timeout_s")
    return Arrival(
        at_s=float(row["at_s"]),
        model=str(row.get("model") or default_model),
        tenant=str(row.get("tenant") or "default"),
        priority=str(row.get("priority") or DEFAULT_PRIORITY),
        num_tokens=int(row.get("num_tokens") or 16),
        timeout_s=float(timeout) if timeout not in (None, "") else None,
    )


def write_trace(path: Path, arrivals: Sequence[Arrival]) -> None:
    """Writes arrivals as a CSV trace `load_trace` reads back."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["at_s", "model", "tenant", "priority", "num_tokens", "timeout_s"])
        for a in arrivals:
            timeout = "" if a.timeout_s is None else a.timeout_s
            writer.writerow([a.at_s, a.model, a.tenant, a.priority, a.num_tokens, timeout])


def schedule_arrivals(
    loop: EventLoop, on_arrival: Callable[[float, Arrival], None], arrivals: Iterator[Arrival]
) -> None:
    """Schedules `arrivals` one at a time, each by the one before it (the loop holds one pending
    arrival, not all): in time order, so on a line of the loop rather than its heap."""
    line = loop.line()

    def arrive(now_s: float, arrival: Arrival) -> None:
        on_arrival(now_s, arrival)
        following = next(arrivals, None)
        if following is not None:
            line.at(following.at_s, arrive, following)

    first = next(arrivals, None)
    if first is not None:
        line.at(first.at_s, arrive, first)
