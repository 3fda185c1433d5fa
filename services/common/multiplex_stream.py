"""One multiplexed stream's client-side state (`MuxStream`), and how calls or results are packed
into stream messages (`take_message`): shared by services.common.multiplex (the client) and
services.common.multiplex_server."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TypeVar

import grpc

from services.common.errors import UpstreamError
from services.common.lifecycle import MAX_MESSAGE_BYTES
from services.pb.inference.v1 import worker_pb2 as pb

_T = TypeVar("_T")

#: Most calls (or results) one stream message carries; the rest go in the next message.
MAX_CALLS_PER_MESSAGE = 256
#: Most bytes of calls (or results) one stream message packs together (a bigger one goes
#: alone): well under the message limit, MAX_MESSAGE_BYTES, which a message of calls that each
#: fit would otherwise pass, failing every call on its stream.
MAX_BYTES_PER_MESSAGE = MAX_MESSAGE_BYTES // 4


def take_message(outbox: list[_T], size_of: Callable[[_T], int]) -> list[_T]:
    """Removes and returns the first items of `outbox` that one stream message carries: at
    most MAX_CALLS_PER_MESSAGE, and no more bytes than MAX_BYTES_PER_MESSAGE unless the first
    alone is bigger."""
    count, size = 0, 0
    for item in itertools.islice(outbox, MAX_CALLS_PER_MESSAGE):
        size += size_of(item)
        if count and size > MAX_BYTES_PER_MESSAGE:
            break
        count += 1
    taken = outbox[:count]
    del outbox[:count]
    return taken


_MAX_UINT64 = 2**64 - 1


def timeout_us_of(timeout_s: float | None) -> int:
    # 0 on the wire means "no deadline"; a deadline already past is sent as 1 us.
    # At most what the field holds (a caller's timeout of ages: a deadline none the less).
    return 0 if timeout_s is None else min(_MAX_UINT64, max(1, round(timeout_s * 1e6)))


class MuxStream:
    """One open InferStream: its writer and reader tasks and the calls waiting on it."""

    def __init__(
        self,
        call: grpc.aio.StreamStreamCall[pb.InferStreamRequest, pb.InferStreamResponse],
        name: str,
        opened_s: float,
    ) -> None:
        self.call = call
        self.name = name
        self.opened_s = opened_s
        #: Takes no new calls; half-closes once every call it carries is answered.
        self.is_retiring = False
        self.pending: dict[int, asyncio.Future[pb.MuxResult]] = {}
        self.outbox: list[pb.MuxCall] = []
        #: The ids of the calls in `outbox` still waited for (those cancelled before they
        #: left are taken out in bulk, `MultiplexClient._cancel`).
        self.unsent: set[int] = set()
        #: When each call in `outbox` times out (monotonic seconds): its time left is read
        #: as it is written, not as it was queued.
        self.deadlines: dict[int, float] = {}
        self.cancelled: list[int] = []
        #: Slices of bundles in flight whose callers stopped waiting.
        self.cancelled_slices: list[pb.SliceRef] = []
        self.wake = asyncio.Event()
        self.broken: str | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def fail_all(self, reason: str, *, is_not_started: bool = False) -> None:
        """Fails every call waiting; `is_not_started`: the peer provably ran none of them (as
        it did not those still in the outbox, never written: always marked so)."""
        self.broken = reason
        unsent, self.unsent = self.unsent, set()
        self.outbox.clear()
        self.deadlines.clear()
        for call_id, future in self.pending.items():
            if not future.done():
                future.set_exception(
                    UpstreamError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"{self.name}: {reason}",
                        is_not_started=is_not_started or call_id in unsent,
                    )
                )
        self.pending.clear()
        self.wake.set()
