"""Beats: a supervised child's event loop touches a file beside its ready file every
BEAT_PERIOD_S, whatever else it does (serving, draining), so that its supervisor (a worker
engine watching its fronts, a gateway group watching its processes) can tell a hung loop from
a busy one. A listening child that has not beaten for HUNG_S is killed, to be restarted: its
share of the port's connections would hang with it, and nothing else ends it while it lives.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: How often a child touches its beat file.
BEAT_PERIOD_S = 0.5
#: How long a listening child may go without a beat before its supervisor kills it: 30 beats.
HUNG_S = 15.0


def beat_file(ready_file: Path) -> Path:
    """The file a child touches (`beat`), beside its ready file."""
    return ready_file.with_suffix(".beat")


async def beat(path: Path) -> None:
    """Touches `path` every BEAT_PERIOD_S until cancelled, a failure logged."""
    while True:
        try:
            path.touch()
        except OSError as error:
            log.warning("could not touch %s: %s", path, error)
        await asyncio.sleep(BEAT_PERIOD_S)


@dataclass
class BeatWatch:
    """What a supervisor has seen of one child's beats."""

    #: Its beat file's last modification time seen (ns; 0: none), and when it was first seen.
    beat_ns: int = 0
    beat_seen_s: float | None = None

    def is_hung(self, ready_file: Path, now_s: float) -> bool:
        """Whether the beat file beside `ready_file` has not changed for HUNG_S (counted from
        the first look: ask only once the child listens). A child with no beat file yet is
        not judged (it could not write one: a fault of its disk, not of its loop, logged by
        it), nor one whose file cannot be looked at now. One that can no longer touch its
        file (its directory remounted read-only) is taken for hung."""
        try:
            beat_ns = beat_file(ready_file).stat().st_mtime_ns
        except OSError:  # missing, or unreadable now: the watch must go on
            return False
        if self.beat_seen_s is None or beat_ns != self.beat_ns:
            self.beat_ns, self.beat_seen_s = beat_ns, now_s
            return False
        return now_s - self.beat_seen_s > HUNG_S

    def killed(self, now_s: float) -> None:
        """Its child was killed for not beating: not judged (nor logged) again until HUNG_S
        more."""
        self.beat_seen_s = now_s
