"""The router's routing and admission settings (`RoutingConfig`), as `RouteTable` (routing.py)
takes them: liveness and staleness limits, ejection periods, the deadline margin and how
candidates are sampled. Validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.router.ejection import TimeoutEjectionConfig


@dataclass(frozen=True)
class RoutingConfig:
    """The router's routing and admission settings."""

    #: A worker whose heartbeat was older than this at the last refresh is dead (seconds).
    stale_after_s: float = 3.0
    #: If the snapshot has not been refreshed for this long (Redis unreachable), every route is
    #: rejected with NO_WORKER: past this, the last good snapshot is too old to trust (seconds).
    max_snapshot_age_s: float = 120.0
    #: How long a worker whose call failed with UNAVAILABLE is skipped (seconds).
    eject_s: float = 5.0
    #: A worker's reported queue counts while the snapshot is younger than this; past it (Redis
    #: slow or down) only this router's own reservations count (seconds). Queues drain in
    #: batches of milliseconds: a frozen report would steer traffic away for the whole outage.
    queue_report_ttl_s: float = 1.0
    #: Safety margin kept between predicted completion and the deadline (seconds).
    deadline_margin_s: float = 0.005
    #: Use power-of-two-choices when there are more candidates than this; else exact minimum.
    power_of_two_threshold: int = 4
    #: Share of routes that draw one other worker at random and go there if it is idle and can
    #: take them in time: a worker's estimates refresh only from traffic it serves, so one
    #: warmed up on a busy machine (a replacement under load) could look slower forever and
    #: never get any.
    explore_share: float = 0.05
    #: Consecutive timeouts (no success between) that eject a worker; 0: never (see
    #: services.router.ejection).
    timeouts_to_eject: int = TimeoutEjectionConfig.timeouts_to_eject
    #: First ejection period of a worker whose calls only time out; repeats double it (s).
    timeout_eject_s: float = TimeoutEjectionConfig.eject_s
    #: Longest ejection period of a worker whose calls only time out (seconds).
    max_timeout_eject_s: float = TimeoutEjectionConfig.max_eject_s

    @property
    def timeout_ejection(self) -> TimeoutEjectionConfig:
        """The timeout-ejection settings as the ejector takes them (raises ValueError)."""
        return TimeoutEjectionConfig(
            self.timeouts_to_eject, self.timeout_eject_s, self.max_timeout_eject_s
        )

    def __post_init__(self) -> None:
        durations = (
            self.stale_after_s,
            self.max_snapshot_age_s,
            self.eject_s,
            self.queue_report_ttl_s,
        )
        if not all(0 <= d < math.inf for d in (*durations, self.deadline_margin_s)):
            # Not `min(...) < 0`: NaN first in line passes it.
            raise ValueError("routing durations and margin must be finite and >= 0 seconds")
        # At 0 every worker is dead, and every snapshot too old: every call refused NO_WORKER
        # by a router that starts and looks well (settings review).
        if not (self.stale_after_s > 0 and self.max_snapshot_age_s > 0):
            raise ValueError("stale_after_s and max_snapshot_age_s must be > 0 seconds")
        if not 0.0 <= self.explore_share <= 1.0:
            raise ValueError("explore_share must be in [0, 1]")
        if self.power_of_two_threshold < 1:
            raise ValueError("power_of_two_threshold must be >= 1")
        _ = self.timeout_ejection  # bad ejection settings fail here, at start-up
