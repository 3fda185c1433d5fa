"""Options of the channels that carry the tiers' long-lived InferStreams (services.common.
multiplex), and of the other channels between tiers: message limits and keepalive pings."""

from __future__ import annotations

from services.common.lifecycle import MAX_MESSAGE_BYTES

#: How often a client pings a connection that has been quiet: a stream lives long, and a peer
#: that vanished without closing it (a lost node, a dropped route) would otherwise hold its
#: calls until their deadlines. With pings, the connection closes after a missed answer and the
#: calls fail UNAVAILABLE, which the router retries on another worker.
KEEPALIVE_S = 10.0


def channel_options(keepalive_s: float = KEEPALIVE_S) -> tuple[tuple[str, int], ...]:
    """Options of the channels that carry InferStreams (servers allow the pings: see
    lifecycle.PING_TOLERANCE). The ping waits half the interval for its answer."""
    return (
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", round(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(keepalive_s * 500)),
        # gRPC 1.6x+ times a ping out by this, not by keepalive_timeout (60 s by default).
        ("grpc.http2.ping_timeout_ms", round(keepalive_s * 500)),
        # Keep pinging a connection that sends nothing back: that silence is what we look for.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_time_between_pings_ms", round(keepalive_s * 1000)),
        # A peer back from a restart (a router, a worker restarted at its address, an engine
        # behind its fronts) is reached again within about 2 s: gRPC's defaults back off up to
        # 120 s, and a channel waiting out its backoff fails every call at once meanwhile.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    )


CHANNEL_OPTIONS = channel_options()
