"""The door's settings (services.common.door): its config, and the settings-table entries a
tier adds for it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.concurrency_limit import LimitConfig
from services.common.settings import Setting

#: The least target derived from an SLO, seconds.
MIN_DERIVED_TARGET_S = 0.005


@dataclass(frozen=True)
class DoorConfig:
    """Settings of a door (services.common.concurrency_limit explains the limit's)."""

    #: Whether the gateway runs a door.
    enabled: bool = True
    #: Guarded calls in flight a process admits while no queue stands in front of it, and
    #: where the limit returns once unused; 0 disables the door.
    initial_limit: int = LimitConfig.initial
    #: The limit never backs off below this...
    min_limit: int = LimitConfig.minimum
    #: ...nor grows above this.
    max_limit: int = LimitConfig.maximum
    #: Queue delay a good queue stays under, seconds; 0: `target_slo_share` of the tightest
    #: SLO of the fixed-cost models the gateway knows (`target_for`).
    target_s: float = 0.0
    #: The target's share of that SLO, when `target_s` is 0.
    target_slo_share: float = 0.25
    #: How long the delay must stay above the target before the limit backs off, seconds.
    interval_s: float = LimitConfig.interval_s
    #: Past how many targets of delay a standing queue is shed (LimitConfig.shed_factor).
    shed_factor: float = LimitConfig.shed_factor
    #: How often the queue's delay is probed, seconds.
    probe_interval_s: float = 0.05
    #: Callers' shares are of the calls of the last one to two windows of this, seconds.
    share_window_s: float = 0.5

    def __post_init__(self) -> None:
        intervals = (self.probe_interval_s, self.share_window_s)
        if self.initial_limit < 0 or not all(0 < s < math.inf for s in intervals):
            # NaN probed on every loop turn; inf never probed, so never limited.
            raise ValueError(
                "door: initial_limit >= 0, probe_interval_s and share_window_s finite and > 0"
            )
        if not (math.isfinite(self.target_s) and self.target_s >= 0) or not (
            0 < self.target_slo_share <= 1
        ):
            raise ValueError("door: target_s >= 0 and target_slo_share in (0, 1]")
        if self.is_enabled:
            self.limit(self.target_for(None))  # validates the rest

    @property
    def is_enabled(self) -> bool:
        return self.enabled and self.initial_limit > 0

    def target_for(self, tightest_slo_s: float | None) -> float:
        """The queue-delay target, seconds: `target_s` if set, else `target_slo_share` of
        `tightest_slo_s` (the tightest SLO of the guarded models; None when there is none,
        then LimitConfig's default), within MIN_DERIVED_TARGET_S and the interval: a target
        past the interval would only see a queue that stood longer than it is judged over, and
        one below a few ms would take the event loop's own jitter for a queue."""
        if self.target_s > 0:
            return self.target_s
        if tightest_slo_s is None:
            return LimitConfig.target_s
        derived_s = self.target_slo_share * tightest_slo_s
        return min(max(derived_s, MIN_DERIVED_TARGET_S), self.interval_s)

    def limit(self, target_s: float) -> LimitConfig:
        return LimitConfig(
            initial=self.initial_limit,
            minimum=self.min_limit,
            maximum=self.max_limit,
            target_s=target_s,
            interval_s=self.interval_s,
            shed_factor=self.shed_factor,
        )


def door_settings() -> tuple[Setting, ...]:
    """The door's settings, for a tier's settings table (its config's field `door`)."""
    return (
        Setting(
            "door",
            bool,
            DoorConfig.enabled,
            "run the door: an adaptive limit on model calls in flight per process, refusing "
            "before any work once a queue stands in front of the process, callers over their "
            "share of it first",
            field="door.enabled",
        ),
        Setting(
            "door_initial_limit",
            int,
            DoorConfig.initial_limit,
            "model calls in flight a process admits while no queue stands in front of it, and "
            "where the adaptive limit returns once unused; 0 disables the door",
            "calls",
            field="door.initial_limit",
        ),
        Setting(
            "door_min_limit",
            int,
            DoorConfig.min_limit,
            "the door's limit never backs off below this",
            "calls",
            field="door.min_limit",
        ),
        Setting(
            "door_max_limit",
            int,
            DoorConfig.max_limit,
            "the door's limit never grows above this",
            "calls",
            field="door.max_limit",
        ),
        Setting(
            "door_target_s",
            float,
            DoorConfig.target_s,
            "queue delay in front of the process a good queue stays under; 0 derives it from "
            "the tightest SLO of the models the gateway knows (door_target_slo_share of it, "
            "at most door_interval_s)",
            "s",
            field="door.target_s",
        ),
        Setting(
            "door_target_slo_share",
            float,
            DoorConfig.target_slo_share,
            "the door's target as a share of the tightest SLO of the models the gateway knows, "
            "when door_target_s is 0",
            "",
            field="door.target_slo_share",
        ),
        Setting(
            "door_interval_s",
            float,
            DoorConfig.interval_s,
            "how long the queue delay must stay above its target before the limit backs off: "
            "a burst that drains sooner is absorbed",
            "s",
            field="door.interval_s",
        ),
        Setting(
            "door_shed_factor",
            float,
            DoorConfig.shed_factor,
            "while the queue in front of the process stands with a delay past this many "
            "targets, the door refuses every model call over its caller's share, whatever is "
            "in flight; 0 never sheds",
            "",
            field="door.shed_factor",
        ),
        Setting(
            "door_probe_interval_s",
            float,
            DoorConfig.probe_interval_s,
            "how often the door probes the queue in front of the process",
            "s",
            field="door.probe_interval_s",
        ),
    )
