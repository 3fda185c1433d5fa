"""What the methods a server registers cost each call: two echo servers with a gateway's
stages and the services it serves beside its own API (KServe's, the jobs API, health and
reflection, added as the gateway adds them, never called), one as grpc.aio serves them
(every method registered) and one as the tiers' servers do
(`services.common.lifecycle.serve_registered_as_generic`: generic handlers only).

    python -m bench.registered_methods [--rounds 12] [--burst-s 1] [--no-services]

The two are driven in turns, `--concurrency` closed-loop callers for `--burst-s` each, the
order swapped every round, so that the machine's drift falls on both alike: the server CPU
per call of each, summed over the rounds. `--no-services` runs the same two without the other
services, the control (what differs there is noise, or where the two servers landed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time
from multiprocessing.synchronize import Event
from typing import Any

import grpc

from bench.loopback import cpu_s, serve_until, start_server, stop_servers
from bench.server_calls import METHOD, SERVICE
from services.common.interceptors import ServerCalls
from services.common.lifecycle import add_health_and_reflection, serve_registered_as_generic
from services.common.tracing import Tracing
from services.gateway.auth import Authentication
from services.gateway.server import SERVICE_NAMES
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from services.pb.inference.v1 import jobs_pb2_grpc as jobs_grpc


async def _echo(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return request


def _serve(generic_only: bool, services: bool, ports: Any, stop: Event) -> None:
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {1})

    async def run() -> None:
        server = grpc.aio.server(interceptors=[ServerCalls([Tracing(), Authentication(None)])])
        if generic_only:
            serve_registered_as_generic(server)
        echo = grpc.unary_unary_rpc_method_handler(_echo)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Predict": echo}),)
        )
        if services:  # the echo stands for the gateway's own API
            kserve_grpc.add_GRPCInferenceServiceServicer_to_server(
                kserve_grpc.GRPCInferenceServiceServicer(), server
            )
            jobs_grpc.add_JobServiceServicer_to_server(jobs_grpc.JobServiceServicer(), server)
            await add_health_and_reflection(server, SERVICE_NAMES)
        await serve_until(server, ports, stop)

    asyncio.run(run())


async def _burst(channel: grpc.aio.Channel, seconds: float, concurrency: int) -> int:
    call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(METHOD)
    calls, end = 0, time.monotonic() + seconds

    async def caller() -> None:
        nonlocal calls
        while time.monotonic() < end:
            await call(b"x" * 100)
            calls += 1

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return calls


async def _drive(
    servers: dict[str, tuple[int | None, int]], rounds: int, burst_s: float, concurrency: int
) -> dict[str, dict[str, float]]:
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    channels = {
        name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, (_, port) in servers.items()
    }
    totals = {name: [0.0, 0] for name in servers}
    try:
        for name in servers:  # warm-up
            await _burst(channels[name], burst_s, concurrency)
        order = list(servers)
        for _ in range(rounds):
            for name in order:
                pid = servers[name][0]
                before = cpu_s(pid)
                calls = await _burst(channels[name], burst_s, concurrency)
                totals[name][0] += cpu_s(pid) - before
                totals[name][1] += calls
            order.reverse()
    finally:
        await asyncio.gather(*(channel.close() for channel in channels.values()))
    return {
        name: {"calls": calls, "server_cpu_us_per_call": round(cpu_s / calls * 1e6, 1)}
        for name, (cpu_s, calls) in totals.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.registered_methods", description=__doc__)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--burst-s", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--no-services", action="store_true", help="the control: the echo alone")
    args = parser.parse_args()
    if args.rounds < 1 or args.burst_s <= 0 or args.concurrency < 1:
        parser.error("--rounds >= 1, --burst-s > 0 and --concurrency >= 1")
    started: list[tuple[multiprocessing.Process, int, Event]] = []
    try:
        servers = {}
        for name, generic_only in (("registered", False), ("generic_only", True)):
            started.append(start_server(_serve, generic_only, not args.no_services))
            servers[name] = (started[-1][0].pid, started[-1][1])
        results = asyncio.run(_drive(servers, args.rounds, args.burst_s, args.concurrency))
    finally:
        stop_servers(started)
    print(json.dumps({"services": not args.no_services, **results}))


if __name__ == "__main__":
    main()
