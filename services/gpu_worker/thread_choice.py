"""Which number of torch intra-op threads a model call runs on, learned from the calls (pure).

On a CPU the model's parallel regions share the cores with the worker's event loop (sampling,
detokenizing and streaming every generated token) and, on a small host, with the other tiers.
A parallel region waits for its slowest thread, so a preempted thread stalls the whole call:
a small model's steps then run faster on one thread than on all of them, while a large
model's matmuls still want every core. Which count wins depends on the model, the size of the
call and what else runs on the host, so it is measured, not guessed. Measured on this
project's 2-core machine with `bench.generation`: the default tiny-llama runs 1.4x (continuous)
to 1.8x (static) more tokens/s on one thread than on two, a 20M-parameter Llama 1.3x more on
two than on one.

Per size bucket (a power of two of the call's size, in tokens) the policy keeps a moving
average of each option's cost (the caller's measure: the whole cycle from one call's launch to
the next, so that a count which starves the event loop pays for it) and runs the cheapest.
Options are sampled `min_samples` times each, fewest threads first, and every `explore_every`-th
call of a bucket tries the option tried least recently instead, so the choice follows a
changing load. On a busy host more threads is the risky bet: beside a 10x flood here one batch
of 8 rows took 1.8 s on two threads, 0.03-0.2 s on one. So trying an option is held back:
- an option whose first samples cost more than `RULE_OUT_RATIO` times the cheapest is not
  sampled further;
- a caller whose call others wait for (`may_explore` False) runs the cheapest so far, for
  `min_samples` (a sample) or `explore_every` (an exploring turn) calls of its size at most,
  not counting calls while tries are held back;
- a try costing more than `RULE_OUT_RATIO` times its bucket's cheapest holds every size's
  tries back until `explore_every` calls later, a span doubled after each costly call (up to
  `MAX_BACKOFF` times) and reset by a try that costs less; an option already known that
  costly, costly again, only spaces its own bucket's exploring turns out alike;
- a call costing more than `RULE_OUT_RATIO` times its own count's mean (the host slowed it
  down) holds tries back as well and says the host is busy for as long: each call then runs
  on the fewest threads measured within `RULE_OUT_RATIO` of its bucket's cheapest, as a size
  measured on a quiet host may have found more threads cheaper. A caller whose calls' cost
  follows their content more than their size (a generation step) turns this off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: An option costing more than this many times the cheapest is not worth more samples now.
RULE_OUT_RATIO = 2.0
#: A hold lasts explore_every calls, doubled per costly call up to this many times that (and a
#: bucket's exploring interval alike).
MAX_BACKOFF = 16


def thread_options(num_threads: int) -> tuple[int, ...]:
    """The counts worth trying when torch is set to `num_threads` on a CPU: one, all but one
    (a core left to the event loop) and all; one option (no choice) when that is one thread."""
    return tuple(sorted({1, max(1, num_threads - 1), max(1, num_threads)}))


def size_bucket(size: int) -> int:
    """The power of two at or above `size` (>= 1): calls of one bucket cost about the same."""
    return 1 << max(0, size - 1).bit_length()


@dataclass
class _Bucket:
    mean_cost_s: dict[int, float] = field(default_factory=dict)
    num_samples: dict[int, int] = field(default_factory=dict)
    #: Calls chosen in this bucket; every explore_interval-th one explores.
    num_chosen: int = 0
    #: explore_every, doubled per exploration of an option already known costly (its mean past
    #: RULE_OUT_RATIO times the cheapest) that cost as much again; reset by a fair try.
    explore_interval: int = 0
    #: When each option was last run (in calls chosen), to explore the stalest.
    last_chosen: dict[int, int] = field(default_factory=dict)
    #: An exploring turn came while exploring was not allowed: the next call that may, does.
    is_exploration_due: bool = False
    #: The last call chosen was a try (a sample or an exploration of another than the cheapest).
    is_trying: bool = False
    #: Calls on which the pending sample or turn waited for others' rows.
    num_postponed: int = 0


class ThreadChoice:
    """Picks a thread count per call from measured costs; `record` feeds it back."""

    def __init__(
        self,
        options: tuple[int, ...],
        *,
        explore_every: int = 16,
        min_samples: int = 3,
        smoothing: float = 0.2,
        detects_busy_host: bool = True,
    ) -> None:
        """`detects_busy_host` False: a call past twice its count's mean says nothing of the
        host (a generation step's cost follows what it holds: decode rows, prompt chunks)."""
        if not options or min(options) < 1:
            raise ValueError("thread options must be counts >= 1")
        if explore_every < 2 or min_samples < 1 or not 0 < smoothing <= 1:
            raise ValueError("explore_every >= 2, min_samples >= 1, 0 < smoothing <= 1")
        self.options = tuple(sorted(set(options)))
        self._explore_every = explore_every
        self._min_samples = min_samples
        self._smoothing = smoothing
        self._detects_busy_host = detects_busy_host
        self._buckets: dict[int, _Bucket] = {}
        #: Calls chosen, of every size. Nothing is tried before call number held_until, and the
        #: host counts as busy before busy_until (never later than held_until).
        self._num_calls = 0
        self._held_until = 0
        self._busy_until = 0
        #: How many calls the next costly call holds back (doubling, reset by a fair try).
        self._hold_calls = explore_every

    def choose(self, size: int, *, may_explore: bool = True) -> int:
        """The thread count to run a call of `size` (tokens) on. A caller whose call would
        hold up others (`may_explore` False) gets the cheapest count measured so far: a sample
        or an exploring turn then waits for the next call that may explore (either costs the
        call itself, at most), or `min_samples` (a sample) or `explore_every` (a turn) calls of
        the size at most, so a lane never idle still measures its options. While tries are
        held back (a costly try, a busy host) nothing is tried, nor counted as waiting."""
        if len(self.options) == 1:
            return self.options[0]
        bucket = self._bucket(size)
        bucket.num_chosen += 1
        self._num_calls += 1
        unsampled = self._unsampled(bucket)
        if not unsampled and bucket.num_chosen % bucket.explore_interval == 0:
            bucket.is_exploration_due = True
        is_held = self._num_calls < self._held_until
        cheapest = self._cheapest(bucket) if bucket.mean_cost_s else None
        to_sample = [o for o in unsampled if o != cheapest]
        is_forced = False
        if not (to_sample or bucket.is_exploration_due):
            bucket.num_postponed = 0  # nothing pending
        elif bucket.mean_cost_s and not (may_explore or is_held):
            bucket.num_postponed += 1
            limit = self._min_samples if to_sample else self._explore_every
            may_explore = is_forced = bucket.num_postponed > limit
        may_explore = may_explore and not is_held
        if may_explore:
            bucket.num_postponed = 0
        if not bucket.mean_cost_s:
            choice = unsampled[0]  # fewest threads first: the safe bet on a busy host
        elif unsampled and may_explore:
            # Fewest threads first; a sample forced after waiting is of another count.
            choice = to_sample[0] if is_forced and to_sample else unsampled[0]
        elif bucket.is_exploration_due and may_explore:
            bucket.is_exploration_due = False
            others = [o for o in self.options if o != cheapest]
            choice = min(others, key=lambda o: bucket.last_chosen.get(o, 0))
        elif self._num_calls < self._busy_until:
            choice = self._fewest_near_cheapest(bucket)
        else:
            choice = self._cheapest(bucket)
        # A try: a count other than the cheapest, run to be measured (not for a busy host).
        bucket.is_trying = may_explore and cheapest is not None and choice != cheapest
        bucket.last_chosen[choice] = bucket.num_chosen
        return choice

    def _bucket(self, size: int) -> _Bucket:
        return self._buckets.setdefault(
            size_bucket(size), _Bucket(explore_interval=self._explore_every)
        )

    def _unsampled(self, bucket: _Bucket) -> list[int]:
        """The options still short of `min_samples` in `bucket`, fewest threads first, but for
        those already costing more than RULE_OUT_RATIO times the cheapest."""
        cheapest_s = min(bucket.mean_cost_s.values(), default=0.0)
        return [
            o
            for o in self.options
            if bucket.num_samples.get(o, 0) < self._min_samples
            and (cheapest_s <= 0 or bucket.mean_cost_s.get(o, 0.0) <= RULE_OUT_RATIO * cheapest_s)
        ]

    @staticmethod
    def _cheapest(bucket: _Bucket) -> int:
        """The option of `bucket` with the lowest mean cost (it has at least one sample)."""
        return min(bucket.mean_cost_s, key=lambda o: (bucket.mean_cost_s[o], o))

    @staticmethod
    def _fewest_near_cheapest(bucket: _Bucket) -> int:
        """The fewest threads measured in `bucket` within RULE_OUT_RATIO of the cheapest."""
        cheapest_s = min(bucket.mean_cost_s.values())
        return min(o for o, s in bucket.mean_cost_s.items() if s <= RULE_OUT_RATIO * cheapest_s)

    def record(self, size: int, threads: int, cost_s: float) -> None:
        """A call of `size` ran on `threads` and cost `cost_s` (seconds)."""
        if threads not in self.options or cost_s < 0:
            return
        bucket = self._bucket(size)
        count = bucket.num_samples.get(threads, 0)
        own_s = bucket.mean_cost_s.get(threads, 0.0)
        cheapest_s = min(bucket.mean_cost_s.values(), default=0.0)
        is_costly = cheapest_s > 0 and cost_s > RULE_OUT_RATIO * cheapest_s
        if self._detects_busy_host and own_s > 0 and cost_s > RULE_OUT_RATIO * own_s:
            self._hold(busy=True)  # the host slowed this count down
        elif bucket.is_trying and is_costly and own_s > RULE_OUT_RATIO * cheapest_s:
            # An option already known costly, costly again: its own bucket explores it less.
            longest = self._explore_every * MAX_BACKOFF
            bucket.explore_interval = min(2 * bucket.explore_interval, longest)
        elif bucket.is_trying and is_costly:
            self._hold(busy=False)  # newly costly: maybe the host, so hold every size's tries
        elif bucket.is_trying:
            self._hold_calls = bucket.explore_interval = self._explore_every
        bucket.is_trying = False
        mean = bucket.mean_cost_s.get(threads)
        # Averages until min_samples, then a moving average that follows the load.
        weight = max(self._smoothing, 1.0 / (count + 1))
        bucket.mean_cost_s[threads] = cost_s if mean is None else mean + weight * (cost_s - mean)
        bucket.num_samples[threads] = count + 1

    def _hold(self, *, busy: bool) -> None:
        """Nothing is tried (and, if `busy`, the host counts as busy) until `_hold_calls` calls
        later; the next hold is twice as long, up to MAX_BACKOFF times explore_every."""
        self._held_until = self._num_calls + self._hold_calls
        if busy:
            self._busy_until = self._held_until
        self._hold_calls = min(2 * self._hold_calls, self._explore_every * MAX_BACKOFF)

    def is_trying(self, size: int) -> bool:
        """Whether the last call chosen for `size`'s bucket is a try: a count other than the
        cheapest so far, run to be measured (a sample or an exploration)."""
        bucket = self._buckets.get(size_bucket(size))
        return bucket is not None and bucket.is_trying

    def best(self, size: int) -> int | None:
        """The option measured cheapest for `size` so far; None before any was measured."""
        bucket = self._buckets.get(size_bucket(size))
        if bucket is None or not bucket.mean_cost_s:
            return None if len(self.options) > 1 else self.options[0]
        return self._cheapest(bucket)

    def samples(self, size: int) -> dict[int, int]:
        """How many calls of `size`'s bucket each option has been measured on."""
        bucket = self._buckets.get(size_bucket(size))
        return {} if bucket is None else dict(bucket.num_samples)


class StepCycles:
    """Feeds a ThreadChoice (None: threads as set) the cycle of each call run back to back
    with the next: from its launch to the next one's (its forward, and what the caller did
    before the next launch), which `launch` closes."""

    __slots__ = ("_choice", "_last")

    def __init__(self, choice: ThreadChoice | None) -> None:
        self._choice = choice
        #: (launched_s, size, threads) of the call launched last, while calls run back to
        #: back. None after an idle wait or a failure (`break_off`).
        self._last: tuple[float, int, int] | None = None

    def launch(self, size: int, now: float) -> int:
        """The threads of the call of `size` launched `now` (0: as set); closes the last
        call's cycle in the choice."""
        if self._choice is None:
            return 0
        if self._last is not None:
            launched_s, last_size, last_threads = self._last
            self._choice.record(last_size, last_threads, now - launched_s)
        threads = self._choice.choose(size)
        self._last = (now, size, threads)
        return threads

    def break_off(self) -> None:
        """The next launch does not follow the last call back to back (an idle wait, a
        failure): no cycle to close."""
        self._last = None
