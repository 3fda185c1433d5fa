"""grpc's bound on the calls a server's C core holds that no Python has picked up yet."""

from __future__ import annotations

#: Largest `max_pending_calls`: grpc takes twice it as a C int.
MAX_PENDING_CALLS = 2**30 - 1


def pending_call_options(max_pending_calls: int) -> tuple[tuple[str, int], ...]:
    """grpc's options bounding the calls waiting in its C core for the server's Python to pick
    them up (0: grpc's defaults).

    A grpc.aio server picks up one call at a time, each after a few turns of its event loop;
    when the loop is saturated (the tiers, not the model, are the bottleneck: issue 33),
    arrivals wait there, where no Python sees them, and every caller's patience becomes
    queueing time. grpc's random early drop bounds that queue (one for all the methods a
    server takes through generic handlers, `serve_registered_as_generic`; one of its own for
    each method still registered, health's): up to the soft limit every call is kept, then an
    arrival is dropped with the chance (size - soft) / (hard - soft), and always at the hard
    limit, here twice the soft one (a burst that many is kept whole). A dropped call ends
    CANCELLED at its caller (grpc 1.85; tests/integration/test_gateway_limits.py would see a
    change), costing the server's Python nothing, whoever its caller: dropped before any quota
    or share applies. The calls kept wait at most about `2 * max_pending_calls` pickups."""
    if max_pending_calls == 0:
        return ()
    return (
        ("grpc.server.max_pending_requests", max_pending_calls),
        ("grpc.server.max_pending_requests_hard_limit", 2 * max_pending_calls),
    )
