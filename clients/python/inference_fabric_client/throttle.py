"""Adaptive throttling: a client refuses some of its own calls while the gateway refuses many.

Why: a gateway refuses a call for load at about the CPU of one bare gRPC call, a third to a
half of what serving one costs it (docs/architecture.md, "What bounds a flood's goodput"). So
past about twice its capacity, a gateway that only refuses spends as much on refusing as on
serving, and what it serves falls however well it chooses what to refuse. A call the client
refuses itself costs the gateway nothing.

How (Google's SRE book, "Handling Overload", client-side throttling): over the last
`window_s` the client counts the calls it was asked to make and those the gateway accepted
(`accepts`: every call sent but those it refused for load or dropped unseen, `NOT_ACCEPTED`),
and refuses a new call itself with probability

    max(0, (requests - accept_ratio * accepts) / (requests + 1))

The gateway then sees about `accept_ratio` times the calls it accepts: a little more than it
can take, so it goes on refusing a few (and the client goes on learning how many it takes),
and the rest cost it nothing. A client that retries refusals does not while its throttle
refuses (client.py): a call retried until accepted would hide the refusal from it.

Two departures from the book, each for a failure its formula has with an `accept_ratio` this
low (the book's is 2):
- A call sent counts as accepted until it ends otherwise, and its end counts with the calls
  asked for when it was (`record`'s `asked_s`). So a burst to a healthy gateway is sent whole,
  and a gateway that refuses at once while it answers slowly does not read as refusing all.
- `requests` are the calls sent, plus those refused here weighed by how much the gateway still
  refuses of what it is sent (`ThrottleCounts.requests`). Counted whole, as the book counts
  them, a flood's own refusals keep the client refusing after the flood: the share it sends can
  then grow only `accept_ratio` times over its recent share, so after a 10x flood it would
  refuse most calls for tens of seconds to a gateway refusing none. Weighed, once the gateway
  refuses nothing the client sends every call again within `window_s`, when the calls it
  refused have left the window (slower where it still refuses a few: a share near
  1 - 1 / `accept_ratio` weighs almost in full).

What it does not do well:
- A gateway that refuses a share of calls whatever their number (not a capacity) at more than
  1 - 1 / `accept_ratio` (1 in 11) shuts a client's calls down to a trickle, as the book's rule
  does past 1 in 2 at its K of 2: accepts then fall with what is sent.
- Many clients each seeing few refusals send more than `accept_ratio` times what the gateway
  takes: a window with none weighs their own refusals at nothing. Simulated at 10x over one
  gateway (review, 11d98f3): 1.16x for 50 clients of 20 calls a second each, 1.21x for 100 of
  10, 1.33x for 200 of 5, 1.54x for 500 of 2 (the book's counting: 1.08x to 1.36x).
- Nothing is refused while fewer than `min_requests` calls were asked for in the window, so a
  client making a few calls a second does not refuse itself after one refusal, and a flood of
  such clients is not throttled at all.

The gateway throttles its own calls to the routers by the book's rule too
(services/gateway/throttle.py: K 1.5, decaying counts over 0.25 s, at most 95% refused). This
package ships alone and imports nothing of the server's, and the rule differs where the
gateway's cost differs: refusing at the gateway's door costs the gateway, so K is lower here,
which is what the two departures above are for.

The policy is pure: time (`now_s`, monotonic seconds) and chance (`draw`, uniform in [0, 1))
come in as arguments. It is thread-safe (the client is).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

#: Outcomes that count as the gateway refusing a call (gRPC status code names): a refusal for
#: load, and a call the gateway's gRPC dropped unseen (CANCELLED), both answered at once. Not
#: DEADLINE_EXCEEDED: it comes a timeout late, often after the call's slice has left the
#: window, and at a share that does not follow load (a tail of slow calls) it would throttle
#: a client that floods nothing (see `ThrottleCounts`). Not UNAVAILABLE: a gateway that cannot
#: be reached spends nothing on the call, one that answers it (no worker to serve the model)
#: is not short of CPU for it, and either way callers should see UNAVAILABLE.
NOT_ACCEPTED = frozenset({"RESOURCE_EXHAUSTED", "CANCELLED"})
#: The window is counted in this many slices, each dropped whole once it is `window_s` old.
_NUM_SLICES = 10


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
        if not self.accept_ratio > 1:
            raise ValueError(f"accept_ratio must be > 1, got {self.accept_ratio}")
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
    #: Calls asked for (`admits`), sent or not.
    num_asked: int = 0
    #: Of those, refused here.
    num_refused_here: int = 0
    #: Of those sent, the ones that ended not accepted so far (`record`).
    num_not_accepted: int = 0


class AdaptiveThrottle:
    """Counts one client's calls and their acceptance; `admits` says whether to send the next.

    Each call asks `admits()` once, before its first attempt; each call sent reports how it
    ended once (`record`), after its retries: requests and accepts are the application's
    calls, not the attempts (retries have their own budget)."""

    def __init__(self, policy: ThrottlePolicy = DEFAULT_THROTTLE) -> None:
        self.policy = policy
        self._slice_s = policy.window_s / _NUM_SLICES
        self._slices: deque[_Slice] = deque()  # oldest first
        self._num_asked = 0
        self._num_refused_here = 0
        self._num_not_accepted = 0
        self._lock = threading.Lock()

    def admits(self, now_s: float, draw: float) -> bool:
        """Whether to send a call asked for now; `draw` is uniform in [0, 1)."""
        with self._lock:
            current = self._current(now_s)
            probability = self._probability()
            current.num_asked += 1
            self._num_asked += 1
            if not draw < probability:
                return True
            current.num_refused_here += 1
            self._num_refused_here += 1
            return False

    def record(self, now_s: float, asked_s: float, *, accepted: bool) -> None:
        """How a call `admits` let through at `asked_s` ended, now: accepted by the gateway or
        not (`is_accepted` of its status). It counts with the calls asked for when it was, so
        the share of calls sent that the gateway refused is of one set of calls; a call asked
        for longer than the window ago no longer counts."""
        if accepted:
            return
        with self._lock:
            self._current(now_s)
            for asked_in in reversed(self._slices):
                if asked_in.start_s <= asked_s:
                    asked_in.num_not_accepted += 1
                    self._num_not_accepted += 1
                    return

    @property
    def retry_after_s(self) -> float:
        """A hint for a call refused here: one slice of the window, the soonest the chance can
        change by a slice's calls leaving it."""
        return self._slice_s

    def refusal_probability(self, now_s: float) -> float:
        """The chance that a call asked for now is refused here."""
        with self._lock:
            self._current(now_s)
            return self._probability()

    def counts(self, now_s: float) -> ThrottleCounts:
        """The calls counted in the window now."""
        with self._lock:
            self._current(now_s)
            return ThrottleCounts(self._num_asked, self._num_refused_here, self._num_not_accepted)

    def _probability(self) -> float:
        if self._num_asked < self.policy.min_requests:
            return 0.0
        counts = ThrottleCounts(self._num_asked, self._num_refused_here, self._num_not_accepted)
        requests, accepts = counts.requests(self.policy.accept_ratio), counts.num_accepts
        return max(0.0, (requests - self.policy.accept_ratio * accepts) / (requests + 1))

    def _current(self, now_s: float) -> _Slice:
        """The slice counting now, after dropping those a window old."""
        slices = self._slices
        while slices and slices[0].start_s <= now_s - self.policy.window_s:
            gone = slices.popleft()
            self._num_asked -= gone.num_asked
            self._num_refused_here -= gone.num_refused_here
            self._num_not_accepted -= gone.num_not_accepted
        if not slices or now_s >= slices[-1].start_s + self._slice_s:
            slices.append(_Slice(now_s))
        return slices[-1]


