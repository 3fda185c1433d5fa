"""A route behind the gateway's HTTP middleware, served by aiohttp on loopback in the test's
own process (for tests of what the middleware and the stream writer do with a handler)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CollectorRegistry

from services.gateway.admission import TenantAdmission
from services.gateway.http.server import Handler, HeldBodies, auth_middleware
from services.gateway.metrics import GatewayMetrics
from services.gateway.tenants import TenantLabels


@contextlib.asynccontextmanager
async def serving_route(path: str, handler: Handler) -> AsyncIterator[int]:
    """`handler` at POST `path` behind the gateway's middleware (no door, no keys); yields
    the port."""
    admission = TenantAdmission(GatewayMetrics(CollectorRegistry()), TenantLabels({}))
    middleware = auth_middleware(None, admission, None, HeldBodies(4 * 1024 * 1024))
    app = web.Application(middlewares=[middleware])
    app.add_routes([web.post(path, handler)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
