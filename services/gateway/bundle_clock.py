"""How long a ready bundle waits for one of its key's bundles to be answered (pure).

A bundle that leaves as soon as it is ready carries what arrived in one linger (1 ms): with 64
callers through the stand-in stack, 4.5 callers a bundle. But the router's and the worker's
CPU is nearly all per bundle (issue 35's fit: 0.68 and 0.77 ms a bundle, 0.005 and 0.07 ms a
caller), so small bundles spend the tiers' CPU on framing, not rows.

So the gateway clocks bundles by their answers, as a batcher that batches while its device is
busy does: while `max_out` bundles of a key are downstream and not answered, the next one keeps
gathering calls, and leaves when one of them is answered (and the calls then waiting to be
picked up have joined it: below), when it holds the model's max batch rows (the coalescer sends
a full bundle at once), or after its hold. Bundles then grow with the
load. At light load nothing waits: fewer than `max_out` bundles are out, or fewer than
`min_in_flight` calls are in flight (with a few callers, each waiting for its answer before its
next call, a held call mostly delays the others, which then take turns a round trip apart).
The calls in flight include those waiting to be picked up by the gateway process: the key's
rate times the pickup delay its door measures (Little's law). A process that picks calls up
slower than they come holds few of them (grpc.aio asks for the next call only after its loop
took the last), so counting only those, 64 callers of the identity model through the stand-in
stack made bundles of 5.9-8.4 callers, up to 22% of them alone. Counting the waiting ones too
(/tmp probe, 2 cores, two pairs, each pair side by side): 64 callers 5.9 -> 9.2 and 7.3 -> 10.5
callers a bundle, the router's CPU per request 235 -> 151 and 172 -> 101 us, the worker's
417 -> 285 and 322 -> 192 us; 16 callers 2.1 -> 5.9 and 3.0 -> 5.6 callers a bundle, 678 -> 973
and 988 -> 1,326 requests/s; with 2 and 4 callers nothing was held either way. The HTTP port's
calls share the coalescer's keys, so they are counted by the gRPC queue's delay too: where
gRPC callers queue, the process is busy, and a held HTTP call waits at most its hold.
Measured with 64 callers through the stand-in stack (2 cores, /tmp probe, one run each): 4.5
callers a bundle without the clock, 8.5 at `max_out` 2, 21.7 at `max_out` 1, where the router's
CPU per request fell from 0.138 to 0.045 ms, the worker's from 0.204 to 0.080 ms and the
gateway's from 0.545 to 0.455 ms, and throughput rose from 1,806/s to 2,270/s with a lower p50
(27 ms against 33).

A partial bundle waits at most one bundle's round trip, which is short where the clock pays:
a GPU-speed model, a few ms a round trip, whose tiers' CPU is what binds. Where the round trip
is long (minilm on a CPU: tens to hundreds of ms), waiting for an answer only adds latency:
the worker's batcher, which sees every gateway's rows, batches them while its model is busy
anyway. Clocked there, a flood of mixed lengths at 400/s on a fresh `make run` got about half
as many answers within the SLO (200-326 of 3,200 against 529-562, /tmp trial, two runs each).
So a bundle waits only while its key's time downstream (a moving average of the worker's own
time on each bundle, as it reports it, or of the round trip where it does not and for failed
ones; of a bundle all its callers left, the time it was out, only if above the average: the
time downstream was at least that; a key with none yet holds) is at most `max_hold_s`, and then
at most `max_hold_s` and `hold_share` of its earliest caller's time left when the hold begins
(callers that join later have deadlines within 2x of it: the coalescer's deadline classes),
which also bounds what a slow or stalled downstream costs the calls behind it. Throughput is
never capped by the clock: a bundle that fills to the model's max batch rows leaves at once.

An answered hold gathers the calls already waiting at the door. A process that picks calls up
later than they come (its door's pickup delay) has more of the key's calls in grpc's queue when
the bundle out is answered; leaving then, the held bundle carries only what the process picked
up during one round trip, and the waiting calls go a round trip later in the next bundle. So an
answered hold waits up to the pickup delay more, within its hold, for them to join (`gather_s`);
a process that keeps up (a pickup delay near 0) sends at the answer, and so does a bundle whose
hold a failed bundle ended. 64 identity callers
through the stand-in stack (2 cores), without -> with the gather, three alternations of a /tmp
probe: 9.1-10.2 -> 24.5-27.4 callers a bundle, 1,043-1,191 -> 1,223-1,409 requests/s, p50
50-60 -> 43-48 ms, CPU per request gateway 834-939 -> 724-851 us, router 128-150 -> 51-67 us,
worker 251-289 -> 126-155 us; at 8 and 16 callers nothing changed (no call waits there).

Not the round trip as the gateway sees it: that also counts how late the gateway's own event
loop reads each answer, and the gateway is the tier that saturates first. Gated on it, the
clock stopped holding just when it paid: with 64 callers through the stand-in stack in a
slow hour (2 cores), the round trips' average hovered around the 20 ms gate (11-53 ms), holds
stopped, and bundles fell to 1.1-3.2 callers, the tiers' CPU per request rising with them,
which kept the round trips long. Gated on the worker's own time, side by side in that hour
(/tmp probe, two runs each): 6.7-9.7 callers a bundle, 525-555 requests/s against 305-510.
A router that retried a bundle on another worker passes on only the last worker's time, so a
stalled first worker does not show in it; a bundle held meanwhile waits at most its hold,
which the key's next answer ends.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BundleClock:
    #: Bundles of one key downstream (sent, not answered) before the next waits (0: never).
    max_out: int = 1
    #: ... and only with at least this many of the key's calls in flight (or waiting to be
    #: picked up: the coalescer counts them): with few callers, each waiting for its answer
    #: before its next call, a held call mostly delays the others (they take turns a round
    #: trip apart) and gathers nothing (the streams' write linger's rule,
    #: services.common.write_linger).
    min_in_flight: int = 8
    #: Longest a ready bundle waits for an answer, seconds ...
    max_hold_s: float = 0.02
    #: ... and at most this share of its earliest caller's time left.
    hold_share: float = 0.1

    def __post_init__(self) -> None:
        if min(self.max_out, self.min_in_flight) < 0 or self.max_hold_s < 0:
            raise ValueError("max_out, min_in_flight and max_hold_s must be >= 0")
        if not 0 <= self.hold_share <= 1:
            raise ValueError(f"hold_share must be in [0, 1], got {self.hold_share}")

    def hold_s(
        self, num_out: int, num_in_flight: float, time_left_s: float, downstream_s: float | None
    ) -> float:
        """How long a ready bundle may wait for an answer with `num_out` bundles of its key out,
        `num_in_flight` of its calls in flight (its own included) and the key's times downstream
        averaging `downstream_s` (None before the first, which holds), its earliest caller
        having `time_left_s` (0: it leaves now)."""
        if (
            self.max_out == 0
            or num_out < self.max_out
            or num_in_flight < self.min_in_flight
            or (downstream_s is not None and downstream_s > self.max_hold_s)
        ):
            return 0.0
        return max(0.0, min(self.max_hold_s, self.hold_share * time_left_s))

    def gather_s(self, pickup_delay_s: float, held_s: float, hold_s: float) -> float:
        """How much longer a held bundle, answered after `held_s` of its `hold_s`, waits for
        the calls waiting to be picked up by this process (`pickup_delay_s`: how long they
        wait): they are picked up within it. 0 when the hold is spent or nothing waits."""
        return max(0.0, min(pickup_delay_s, hold_s - held_s))


#: The gateway's default: one bundle of a key out per process.
DEFAULT_CLOCK = BundleClock()
