"""Adaptive throttling: a client refuses some of its own calls while the gateway refuses many.

Why: a gateway refuses a call for load at about the CPU of one bare gRPC call, a quarter to a
third of what serving one costs it (docs/architecture.md, "What bounds a flood's goodput"). So
a flood at twice its capacity spends about a third of the gateway's CPU on refusals, and one
at ten times more than all of it: what it serves falls however well it chooses what to
refuse. A call the client refuses itself costs the gateway nothing.

How (Google's SRE book, "Handling Overload", client-side throttling): over the last
`window_s` the client counts its requests (the calls it refused itself, at once, and the calls
it sent, once answered) and the gateway's accepts (of those answered, every one but a refusal
for load or a drop unseen, `NOT_ACCEPTED`), and refuses a new call itself with probability

    max(0, (requests - accept_ratio * accepts) / (requests + 1))

The gateway then sees about `accept_ratio` times the calls it accepts: a little more than it
can take, so it goes on refusing a few (and the client goes on learning how many it takes),
and the rest cost it nothing. A call in flight counts in neither (as Envoy's admission control
samples at completion), so a burst is not throttled while in flight. A client that retries
refusals does not while its throttle refuses (client.py): a call retried until accepted would
hide the refusal from it.

One departure from the book: nothing is refused until the gateway refuses a call, and again
once it has refused none for `quiet_s` (5 s). With an `accept_ratio` this low (the book's is
2), the client's own refusals, counted as requests, would keep it refusing for tens of seconds
after a flood: what it sends grows only by a tenth a window while the gateway refuses none of
it. `quiet_s` is longer than the window because under a steady flood a gateway's door sheds in
bursts, seconds apart: a client that stopped counting between them flooded it.

Measured on the stand-in stack's identity floods at 2x its capacity (/tmp script, forms of the
counting side by side, 18 s a flood, goodput within the SLO over capacity; this counting
without the quiet period beside each):
- this counting: 0.43-1.13 over 18 floods (median about 0.65), 0-2,300 calls refused at the
  gateway a flood, accepted calls' p99 0.06-0.45 s;
- a call in flight counted as accepted: 1.08 and 1.11 (0.97 and 1.13 beside), about 5,000
  refused, p99 0.27 s (0.10-0.11);
- each answer counted with the calls asked for when it was (so a call in flight is a request
  not yet answered), the client's own refusals weighed by the gateway's refusal share:
  0.23-0.55 (0.49-0.67), 6,900-7,600 refused, p99 0.48-0.73 s; counted so, the book's
  counting only while the window held a refusal: 0.33 and 0.36 (0.52 and 0.43), p99 0.53-0.60 s
  (it lapsed between the door's bursts); with a 5 s quiet period instead: 0.50 and 1.09 (0.93
  and 0.72);
- the book's counting (a call in flight a request not accepted yet) with the quiet period:
  0.35 and 1.06 (1.02 and 0.87), 2,400-2,800 refused, p99 0.26-0.35 s; the same with the
  multiple raised to 2.2 half a second after the last refusal (to climb back faster): 0.65
  and 0.88 (0.77 and 0.47), 7,200-8,000 refused, p99 0.36-0.53 s.
This counting refused the fewest calls at the gateway, with the shortest p99 and as much
goodput as any; the quiet period changes nothing while the gateway refuses.

What it does not do well:
- What a client sends grows only by a tenth a window while the gateway refuses none of it: a
  client knocked down by a flood's first refusals sends less than the gateway takes for
  seconds (a made-up 10x flood that began with a refusal: a tenth to a quarter of it for all
  8 s), and after a flood it refuses most calls until `quiet_s` has passed.
- A new client meeting a gateway that refuses at once but answers slowly reads it as refusing
  nearly all (the refusals are counted first), and climbs only a tenth a window: in a
  made-up 2x flood with answers taking 0.3 s, it sent a third of what the gateway could take
  for 5 s.
- A gateway that refuses a share of calls whatever their number (not a capacity) at more than
  1 - 1 / `accept_ratio` (1 in 11) shuts a client's calls down to a trickle, as the book's rule
  does past 1 in 2 at its K of 2: accepts then fall with what is sent.
- Many clients each seeing few refusals send more than `accept_ratio` times what the gateway
  takes (simulated at 10x by a review, with an earlier form of the counting: 1.16x for 50
  clients of 20 calls a second each, up to 1.54x for 500 of 2).
- Nothing is refused while fewer than `min_requests` calls were counted in the window (refused
  here, or answered), so a client making a few calls a second does not refuse itself after one
  refusal, and a flood of such clients is not throttled at all.

The gateway throttles its own calls to the routers by a variant of the rule
(services/gateway/throttle.py: K 1.5, decaying counts over 0.25 s, at most 95% refused). This
package ships alone and imports nothing of the server's, and K is lower here: refusing at the
gateway's door costs the gateway CPU.

The policy is pure: time (`now_s`, monotonic seconds) and chance (`draw`, uniform in [0, 1))
come in as arguments. It is thread-safe (the client is).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

#: Outcomes that count as the gateway refusing a call (gRPC status code names): a refusal for
#: load, and a call the gateway's gRPC dropped unseen (CANCELLED), both answered at once. Not
#: DEADLINE_EXCEEDED: it comes a timeout late (30 s by default), and at a share that does not
#: follow load (a tail of slow calls) it would throttle a client that floods nothing. Not
#: UNAVAILABLE: a gateway that cannot be reached spends nothing on the call, one that answers
#: it (no worker to serve the model) is not short of CPU for it, and either way callers should
#: see UNAVAILABLE.
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
    #: Once the gateway has refused none for this long, nothing is refused here. Longer than
    #: the window: under a steady flood a gateway's door sheds in bursts, seconds apart.
    quiet_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.accept_ratio > 1:
            raise ValueError(f"accept_ratio must be > 1, got {self.accept_ratio}")
        if not 0 < self.window_s < math.inf:
            # Infinite, no count would ever leave the window: one refusal refused for good.
            raise ValueError(f"window_s must be finite and > 0, got {self.window_s}")
        if self.min_requests < 0:
            raise ValueError(f"min_requests must be >= 0, got {self.min_requests}")
        if not 0 < self.quiet_s < math.inf:
            raise ValueError(
                f"quiet_s must be finite and > 0 (0 would never refuse), got {self.quiet_s}"
            )


#: What a client throttles with unless told otherwise.
DEFAULT_THROTTLE = ThrottlePolicy()


#: What grpc says of a message past a size limit (RESOURCE_EXHAUSTED, sender's or receiver's):
#: a call too large, not a gateway short of capacity.
_TOO_LARGE = "message larger than max"


def is_accepted(code: str, message: str = "") -> bool:
    """Whether a call that ended with status `code` (a name: "OK", "RESOURCE_EXHAUSTED") and
    `message` counts as accepted by the gateway (not refused for load)."""
    return code not in NOT_ACCEPTED or _TOO_LARGE in message


@dataclass
class _Slice:
    """The calls counted from `start_s` on, until the next slice starts."""

    start_s: float
    #: Calls refused here (`admits`), and calls sent once answered (`record`).
    num_requests: int = 0
    #: Of those answered, the ones the gateway accepted.
    num_accepts: int = 0


class AdaptiveThrottle:
    """Counts one client's calls and their acceptance; `admits` says whether to send the next.

    Each call asks `admits()` once, before its first attempt; each call sent reports how it
    ended once (`record`), after its retries: requests and accepts are the application's
    calls, not the attempts (retries have their own budget)."""

    def __init__(self, policy: ThrottlePolicy = DEFAULT_THROTTLE) -> None:
        self.policy = policy
        self._slice_s = policy.window_s / _NUM_SLICES
        self._slices: deque[_Slice] = deque()  # oldest first
        self._num_requests = 0
        self._num_accepts = 0
        #: Calls `admits` let through and not yet `record`ed: a throttle with calls in flight
        #: is never dropped (`ModelThrottles`), or their ends would be counted by none.
        self._num_in_flight = 0
        #: When the gateway last refused a call, seconds (None: not yet).
        self._last_refused_s: float | None = None
        #: When a caller last took this throttle (`ModelThrottles.of`), seconds.
        self._taken_s: float | None = None
        self._lock = threading.Lock()

    def taken(self, now_s: float) -> None:
        """A caller took this throttle now, to ask `admits` next: not idle for a window."""
        with self._lock:
            self._taken_s = now_s if self._taken_s is None else max(self._taken_s, now_s)

    def admits(self, now_s: float, draw: float) -> bool:
        """Whether to send a call asked for now; `draw` is uniform in [0, 1). A call refused
        here counts as a request at once; one sent counts when `record`ed."""
        with self._lock:
            current = self._current(now_s)
            if not draw < self._probability(now_s):
                self._num_in_flight += 1
                return True
            current.num_requests += 1
            self._num_requests += 1
            return False

    def record(self, now_s: float, *, accepted: bool) -> None:
        """How a call `admits` let through ended, now: accepted by the gateway or not
        (`is_accepted` of its status)."""
        with self._lock:
            self._num_in_flight = max(0, self._num_in_flight - 1)
            current = self._current(now_s)
            current.num_requests += 1
            self._num_requests += 1
            if accepted:
                current.num_accepts += 1
                self._num_accepts += 1
            else:
                self._note_refused(now_s)

    def note_refused(self, now_s: float) -> None:
        """The gateway refused an attempt of a call now, one a retry may still get accepted:
        it counts as refusing from now (`ThrottlePolicy.quiet_s`), so that no retry follows
        while the throttle refuses."""
        with self._lock:
            self._note_refused(now_s)

    def _note_refused(self, now_s: float) -> None:
        last_s = self._last_refused_s
        self._last_refused_s = now_s if last_s is None else max(last_s, now_s)

    @property
    def retry_after_s(self) -> float:
        """A hint for a call refused here: one slice of the window, the soonest the chance can
        change by a slice's calls leaving it."""
        return self._slice_s

    def refusal_probability(self, now_s: float) -> float:
        """The chance that a call asked for now is refused here."""
        with self._lock:
            self._current(now_s)
            return self._probability(now_s)

    def counts(self, now_s: float) -> ThrottleCounts:
        """The calls counted in the window now."""
        with self._lock:
            self._current(now_s)
            return ThrottleCounts(self._num_requests, self._num_accepts, self._is_refusing(now_s))

    def is_idle(self, now_s: float) -> bool:
        """Whether this throttle is as a new one would be: no call in its window or in flight,
        none taking it (`taken`) within its window, and no refusal in its quiet period. A call
        between its `of` and its `admits` was not counted: another thread dropped the throttle
        under it, and the call's end, a refusal too, counted in a throttle no one used
        (review finding)."""
        with self._lock:
            self._current(now_s)
            is_counting = self._num_requests > 0 or self._num_in_flight > 0
            taken_s = self._taken_s
            is_taken = taken_s is not None and now_s - taken_s < self.policy.window_s
            return not is_counting and not is_taken and not self._is_refusing(now_s)

    def _is_refusing(self, now_s: float) -> bool:
        last_s = self._last_refused_s
        return last_s is not None and now_s - last_s < self.policy.quiet_s

    def _probability(self, now_s: float) -> float:
        if self._num_requests < self.policy.min_requests or not self._is_refusing(now_s):
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


