"""A host whose CPU cores the model shares with the tiers in front of it.

On a GPU fleet the gateways and routers run on other machines and the model runs on its GPU, so
nothing here applies (`HostConfig.cores == 0`, the default). On a CPU-only machine, such as the
local stack on a 2-core box, the model's threads, the gateway, the router, the worker's own
Python and the load generator all run on the same cores. Then the in-stack latency curve,
measured one request at a time, describes a model that had the cores to itself; under load the
tiers take a share of them and every batch runs longer, and the hops wait for cores the model
holds. That is why the real stack saturates well before the capacity its idle curve implies.

The model here is processor sharing, smoothed over `window_s`:
- the tiers' load `L` (cores) is the CPU seconds they spend per request times the request rate;
- the model, while it runs, wants `model_threads` cores (torch's intra-op threads spin);
- a batch runs `max(1, (model_threads + L) / cores)` times longer than the curve says;
- a hop's thread competes with the tiers alone, `max(1, (L + 1) / cores)`: it is woken by its
  socket and the kernel's scheduler runs it ahead of the model's threads, which have used
  their share of the cores (and spin while they wait), so a running model does not delay it.
  Measured through the local stack on 2 cores (`bench/sim_validation.py`'s hops column): the
  hops' mean under traffic at 0.2-0.4 of capacity was 6.1-7.3 ms, against 6.6-7.2 ms one call
  at a time; an earlier rule that also made a hop wait for the model's threads while a batch
  ran, `(model_threads + L + 1) / cores` for the model's busy share of the time, simulated
  9.8-13.6 ms and put the simulated p50 at 1.16-1.39x the real one.
Both factors are 1 at idle, so a curve and hops calibrated one request at a time stay exact there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HostConfig:
    """The shared host; `cores == 0` means the tiers run elsewhere (no sharing)."""

    cores: float = 0.0
    #: CPU seconds the co-located tiers (gateway, router, the worker's request handling, the
    #: load generator) spend per request, measured at low load.
    tier_cpu_s: float = 0.0
    #: Cores the model's parallel regions occupy while a batch runs (0: all `cores`).
    model_threads: float = 0.0
    #: Time constant of the load estimates, seconds.
    window_s: float = 1.0

    def __post_init__(self) -> None:
        if self.cores < 0 or self.tier_cpu_s < 0 or self.model_threads < 0:
            raise ValueError("host cores, tier_cpu_s and model_threads must be >= 0")
        if self.window_s <= 0:
            raise ValueError("host window_s must be > 0")

    @property
    def is_shared(self) -> bool:
        return self.cores > 0


class _Decaying:
    """An amount that decays with time constant `window_s`: amount / window_s is a rate."""

    __slots__ = ("_amount", "_at_s", "_window_s")

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._amount = 0.0
        self._at_s = 0.0

    def add(self, now_s: float, amount: float) -> None:
        self._amount = self.value(now_s) + amount
        self._at_s = now_s

    def value(self, now_s: float) -> float:
        return self._amount * math.exp(-(now_s - self._at_s) / self._window_s)

    def rate(self, now_s: float) -> float:
        return self.value(now_s) / self._window_s


class SharedHost:
    """The CPU one worker shares with its tiers: slow-down factors for compute and hops."""

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self._threads = config.model_threads or config.cores
        self._tier_cpu = _Decaying(config.window_s)

    def request(self, now_s: float) -> None:
        """A request reached this worker's host: its tiers spent `tier_cpu_s` on it."""
        self._tier_cpu.add(now_s, self.config.tier_cpu_s)

    def tier_load(self, now_s: float) -> float:
        """Cores the tiers use, smoothed."""
        return self._tier_cpu.rate(now_s)

    def compute_stretch(self, now_s: float) -> float:
        """How many times longer than its curve a batch starting now runs."""
        if not self.config.is_shared:
            return 1.0
        return max(1.0, (self._threads + self.tier_load(now_s)) / self.config.cores)

    def hop_stretch(self, now_s: float) -> float:
        """How many times longer than at idle a hop starting now takes: only the tiers' own
        load, with the hop's thread, can outgrow the cores (the module's doc)."""
        if not self.config.is_shared:
            return 1.0
        return max(1.0, (self.tier_load(now_s) + 1.0) / self.config.cores)