@dataclass(frozen=True)
class ThrottleCounts:
    """A throttle's calls in its window: asked for, refused here, and sent but not accepted.
    Calls sent and not yet answered count as accepted: a burst to a healthy gateway is sent
    whole, and a gateway that refuses at once while it answers slowly does not read as
    refusing everything."""

    num_asked: int
    num_refused_here: int
    num_not_accepted: int

    @property
    def num_sent(self) -> int:
        return self.num_asked - self.num_refused_here

    @property
    def num_accepts(self) -> int:
        return max(0, self.num_sent - self.num_not_accepted)

    def requests(self, accept_ratio: float) -> float:
        """The SRE book's requests: the calls sent, and those refused here weighed by how much
        the gateway still refuses of what it is sent (1 at the share a throttled client's
        gateway refuses, 1 - 1 / accept_ratio, or more; 0 when it refuses nothing). Counted
        whole, a flood's own refusals would keep the client refusing after the flood: the
        share it sends can grow only by `accept_ratio` over its recent share, so after a 10x
        flood it would refuse most calls for tens of seconds to a gateway refusing none."""
        if self.num_sent <= 0:
            return float(self.num_asked)
        refused_share = min(1.0, self.num_not_accepted / self.num_sent)
        weight = min(1.0, refused_share * accept_ratio / (accept_ratio - 1.0))
        return self.num_sent + weight * self.num_refused_here