class ModelThrottles:
    """One `AdaptiveThrottle` per model, so that one model's refusals do not refuse another's
    calls. Thread-safe."""

    #: Past this many throttles, the idle ones (no call in their window or in flight, no
    #: refusal in their quiet period: they refuse nothing, as a new one does) are dropped.
    MAX_KEPT = 64

    def __init__(self, policy: ThrottlePolicy) -> None:
        self.policy = policy
        self._throttles: dict[str, AdaptiveThrottle] = {}
        self._lock = threading.Lock()

    def of(self, model: str, now_s: float) -> AdaptiveThrottle:
        with self._lock:
            throttle = self._throttles.get(model)
            if throttle is None:
                if len(self._throttles) >= self.MAX_KEPT:
                    for name, kept in list(self._throttles.items()):
                        if kept.is_idle(now_s):
                            del self._throttles[name]
                throttle = self._throttles[model] = AdaptiveThrottle(self.policy)
            throttle.taken(now_s)  # under the lock that drops idle ones: not dropped under it
            return throttle

    def __len__(self) -> int:
        with self._lock:
            return len(self._throttles)


@dataclass(frozen=True)
class ThrottleCounts:
    """A throttle's calls in its window: requests (refused here, or sent and answered) and
    accepts, and whether the gateway counts as refusing (it refused a call less than
    `ThrottlePolicy.quiet_s` ago)."""

    num_requests: int
    num_accepts: int
    is_refusing: bool
