"""The floor under a multiplexed hop: what grpc.aio itself costs a process that relays stream
messages, as the router relays bundles, with none of the fabric's own work.

    python -m bench.stream_floor [--calls 3000] [--in-flight 1,4] [--size 600]

Three processes on loopback: a caller, a relay and an echo. The caller keeps one
bidirectional stream to the relay; the relay keeps one to the echo, forwards each message it
reads there, and sends each answer back on the caller's stream: two messages read and two
written per call, as a router does per bundle (read from a gateway, write to a worker, read
its answer, write it back). `--in-flight` callers share the caller's stream, each waiting for
its answer before its next call: one in flight is the router fed one bundle at a time, where
every message wakes an idle event loop. Reports the relay's and the echo's CPU per call, and
a bare unary grpc.aio echo call's server CPU measured in the same run, the unit the fabric's
benchmarks count tiers in (echo-calls).

Compare the relay's figure with the router's own CPU per bundle fed the same way (the
stand-in stack's router fed bundles as a gateway): what is above the floor is the fabric's
work per bundle (routing, reservation, spans, metrics and timeouts, the streams' framing of
calls); the floor itself only fewer messages, or fewer processes on the path, remove.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections.abc import AsyncIterator
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import grpc

from bench.loopback import cpu_s, serve_until, start_server, stop_servers

SERVICE = "bench.Floor"
STREAM = f"/{SERVICE}/Stream"
UNARY = f"/{SERVICE}/Unary"
RESULTS = Path(__file__).parent / "results" / "stream_floor.json"


async def _echo_stream(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    async for message in requests:
        yield message


async def _echo_unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return request


class _Pipe:
    """One client stream whose answers come back in order: `call` writes a message and waits
    for its answer (writes take turns: grpc.aio allows one at a time)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._call = channel.stream_stream(STREAM)()
        self._waiting: list[asyncio.Future[bytes]] = []
        self._turn = asyncio.Lock()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        ended: BaseException = EOFError("the stream ended")
        try:
            while isinstance(message := await self._call.read(), bytes):
                self._waiting.pop(0).set_result(message)
        except grpc.aio.AioRpcError as error:  # its peer stopped first
            ended = error
        finally:  # nobody waits past the stream's end
            for answer in self._waiting:
                if not answer.done():
                    answer.set_exception(ended)

    async def call(self, message: bytes) -> bytes:
        answer = asyncio.get_running_loop().create_future()
        async with self._turn:
            self._waiting.append(answer)
            await self._call.write(message)
        return await answer

    def close(self) -> None:
        self._reader.cancel()
        self._call.cancel()


def _relay_of(pipe: _Pipe) -> Any:
    async def relay(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue[asyncio.Task[bytes]] = asyncio.Queue()

        async def read() -> None:
            async for message in requests:
                answers.put_nowait(loop.create_task(pipe.call(message)))

        reading = loop.create_task(read())
        try:
            while True:
                yield await (await answers.get())
        finally:
            reading.cancel()

    return relay


def _serve(upstream: int | None, ports: multiprocessing.Queue[int], stop: Event) -> None:
    """The echo (`upstream` None), or the relay to the echo on port `upstream`."""

    async def run() -> None:
        channel, stream = None, _echo_stream
        if upstream is not None:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{upstream}")
            stream = _relay_of(_Pipe(channel))
        handlers = {
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
            "Unary": grpc.unary_unary_rpc_method_handler(_echo_unary),
        }
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        await serve_until(server, ports, stop)
        if channel is not None:
            await channel.close()

    asyncio.run(run())


async def _relayed(port: int, calls: int, in_flight: int, size: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        pipe, message = _Pipe(channel), b"x" * size

        async def caller() -> None:
            for _ in range(calls // in_flight):
                await pipe.call(message)

        await asyncio.gather(*(caller() for _ in range(in_flight)))
        pipe.close()


async def _unary(port: int, calls: int, in_flight: int, size: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(UNARY)
        message = b"x" * size

        async def caller() -> None:
            for _ in range(calls // in_flight):
                await call(message)

        await asyncio.gather(*(caller() for _ in range(in_flight)))


async def _measured(
    relay: multiprocessing.Process,
    echo: multiprocessing.Process,
    ports: tuple[int, int],
    calls: int,
    in_flight: int,
    size: int,
) -> dict[str, Any]:
    relay_port, echo_port = ports
    await _relayed(relay_port, calls // 4, in_flight, size)  # warm-up
    relay_0, echo_0 = cpu_s(relay.pid), cpu_s(echo.pid)
    started = time.monotonic()
    await _relayed(relay_port, calls, in_flight, size)
    seconds = time.monotonic() - started
    relay_s, echo_s = cpu_s(relay.pid) - relay_0, cpu_s(echo.pid) - echo_0
    await _unary(echo_port, calls // 4, in_flight, size)  # warm-up
    unary_0 = cpu_s(echo.pid)
    await _unary(echo_port, calls, in_flight, size)
    unary_s = cpu_s(echo.pid) - unary_0
    done = calls // in_flight * in_flight
    return {
        "in_flight": in_flight,
        "calls": done,
        "calls_per_s": round(done / seconds),
        "relay_cpu_us_per_call": round(relay_s / done * 1e6, 1),
        "echo_stream_cpu_us_per_call": round(echo_s / done * 1e6, 1),
        "unary_echo_cpu_us_per_call": round(unary_s / done * 1e6, 1),
        "relay_in_unary_echo_calls": round(relay_s / unary_s, 2),
    }


def measure(calls: int, in_flight: int, size: int) -> dict[str, Any]:
    """CPU per call of the relay and of the echo behind it, and of a bare unary echo call."""
    servers = [start_server(_serve, None)]
    try:
        servers.insert(0, start_server(_serve, servers[0][1]))  # the relay, to the echo's port
        (relay, relay_port, _), (echo, echo_port, _) = servers
        ports = (relay_port, echo_port)
        return asyncio.run(_measured(relay, echo, ports, calls, in_flight, size))
    finally:  # the relay first: its stream to the echo ends before the echo does
        stop_servers(servers)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stream_floor", description=__doc__)
    parser.add_argument("--calls", type=int, default=3000, help="calls per measurement")
    parser.add_argument("--in-flight", default="1,4", help="calls in flight, comma-separated")
    parser.add_argument("--size", type=int, default=600, help="bytes a message")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    in_flight = [int(n) for n in args.in_flight.split(",")]
    if args.calls < 1 or args.size < 0 or any(not 1 <= n <= args.calls for n in in_flight):
        parser.error("--calls >= 1, --size >= 0, and each --in-flight between 1 and --calls")
    results = []
    for n in in_flight:
        results.append(measure(args.calls, n, args.size))
        print(json.dumps(results[-1]), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
