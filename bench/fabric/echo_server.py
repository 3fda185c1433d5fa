"""A bare grpc.aio echo server: the ceiling the fabric's serving overhead is measured against.

    python -m bench.fabric.echo_server [--port 0] [--ready-file PATH]

One process, one generic unary handler (`/bench.Echo/Echo`), bytes in and the same bytes out:
no protobuf parsing, no auth, no metrics, no hops. The fabric's identity-model run sends a
payload of the same size through gateway, router and worker with the same client, so the
ratio of the two is what the three tiers cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

import grpc

SERVICE = "bench.Echo"
METHOD = f"/{SERVICE}/Echo"


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def echo_stub(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    """The client side: bytes in, bytes out (no (de)serializers, as the server)."""
    return channel.unary_unary(METHOD)


async def serve(port: int, ready_file: Path | None) -> None:
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(_echo)
    generic = grpc.method_handlers_generic_handler(SERVICE, {"Echo": handler})
    server.add_generic_rpc_handlers((generic,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    if ready_file is not None:
        # Written whole and renamed, so the parent never reads half a file.
        partial = ready_file.with_name(ready_file.name + ".partial")
        partial.write_text(json.dumps({"grpc_port": bound, "pid": os.getpid()}))
        os.replace(partial, ready_file)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()
    await server.stop(grace=0.5)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fabric.echo_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--ready-file", type=Path, default=None, help="JSON {grpc_port, pid}")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.ready_file))


if __name__ == "__main__":
    main()
