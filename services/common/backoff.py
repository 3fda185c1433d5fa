"""Doubling pauses between attempts, as loops that retry for a process's whole life use them."""

from __future__ import annotations

#: Doublings past which a pause is at its cap for any cap a loop has (2**32 times any period):
#: counting further would overflow a float after about 1,024 failures (a Redis away for an
#: hour and a half), and a loop that died of it would stop retrying for good.
_MAX_DOUBLINGS = 32


def doubled_s(period_s: float, doublings: int, cap_s: float) -> float:
    """`period_s` doubled `doublings` times (none below 0), at most `cap_s`."""
    return min(cap_s, period_s * 2.0 ** min(max(0, doublings), _MAX_DOUBLINGS))
