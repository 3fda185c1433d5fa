"""Adaptive throttling: a client refuses some of its own calls while the gateway refuses many.

Why: a gateway refuses a call for load at about the CPU of one bare gRPC call, and serves one
at two to three (bench/fabric's echo-calls). So past twice its capacity, a gateway that only
refuses spends as much on refusing as on serving, and what it serves falls however well it
chooses what to refuse. A call the client refuses itself costs the gateway nothing.

How (Google's SRE book, "Handling Overload: client-side throttling"; Envoy's admission control
filter works alike): over the last `window_s` the client counts the calls it was asked to make
(`requests`, those it refused itself included) and those the gateway accepted (`accepts`:
every outcome but a refusal for load, a call dropped unseen, a deadline missed or the gateway
unavailable, `NOT_ACCEPTED`), and refuses a new call itself with probability

    max(0, (requests - accept_ratio * accepts) / (requests + 1))

The gateway then sees about `accept_ratio` times the calls it accepts: a little more than it
can take, so it goes on refusing a few (and the client goes on learning how many it takes),
and refuses the rest at no cost to it. While it accepts at least 1 / `accept_ratio` of the
calls, nothing is refused. While fewer than `min_requests` calls were made in the window,
nothing is refused either, so a client making a few calls a second does not refuse itself
after one refusal. The window is short: within `window_s` of a flood's end the client sends
every call again.

Time and chance come in as `clock` and `random`: the policy is pure and thread-safe.
"""

from __future__ import annotations

import random as _random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: Outcomes that do not count as accepted (gRPC status code names). A refusal for load, a
#: call the gateway's gRPC dropped unseen (CANCELLED), a deadline missed (the call waited in a
#: queue the gateway could not drain in time), or no gateway to take it.
NOT_ACCEPTED = frozenset({"RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE"})
#: The window is counted in this many slices, each dropped whole once it is `window_s` old.
_SLICES = 10


@dataclass(frozen=True)
class ThrottlePolicy:
    """When a client refuses its own calls (`AdaptiveThrottle`)."""

    #: The gateway is sent about this multiple of the calls it accepts (the SRE book's K; 2
    #: there, where a refusal costs a server little). Lower refuses sooner: at 1.1 a gateway
    #: flooded at twice what it accepts spends a tenth of its calls on refusals, not half.
    accept_ratio: float = 1.1
    #: The calls counted are those of the last this many seconds.
    window_s: float = 2.0
    #: Nothing is refused while fewer calls than this were made in the window.
    min_requests: int = 20

    def __post_init__(self) -> None:
        if not (self.accept_ratio >= 1 and self.window_s > 0 and self.min_requests >= 0):
            raise ValueError(
                f"accept_ratio must be >= 1, window_s > 0 and min_requests >= 0; got "
                f"{self.accept_ratio}, {self.window_s} and {self.min_requests}"
            )


#: What a client throttles with unless told otherwise.
DEFAULT_THROTTLE = ThrottlePolicy()


def is_accepted(code: str) -> bool:
    """Whether a call that ended with status `code` (a name: "OK", "RESOURCE_EXHAUSTED")
    counts as accepted by the gateway."""
    return code not in NOT_ACCEPTED


class AdaptiveThrottle:
    """Counts one client's calls and their acceptance; `admits` says whether to send the next.

    Each call asks `admits()` once, before its first attempt; each call sent reports how it
    ended once (`record`), after its retries: requests and accepts are the application's
    calls, not the attempts (retries have their own budget)."""

    def __init__(
        self,
        policy: ThrottlePolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        random: Callable[[], float] = _random.random,
    ) -> None:
        self.policy = policy or ThrottlePolicy()
        self._clock = clock
        self._random = random
        self._slice_s = self.policy.window_s / _SLICES
        #: [slice start, requests, accepts], oldest first.
        self._slices: deque[list[float]] = deque()
        self._requests = 0.0
        self._accepts = 0.0
        self._lock = threading.Lock()

    def admits(self) -> bool:
        """Counts a call the client was asked to make; False: refuse it here, unsent."""
        with self._lock:
            current = self._current()
            probability = self._probability()
            current[1] += 1
            self._requests += 1
        return not (probability > 0 and self._random() < probability)

    def record(self, accepted: bool) -> None:
        """How a call `admits` let through ended: accepted by the gateway or not
        (`is_accepted` of its status)."""
        if not accepted:
            return
        with self._lock:
            self._current()[2] += 1
            self._accepts += 1

    def refusal_probability(self) -> float:
        """The chance that the next call is refused here, from the calls of the window."""
        with self._lock:
            self._current()
            return self._probability()

    def counts(self) -> tuple[int, int]:
        """(requests, accepts) in the window now."""
        with self._lock:
            self._current()
            return round(self._requests), round(self._accepts)

    def _probability(self) -> float:
        if self._requests < self.policy.min_requests:
            return 0.0
        excess = self._requests - self.policy.accept_ratio * self._accepts
        return max(0.0, excess / (self._requests + 1))

    def _current(self) -> list[float]:
        """The slice counting now, after dropping those older than the window."""
        now_s = self._clock()
        slices = self._slices
        while slices and slices[0][0] <= now_s - self.policy.window_s:
            _, requests, accepts = slices.popleft()
            self._requests -= requests
            self._accepts -= accepts
        if not slices or now_s >= slices[-1][0] + self._slice_s:
            slices.append([now_s, 0.0, 0.0])
        return slices[-1]
