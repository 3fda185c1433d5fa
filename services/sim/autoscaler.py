"""The Kubernetes HorizontalPodAutoscaler's rule (autoscaling/v2), restated as a pure policy.

Every sync period (15 s) the HPA computes

    desired = ceil(ready_replicas x metric / target)

and keeps the current count when |metric / target - 1| <= tolerance (0.1). Scale-down is
stabilised: the replicas used is the highest recommendation of the last 300 s, so a dip does not
shed workers that the next minute needs. Scale-up is bounded by the default policies: per
15 s, at most max(100% of the current replicas, 4 pods) more (selectPolicy Max).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class HpaConfig:
    """The HPA's settings; defaults are Kubernetes' own."""

    #: The per-worker metric's target: seconds of queue wait or backlog, or a utilisation
    #: fraction.
    target: float
    #: "queue_wait" (mean seconds a row waits before its batch runs), "backlog" (the part of
    #: that wait spent behind other batches, linger excluded), "cpu" (the worker process's CPU
    #: utilisation), or "gpu" (executor-busy fraction).
    metric: str = "queue_wait"
    min_replicas: int = 1
    max_replicas: int = 100
    sync_period_s: float = 15.0
    tolerance: float = 0.1
    scale_down_window_s: float = 300.0
    scale_up_window_s: float = 0.0
    #: Scale-up policies, per `scale_up_period_s`: this many pods, or this share of current.
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    scale_up_period_s: float = 15.0

    def __post_init__(self) -> None:
        if self.metric not in ("queue_wait", "backlog", "cpu", "gpu"):
            raise ValueError(f"unknown HPA metric {self.metric!r}: queue_wait, backlog, cpu, gpu")
        if self.target <= 0 or not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("HPA target must be > 0 and 1 <= min_replicas <= max_replicas")


class HorizontalAutoscaler:
    """The recommendation history and the rule; time comes in as `now_s`."""

    def __init__(self, config: HpaConfig) -> None:
        self.config = config
        #: (time, recommendation) of the stabilisation windows.
        self._recommendations: deque[tuple[float, int]] = deque()
        #: (time, replicas added) of recent scale-ups, for the scale-up policies.
        self._scale_ups: deque[tuple[float, int]] = deque()

    def raw_recommendation(self, current: int, ready: int, metric: float) -> int:
        """ceil(ready x metric / target), or `current` within the tolerance."""
        ratio = metric / self.config.target
        if abs(ratio - 1.0) <= self.config.tolerance or ready == 0:
            return current
        return max(1, math.ceil(ready * ratio))

    def desired(self, now_s: float, current: int, ready: int, metric: float) -> int:
        """The replica count to set now, given `current` replicas of which `ready` report."""
        cfg = self.config
        raw = self.raw_recommendation(current, ready, metric)
        raw = min(max(raw, cfg.min_replicas), cfg.max_replicas)
        self._recommendations.append((now_s, raw))
        horizon_s = max(cfg.scale_down_window_s, cfg.scale_up_window_s)
        while self._recommendations and self._recommendations[0][0] < now_s - horizon_s:
            self._recommendations.popleft()
        down_floor = max(
            r for t, r in self._recommendations if t >= now_s - cfg.scale_down_window_s
        )
        up_ceiling = min(r for t, r in self._recommendations if t >= now_s - cfg.scale_up_window_s)
        if raw > current:
            desired = min(up_ceiling, self._scale_up_limit(now_s, current))
        elif raw < current:
            desired = min(down_floor, current)
        else:
            desired = current
        desired = min(max(desired, cfg.min_replicas), cfg.max_replicas)
        if desired > current:
            self._scale_ups.append((now_s, desired - current))
        return desired

    def _scale_up_limit(self, now_s: float, current: int) -> int:
        cfg = self.config
        while self._scale_ups and self._scale_ups[0][0] <= now_s - cfg.scale_up_period_s:
            self._scale_ups.popleft()
        added = sum(n for _, n in self._scale_ups)
        start = current - added
        allowed = max(cfg.scale_up_pods, math.ceil(start * cfg.scale_up_percent / 100.0))
        return max(current, start + allowed)
