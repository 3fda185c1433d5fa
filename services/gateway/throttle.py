"""Adaptive throttling at the gateway: shed locally what downstream is refusing anyway.

Past capacity, a request the router or worker refuses has already cost the gateway its
tokenization and a hop, and the router and worker their share of the two cores they run on:
refusals themselves starve the model. This is the client-side throttling of Google's SRE book
("Handling Overload"): per key (the gateway keys it by model, priority class and tenant:
services.gateway.predictor), over the recent past,

    p(reject locally) = max(0, (requests - k * accepts) / (requests + 1))

where `requests` counts the requests the gateway finished with for the key (refused here, or
answered downstream) and `accepts` those downstream did not refuse for overload. Requests still
in flight count in neither: a burst on a fresh gateway has no answers yet, which says nothing
about overload. While downstream accepts everything, p is 0. Under overload, about k x what
downstream accepts is still sent, so the workers keep full batches of requests they can finish
in time, and the rest is refused here for a fraction of the CPU.

"The recent past" is exponential decay with time constant `memory_s` rather than a fixed
window. One addition to the book: the probability itself fades during a silence (no request and
no answer for the key), with the same time constant. Callers that back off after a refusal
(honouring retry-after) send nothing that could be accepted, and the counts' ratio, which a
silence does not change, would otherwise keep refusing them when they come back, long after
the flood that set it.

Pure: time comes in as `now_s`, randomness as a number in [0, 1) from the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.moving_average import MovingAverage
from services.common.priority import PriorityClass


@dataclass(frozen=True)
class ThrottleConfig:
    """Settings of the adaptive throttle."""

    #: Requests sent per request accepted downstream before local refusals begin (the book's
    #: K). Lower sheds earlier; 1.0 sends only what downstream recently accepted. 0 disables
    #: the throttle.
    accepts_multiplier: float = 1.5
    #: Cap on the local refusal probability: some requests always go through, so that
    #: accepts can be seen again. Without it, once accepts fall to zero (downstream refused
    #: everything for a moment), nearly everything is refused here and downstream never gets
    #: the chance to accept anything again. 0.95 still sheds 20x overload to about 1x.
    max_reject_probability: float = 0.95
    #: Time constant of the decaying counts, seconds.
    memory_s: float = 0.25
    #: Retry hint of a local refusal when downstream has sent none yet, seconds.
    default_retry_after_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.accepts_multiplier == 0 or 1 <= self.accepts_multiplier < math.inf):
            # Below 1 every call counts as excess even when downstream accepts them all: its
            # refusals climb to max_reject_probability against a healthy fleet (review).
            raise ValueError(
                "accepts_multiplier must be 0 (the throttle off) or a finite number >= 1, got "
                f"{self.accepts_multiplier}"
            )
        if not 0 <= self.max_reject_probability < 1:
            raise ValueError("max_reject_probability must be in [0, 1)")
        if not (self.memory_s > 0 and 0 < self.default_retry_after_s < math.inf):
            # 0 refused with no retry-after-ms at all; inf failed INTERNAL (round(inf)).
            raise ValueError("memory_s must be > 0 and default_retry_after_s a finite > 0")

    @property
    def is_enabled(self) -> bool:
        return self.accepts_multiplier > 0


#: Weight of a new downstream retry hint in their moving average.
_HINT_WEIGHT = 0.2
#: A key silent this many memories has no say (its refusal probability is scaled by
#: e^-silence/memory: here below 1e-4) and is forgotten, so that keys (model, class and tenant)
#: seen once do not pile up for the gateway's life (review finding).
FORGET_MEMORIES = 10.0
#: Keys kept before the first sweep for silent ones (each sweep then waits for twice as many).
_SWEEP_AT = 64
#: Seconds one pass of highest_probability over the keys serves the gauges' reads.
HIGHEST_FRESH_S = 1.0


def throttle_key(model: str, priority: PriorityClass, tenant: str) -> str:
    """The key a call is throttled by: its model, class and tenant."""
    return f"{model}/{priority.value}/{tenant}"


@dataclass
class _Counts:
    #: Decaying counts (time constant memory_s), as of `at_s`.
    requests: float = 0.0
    accepts: float = 0.0
    #: Downstream's retry-after hints, seconds (mean None until the first one).
    retry_after_s: MovingAverage = field(default_factory=lambda: MovingAverage(_HINT_WEIGHT))
    at_s: float = 0.0
    #: When a request was last counted (refused here, or answered downstream).
    counted_at_s: float = 0.0

    def decay_to(self, now_s: float, memory_s: float) -> None:
        elapsed_s = now_s - self.at_s
        if elapsed_s > 0:
            factor = math.exp(-elapsed_s / memory_s)
            self.requests *= factor
            self.accepts *= factor
            self.at_s = now_s


@dataclass(frozen=True)
class Shed:
    """Refuse this request here (RESOURCE_EXHAUSTED) and hint a retry after `retry_after_s`."""

    retry_after_s: float
    #: The local refusal probability that applied, for the message.
    probability: float


class AdaptiveThrottle:
    """Per-key (model, class and tenant) decaying counts of requests and downstream accepts,
    and the local decision."""

    def __init__(self, config: ThrottleConfig) -> None:
        self._config = config
        self._counts: dict[str, _Counts] = {}
        self._sweep_at = _SWEEP_AT
        #: highest_probability's last pass: when, and each model's highest.
        self._highest: tuple[float, dict[str, float]] = (-math.inf, {})

    @property
    def num_keys(self) -> int:
        """Keys with counts kept."""
        return len(self._counts)

    def reject_probability(self, model: str, now_s: float) -> float:
        """The probability a request of key `model` arriving now is refused locally."""
        counts = self._counts.get(model)
        if counts is None or not self._config.is_enabled:
            return 0.0
        counts.decay_to(now_s, self._config.memory_s)
        return self._probability(counts, now_s)

    def highest_probability(self, model: str, now_s: float) -> float:
        """The highest refusal probability now of `model`'s online keys (its batch class's
        left out): what its gauge shows. It changes nothing, as it is read from the metrics
        thread (a gauge set by the last call showed that call's draw, 0 for each request
        sent on while 60% were refused: review finding). One pass over the keys serves every
        model's gauge for HIGHEST_FRESH_S."""
        at_s, highest = self._highest
        if not 0.0 <= now_s - at_s <= HIGHEST_FRESH_S:
            highest = {}
            if self._config.is_enabled:
                for key, counts in list(self._counts.items()):  # the loop may add keys
                    name, _, rest = key.partition("/")
                    if rest.partition("/")[0] == PriorityClass.BATCH.value:
                        continue
                    probability = self._probability(counts, now_s)
                    highest[name] = max(probability, highest.get(name, 0.0))
            self._highest = (now_s, highest)
        return highest.get(model, 0.0)

    def _probability(self, counts: _Counts, now_s: float) -> float:
        """The refusal probability of `counts` at `now_s`, their decay to it applied here."""
        memory_s = self._config.memory_s
        factor = math.exp(-max(0.0, now_s - counts.at_s) / memory_s)
        requests = counts.requests * factor
        excess = requests - self._config.accepts_multiplier * counts.accepts * factor
        probability = max(0.0, excess / (requests + 1.0))
        probability *= math.exp(-max(0.0, now_s - counts.counted_at_s) / memory_s)
        return min(probability, self._config.max_reject_probability)

    def admit(self, model: str, now_s: float, draw: float) -> Shed | None:
        """Returns Shed to refuse a request of key `model` here (when `draw`, uniform in [0, 1),
        falls under the refusal probability; it is counted), or None to send it on (`record`
        counts it once downstream answers)."""
        probability = self.reject_probability(model, now_s)
        if draw >= probability:
            return None
        counts = self._counts[model]  # a positive probability means counts exist
        counts.requests += 1.0
        counts.counted_at_s = now_s
        hint_s = counts.retry_after_s.mean
        return Shed(
            retry_after_s=self._config.default_retry_after_s if hint_s is None else hint_s,
            probability=probability,
        )

    def record(
        self, model: str, now_s: float, *, is_accepted: bool, retry_after_s: float | None = None
    ) -> None:
        """Counts downstream's answer to a request that was sent on: accepted (any outcome but
        an overload refusal) or refused, with the retry hint it carried if any."""
        counts = self._counts.get(model)
        if counts is None:  # not setdefault: that would build a _Counts on every call
            if len(self._counts) >= self._sweep_at:
                self._forget_silent(now_s)
            counts = self._counts[model] = _Counts(at_s=now_s)
        counts.decay_to(now_s, self._config.memory_s)
        counts.requests += 1.0
        counts.counted_at_s = now_s
        if is_accepted:
            counts.accepts += 1.0
        if retry_after_s is not None:
            counts.retry_after_s.observe(retry_after_s)

    def _forget_silent(self, now_s: float) -> None:
        """Drops the keys silent for FORGET_MEMORIES; the next sweep waits for twice as many
        keys as are left (each costs a constant per key added)."""
        longest_s = FORGET_MEMORIES * self._config.memory_s
        silent = [k for k, c in self._counts.items() if now_s - c.counted_at_s > longest_s]
        for key in silent:
            del self._counts[key]
        self._sweep_at = max(_SWEEP_AT, 2 * len(self._counts))
