"""Whether a model fails every batch on this worker: the worker's side of outlier ejection.
(A generation engine's steps count as its batches: generation.engine.)

A worker whose model fails every row (weights corrupted in memory, a kernel that fails on this
device while the device still runs work, a bug that every input of a version hits) answers at
once. Routers' timeout ejection (services.router.ejection) never sees it, and its short queue
wins the least predicted wait: it drew more than its share of the version's traffic, and failed
all of it.

A batch counts as failed when every row of it failed after bisection
(execution.run_isolated): a poison row fails alone while its batch mates succeed, and a worker
that serves others' rows is not failing. Nor can one request of poison rows make a streak: its
first failed row fails the request, and its rows still queued are withdrawn unrun. The version
is marked failing once its last `batches_to_mark` batches have all failed, spanning at least
`min_span_s`, with no batch of it succeeding in between (and none more than twice `max_hold_s`
after the one before: on a quiet version, a failure long ago is no part of a run now). The
mark goes in the heartbeat (`ModelRecord.is_failing`); routers then route the version
elsewhere while another worker serves it, and to this one only when none is left (Envoy's
panic mode, as for ejection: services.router.ejection.routable_now). A marked version that
gets no traffic has no new failures: the mark lapses `hold_s` after its last failed batch,
routers send to it again, and its next failed batch marks it again at once, for twice as long
(at most `max_hold_s`). A batch that succeeds ends the streak, the mark and the doubling; one
refused unrun (the worker wedged) changes nothing.

Pure but for `note`'s log line: time comes in as `now_s` (the batching driver's clock); it
imports neither asyncio nor grpc (the simulator runs the batching policies).
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass

from services.common.backoff import doubled_s

log = logging.getLogger(__name__)

#: A failed batch more than this many `max_hold_s` after the one before it starts a new streak
#: (a mark lapsed with no traffic ends at most `max_hold_s` after its last failure, and its next
#: failed batch must still mark it again at once).
STALE_HOLDS = 2.0


@dataclass(frozen=True)
class FailingConfig:
    """When a version whose batches all fail is marked failing, and for how long."""

    #: Failed batches in a row, with no success between, that mark a version (0: never).
    batches_to_mark: int = 5
    #: The last `batches_to_mark` failed batches must span at least this long, seconds.
    min_span_s: float = 1.0
    #: How long a mark outlives its last failed batch, seconds; each mark again (no success
    #: since) doubles it.
    hold_s: float = 5.0
    #: The longest a mark outlives its last failed batch, seconds.
    max_hold_s: float = 60.0

    def __post_init__(self) -> None:
        if self.batches_to_mark < 0 or not 0 <= self.min_span_s < math.inf:
            raise ValueError("batches_to_mark and min_span_s must be finite and >= 0")
        if not 0 < self.hold_s <= self.max_hold_s < math.inf:
            raise ValueError("failing holds must satisfy 0 < hold_s <= max_hold_s < inf")


class FailureStreak:
    """One version's run of failed batches on this worker, and whether it is marked failing."""

    def __init__(self, config: FailingConfig) -> None:
        self._config = config
        #: When each of the streak's last `batches_to_mark` failed batches finished.
        self._failed_s: collections.deque[float] = collections.deque(
            maxlen=max(1, config.batches_to_mark)
        )
        #: Marks since the last success (each doubles the hold).
        self._marks = 0
        self._failing_until_s = -math.inf

    def record(self, now_s: float, *, all_failed: bool) -> float | None:
        """A batch of the version finished at `now_s`, every row of it failed or not. Returns
        how long the version is marked failing when this batch marks it (it was not), else
        None."""
        if not all_failed:
            self._failed_s.clear()
            self._marks = 0
            self._failing_until_s = -math.inf
            return None
        config = self._config
        if self._failed_s and now_s - self._failed_s[-1] > STALE_HOLDS * config.max_hold_s:
            # A quiet version: a failure that long ago is no part of a run of failures now.
            self._failed_s.clear()
            self._marks = 0
        self._failed_s.append(now_s)
        if (
            config.batches_to_mark == 0
            or len(self._failed_s) < config.batches_to_mark
            or now_s - self._failed_s[0] < config.min_span_s
        ):
            return None
        was_failing = self.is_failing(now_s)
        if not was_failing:
            self._marks += 1
        hold_s = doubled_s(config.hold_s, self._marks - 1, config.max_hold_s)
        self._failing_until_s = now_s + hold_s
        return None if was_failing else hold_s

    def is_failing(self, now_s: float) -> bool:
        return now_s < self._failing_until_s

    def note(self, labels: tuple[str, str], now_s: float, *, all_failed: bool) -> None:
        """`record`, and a log line when it marks (model, version) `labels` failing."""
        hold_s = self.record(now_s, all_failed=all_failed)
        if hold_s is not None:
            log.warning(
                "%s/%s: its last batches all failed here; marked failing for %.0fs (routers "
                "send its calls elsewhere while another worker serves it)",
                *labels,
                hold_s,
            )
