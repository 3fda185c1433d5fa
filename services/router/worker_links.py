"""The router's links to workers: one channel per worker address, on it one multiplexed stream
for fixed-cost calls, closed again once the worker has left the registry.

A rollout replaces every worker pod, each at a new address. A router that kept every link it
ever opened would hold one per pod it ever routed to (the channel's connection, its stream's
tasks) for its whole life. A link closes once its address has been out of the registry's
live workers for `linger_s` with no call of this router on it: a worker missing from one read (a
heartbeat late, Redis refilling after a restart) keeps its link, and a call still running on a
worker that left is never cut."""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet

import grpc

from services.common.multiplex import MultiplexClient
from services.common.tls import ClientTls, open_channel

log = logging.getLogger(__name__)

#: Seconds an address stays out of the registry's snapshot before its idle link closes.
LINGER_S = 30.0


class WorkerLinks:
    def __init__(self, tls: ClientTls, *, linger_s: float = LINGER_S) -> None:
        self._tls = tls
        self.linger_s = linger_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[str, MultiplexClient] = {}
        #: Generation streams open per address: they run on the channel, not the stream.
        self._generating: dict[str, int] = {}
        #: When each linked address was first found out of the snapshot.
        self._left_at_s: dict[str, float] = {}

    def __len__(self) -> int:
        """Workers linked to (a channel open)."""
        return len(self._channels)

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self._tls)
        return channel

    def stream(self, address: str) -> MultiplexClient:
        stream = self._streams.get(address)
        if stream is None:
            stream = self._streams[address] = MultiplexClient(self.channel(address), address)
        return stream

    def generation_started(self, address: str) -> None:
        self._generating[address] = self._generating.get(address, 0) + 1

    def generation_ended(self, address: str) -> None:
        left = self._generating.pop(address) - 1
        if left:
            self._generating[address] = left

    def is_busy(self, address: str) -> bool:
        """Whether a call of this router runs on `address`'s link."""
        stream = self._streams.get(address)
        return address in self._generating or (stream is not None and stream.num_pending > 0)

    async def prune(self, addresses: AbstractSet[str], now_s: float) -> None:
        """Closes the link of each address out of `addresses` (the snapshot's live workers) for
        `linger_s` by `now_s`, with no call on it. Called after each registry read (not while
        Redis is unreachable: the snapshot, frozen, keeps its workers)."""
        for address in [a for a in self._channels if a not in addresses]:
            if address not in self._channels:  # closed meanwhile (by `close`)
                continue
            left_at_s = self._left_at_s.setdefault(address, now_s)
            if now_s - left_at_s >= self.linger_s and not self.is_busy(address):
                log.info("links: closing the link to %s, gone from the registry", address)
                await self._close(address)
        for address in [a for a in self._left_at_s if a in addresses]:
            del self._left_at_s[address]  # back (or never gone: one read missed it)

    async def close(self) -> None:
        for address in list(self._channels):
            await self._close(address)

    async def _close(self, address: str) -> None:
        # Out of the maps first: a call routed here meanwhile opens a new link.
        self._left_at_s.pop(address, None)
        stream = self._streams.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is None:  # closed meanwhile (`close` and `prune` both got here)
            return
        if stream is not None:
            await stream.close()
        await channel.close()
