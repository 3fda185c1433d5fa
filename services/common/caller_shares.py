"""Who is sending the calls that reach a door: each caller's share of the recent ones.

A door at its limit refuses the callers that sent at least an equal share of the calls that
reached it lately (services.common.door). Shares count arrivals, not calls in flight: what a
flood costs a process is its calls' arrival, however soon each is refused, and a victim's
slow, served calls would outnumber a flood's quickly refused ones in flight. Pure: time comes
in as `now_s` (the door's probe ticks roll the window)."""

from __future__ import annotations


class CallerShares:
    """Calls per caller over the current window and the previous one (`window_s` each): whether
    a caller had sent at least an equal share of them (1 / the callers seen) before its next
    call. A caller seen for the first time has sent none yet."""

    __slots__ = (
        "_callers",
        "_current",
        "_current_total",
        "_previous",
        "_previous_total",
        "_rolled_s",
        "window_s",
    )

    def __init__(self, window_s: float = 0.5) -> None:
        self.window_s = window_s
        self._current: dict[str, int] = {}
        self._previous: dict[str, int] = {}
        self._current_total = self._previous_total = 0
        #: Distinct callers in the two windows.
        self._callers = 0
        self._rolled_s = 0.0

    def arrived(self, caller: str) -> bool:
        """Counts a call of `caller`; True if, before it, the caller had sent at least an equal
        share of the recent calls."""
        sent = self._current.get(caller, 0)
        earlier = self._previous.get(caller, 0)
        if sent == 0 and earlier == 0:
            self._callers += 1
        before = sent + earlier
        total = self._current_total + self._previous_total
        self._current[caller] = sent + 1
        self._current_total += 1
        return before > 0 and before * self._callers >= total

    def roll(self, now_s: float) -> None:
        """Starts a new window once the current one is `window_s` old."""
        if now_s - self._rolled_s >= self.window_s:
            self._previous, self._previous_total = self._current, self._current_total
            self._current, self._current_total = {}, 0
            self._callers = len(self._previous)
            self._rolled_s = now_s
