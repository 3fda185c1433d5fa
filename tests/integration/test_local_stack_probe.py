"""The local stack's launcher reads its router's metrics directly, whatever proxy the
environment names (a loopback HTTP server here)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from services.common.metric_names import ROUTER_LIVE_WORKERS
from services.local_stack.children import sees_workers

pytestmark = pytest.mark.integration


@pytest.fixture
def metrics_port() -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"{ROUTER_LIVE_WORKERS} 2.0\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_router_is_read_directly_whatever_proxy_the_environment_names(
    metrics_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `http_proxy` set and no `no_proxy`, urllib sent the read to the proxy: `make run`
    waited out its ready timeout for a healthy router (review finding)."""
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:1")  # nothing listens there
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    router = SimpleNamespace(ports={"metrics_port": metrics_port})
    assert sees_workers(router, 2)  # type: ignore[arg-type]
    assert not sees_workers(router, 3)  # type: ignore[arg-type]
