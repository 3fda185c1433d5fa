"""Adaptive throttling: a client refuses some of its own calls while the gateway refuses many.

Why: a gateway refuses a call for load at about the CPU of one bare gRPC call, a third to a
half of what serving one costs it (docs/architecture.md, "What bounds a flood's goodput"). So
past about twice its capacity, a gateway that only refuses spends as much on refusing as on
serving, and what it serves falls however well it chooses what to refuse. A call the client
refuses itself costs the gateway nothing.

How (Google's SRE book, "Handling Overload", client-side throttling): over the last
`window_s` the client counts the calls it was asked to make (`requests`: those it refused
itself, and those it sent once their answer is in) and those the gateway accepted (`accepts`:
every outcome but a refusal for load, a call dropped unseen or a deadline missed,
`NOT_ACCEPTED`), and refuses a new call itself with probability

    max(0, (requests - accept_ratio * accepts) / (requests + 1))

The gateway then sees about `accept_ratio` times the calls it accepts: a little more than it
can take, so it goes on refusing a few (and the client goes on learning how many it takes),
and the rest cost it nothing. While it accepts at least 1 in `accept_ratio` of the calls,
nothing is refused. Calls still in flight are not counted (Envoy's admission control counts
at completion too), so a burst of calls to a healthy gateway is sent whole. Nothing is refused
while fewer than `min_requests` calls were counted in the window, so a client making a few
calls a second does not refuse itself after one refusal. The window is short: within
`window_s` of a flood's end the client sends every call again.

The policy is pure: time (`now_s`, monotonic seconds) and chance (`draw`, uniform in [0, 1))
come in as arguments. It is thread-safe (the client is).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

#: Outcomes that do not count as accepted (gRPC status code names): a refusal for load, a call
#: the gateway's gRPC dropped unseen (CANCELLED), a deadline missed (the call waited in a queue
#: the gateway could not drain in time). Not UNAVAILABLE: a gateway that cannot be reached
#: spends nothing on the call, and its callers should see UNAVAILABLE, not a local refusal.
NOT_ACCEPTED = frozenset({"RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED"})
#: The window is counted in this many slices, each dropped whole once it is `window_s` old.
_SLICES = 10


@dataclass(frozen=True)
class ThrottlePolicy:
    """When a client refuses its own calls (`AdaptiveThrottle`)."""

    #: The gateway is sent about this multiple of the calls it accepts (the SRE book's K; 2
    #: there, where a refusal costs a server little). Lower refuses sooner: at 1.1 a gateway
    #: flooded at twice what it accepts gets one refusal in 11 of its calls, not one in 2.
    accept_ratio: float = 1.1
    #: The calls counted are those of the last this many seconds.
    window_s: float = 2.0
    #: Nothing is refused while fewer calls than this were counted in the window.
    min_requests: int = 20

    def __post_init__(self) -> None:
        if not self.accept_ratio >= 1:
            raise ValueError(f"accept_ratio must be >= 1, got {self.accept_ratio}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.min_requests < 0:
            raise ValueError(f"min_requests must be >= 0, got {self.min_requests}")


#: What a client throttles with unless told otherwise.
DEFAULT_THROTTLE = ThrottlePolicy()


def is_accepted(code: str) -> bool:
    """Whether a call that ended with status `code` (a name: "OK", "RESOURCE_EXHAUSTED")
    counts as accepted by the gateway."""
    return code not in NOT_ACCEPTED


@dataclass
class _Slice:
    """The calls counted from `start_s` on, until the next slice starts."""

    start_s: float
    num_requests: int = 0
    num_accepts: int = 0


class AdaptiveThrottle:
    """Counts one client's calls and their acceptance; `admits` says whether to send the next.

    Each call asks `admits()` once, before its first attempt; each call sent reports how it
    ended once (`record`), after its retries: requests and accepts are the application's
    calls, not the attempts (retries have their own budget)."""

    def __init__(self, policy: ThrottlePolicy = DEFAULT_THROTTLE) -> None:
        self.policy = policy
        self._slice_s = policy.window_s / _SLICES
        self._slices: deque[_Slice] = deque()  # oldest first
        self._num_requests = 0
        self._num_accepts = 0
        self._lock = threading.Lock()

    def admits(self, now_s: float, draw: float) -> bool:
        """Whether to send a call asked for now; `draw` is uniform in [0, 1). A call refused
        here counts as a request at once; one sent counts when `record`ed."""
        with self._lock:
            current = self._current(now_s)
            probability = self._probability()
            if not draw < probability:
                return True
            current.num_requests += 1
            self._num_requests += 1
            return False

    def record(self, now_s: float, *, accepted: bool) -> None:
        """How a call `admits` let through ended: accepted by the gateway or not
        (`is_accepted` of its status)."""
        with self._lock:
            current = self._current(now_s)
            current.num_requests += 1
            self._num_requests += 1
            if accepted:
                current.num_accepts += 1
                self._num_accepts += 1

    def refusal_probability(self, now_s: float) -> float:
        """The chance that a call asked for now is refused here."""
        with self._lock:
            self._current(now_s)
            return self._probability()

    def counts(self, now_s: float) -> tuple[int, int]:
        """(requests, accepts) counted in the window now."""
        with self._lock:
            self._current(now_s)
            return self._num_requests, self._num_accepts

    def _probability(self) -> float:
        if self._num_requests < self.policy.min_requests:
            return 0.0
        excess = self._num_requests - self.policy.accept_ratio * self._num_accepts
        return max(0.0, excess / (self._num_requests + 1))

    def _current(self, now_s: float) -> _Slice:
        """The slice counting now, after dropping those a window old."""
        slices = self._slices
        while slices and slices[0].start_s <= now_s - self.policy.window_s:
            gone = slices.popleft()
            self._num_requests -= gone.num_requests
            self._num_accepts -= gone.num_accepts
        if not slices or now_s >= slices[-1].start_s + self._slice_s:
            slices.append(_Slice(now_s))
        return slices[-1]
