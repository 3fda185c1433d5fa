"""How often the tiers' channels try again to reach a peer that is not there: a router that
dials a worker restarting at its address, a front whose engine restarts, a gateway whose
router restarts. gRPC's own backoff grows to 120 s (1 s, then x1.6 each failure), so a peer
back after a crash loop stayed unreachable from a channel for up to two minutes, every call on
it failing at once meanwhile (review finding). A real channel against a loopback listener that
closes every connection it accepts; about 10 s."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.channel_options import CHANNEL_OPTIONS, channel_options
from services.gateway.router_retry import ROUTER_CHANNEL_OPTIONS
from services.jobs.__main__ import PUBLIC_KEEPALIVE_S

pytestmark = pytest.mark.integration

WATCH_S = 10.0


async def attempts_within(options: tuple[tuple[str, object], ...], watch_s: float) -> int:
    """Connections a channel with `options` opens to a peer that closes each at once, within
    `watch_s` of its first."""
    accepted: list[float] = []

    async def refuse(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(asyncio.get_running_loop().time())
        writer.close()

    listener = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            channel.get_state(try_to_connect=True)
            while not accepted:
                await asyncio.sleep(0.01)
            await asyncio.sleep(watch_s)
    finally:
        listener.close()
    return sum(1 for at in accepted if at - accepted[0] <= watch_s)


@pytest.mark.parametrize(
    "options",
    [CHANNEL_OPTIONS, ROUTER_CHANNEL_OPTIONS, channel_options(PUBLIC_KEEPALIVE_S)],
    ids=["internal", "gateway_to_routers", "jobs_to_gateway"],
)
async def test_a_channel_tries_a_missing_peer_again_every_two_seconds_at_most(
    options: tuple[tuple[str, object], ...],
) -> None:
    # Backing off 0.2 s x1.6 up to 2 s (jitter 20%): at least 8 tries within 10 s. gRPC's
    # defaults (1 s x1.6 up to 120 s) make at most 5 (0, 1, 2.6, 5.2, 9.3 s, less with jitter);
    # 6 leaves room for timers late on a loaded machine.
    assert await attempts_within(options, WATCH_S) >= 6
