"""Who is sending the calls that reach a door: each caller's share of the recent ones.

A door at its limit refuses the callers that sent at least an equal share of the calls that
reached it lately (services.common.door). Shares count arrivals, not calls in flight: what a
flood costs a process is its calls' arrival, however soon each is refused, and a victim's
slow, served calls would outnumber a flood's quickly refused ones in flight.

A caller is whom the door's `caller` names. At a gateway with keys it is the tenant of the key
a call presents, and one caller for all missing and unknown keys
(services.gateway.auth.door_caller), so made-up keys cannot outnumber the tenants. Without keys
it is the credential itself, and a flood may present a new one on every call. So a caller's
first call in the window pair is counted for all first calls together (`NEW`, one caller), and
only its later calls for itself: callers that rotate credentials share one share between them,
and do not raise the number of callers the others' shares are measured against (a flood
presenting each credential twice still does: only known keys stop that). At most `max_callers`
new callers are remembered per window, and at most as many again of the previous window's;
calls of others count as first calls. Pure: time comes in as
`now_s` (the door's probe ticks roll the window)."""

from __future__ import annotations

from collections.abc import Iterable

#: The one caller every caller's first call is counted for.
NEW = "\x00new"


def presented_key(authorization: str, api_key: str | None) -> str | None:
    """The API key a call presents: the bearer token of `authorization` (prefix case and
    spaces ignored), else `api_key`. The gateway's authentication and its door read it alike."""
    if authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return api_key


def caller_of(metadata: Iterable[tuple[str, str | bytes]]) -> str:
    """The credential a call's metadata presents (`presented_key`); "" for none."""
    authorization, api_key = "", ""
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str):
            authorization = value
        elif key == "x-api-key" and isinstance(value, str):
            api_key = value
    return presented_key(authorization, api_key) or ""


class CallerShares:
    """Calls per caller over the current window and the previous one (`window_s` each): whether
    a caller had sent at least an equal share of them (1 / the callers seen) before its next
    call."""

    __slots__ = (
        "_counted",
        "_current",
        "_previous",
        "_rolled_s",
        "_totals",
        "max_callers",
        "window_s",
    )

    def __init__(self, window_s: float = 0.5, max_callers: int = 4096) -> None:
        self.window_s = window_s
        self.max_callers = max_callers
        #: caller -> its calls beyond its first, in this window and in the previous one.
        self._current: dict[str, int] = {}
        self._previous: dict[str, int] = {}
        #: Calls in the current window and the previous one.
        self._totals = [0, 0]
        #: Callers with a call counted for themselves (NEW one of them), in either window.
        self._counted = 0
        self._rolled_s = 0.0

    def arrived(self, caller: str) -> bool:
        """Counts a call of `caller`; True if, before it, the caller (or, for its first call,
        all first calls together) had sent at least an equal share of the recent calls."""
        current, previous = self._current, self._previous
        # A caller seen before made its first call as one of NEW's: it counts as its own too.
        first = 1
        if caller not in current:
            known = caller in previous
            # Room for `max_callers` new callers a window, and for the last window's callers
            # beside them: a steady caller keeps its own share when a flood of new
            # credentials fills the window before its first call.
            if len(current) >= (2 if known else 1) * self.max_callers:
                # No room to remember it: counted with the first calls.
                caller, first = NEW, 0
            elif not known:
                current[caller] = 0  # seen: its later calls count for itself
                caller, first = NEW, 0
        sent = current.get(caller, 0)
        own = sent + previous.get(caller, 0)
        total = self._totals[0] + self._totals[1]
        callers = self._counted + (own == 0)
        current[caller] = sent + 1
        self._totals[0] += 1
        if own == 0:
            self._counted += 1
        before = own + first
        return before > 0 and before * callers >= total

    def roll(self, now_s: float) -> None:
        """Starts a new window once the current one is `window_s` old."""
        if now_s - self._rolled_s >= self.window_s:
            self._previous, self._current = self._current, {}
            self._totals = [0, self._totals[0]]
            self._counted = sum(1 for calls in self._previous.values() if calls)
            self._rolled_s = now_s
