"""Blocking gRPC servers on loopback port 0, for tests of the slim (blocking) client against a
real server playing the gateway."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

#: Adds a servicer to a server: a protoc `add_<Service>Servicer_to_server` function.
AddServicer = Callable[[Any, grpc.Server], None]


@contextlib.contextmanager
def sync_servers(add: AddServicer) -> Iterator[Callable[..., str]]:
    """Yields `start(servicer, options=())`, which serves `servicer` (added with `add`) on a
    new server and returns its address; every server started stops on exit."""
    servers: list[grpc.Server] = []

    def start(servicer: Any, options: tuple[tuple[str, Any], ...] = ()) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
        add(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    try:
        yield start
    finally:
        for server in servers:
            server.stop(grace=None)
