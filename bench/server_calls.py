"""Server CPU per unary call: a bare grpc.aio server against one built by `new_server` with
the gateway's stages (error mapping, tracing, authentication) and its door.

    python -m bench.server_calls [--seconds 8] [--concurrency 32] [--event-loop asyncio] [MODE ...]

Modes: `bare` (grpc.aio, no interceptor), `errors` (`new_server()`: error mapping only),
`stages` (error mapping, tracing, authentication without keys), `door` (`stages` behind the
door). The server answers each call with its own bytes, so what differs between modes is what
the interceptor costs. `door-refusing` (the door's limit held at one call in flight, which
each served call holds for 50 ms) has the door refuse nearly every call, RESOURCE_EXHAUSTED
with a hint, before the stages or any parser; `grpc-refusing` (`stages` with
`--max-concurrent-rpcs 1`: grpc answers RESOURCE_EXHAUSTED before any parser or handler, once
the interceptors ran) refuses about half the calls, and `grpc-dropping` (`stages` with
`--max-pending-calls 2`: grpc's C core drops, CANCELLED, calls waiting to be picked up past
two, all of them past four, before any Python) most of them, for what a refusal costs against
a served call (issue 33's goal: at most 0.2); with `stages`
measured in the same run, each refused call's own CPU is printed too (the mixed figure less the
served calls' share at the `stages` cost). `http` serves the same echo as an HTTP POST to a
KServe infer path through the gateway's HTTP middleware (aiohttp, the door, authentication
without keys, tenant admission), and `http-door-refusing` has that door refuse as
`door-refusing` does (429), priced against `http`. `predict` and `kserve` serve a real call in
`stages`' server: the gateway's v1 `Predict`, or KServe's `ModelInfer` (a stock Triton
client's call), of one identity-model row, through its real coalescer, the router's side
faked as `python -m bench.gateway_path` fakes it (each bundle answered in the process, here
after 2 ms, about the router's and worker's time, so that bundles form as in the stack). Set
beside `stages`, they give what the gateway's own serving path costs in its server, where
`bench.gateway_path` times it alone. They have no door: on one pinned CPU a real call's load
holds the door near its limit, and the share of calls it then refuses blurs their cost. On a
machine with two CPUs or more the server runs on CPU 1 and the client on CPU 0, so that
neither disturbs the other's figure. Beside its CPU, each mode reports the server's context
switches a call: its event loop's thread's (`loop_switches_per_call`: preempted, or gone to
sleep), and its other threads' (`other_threads_switches_per_call`: grpc's completion-queue
poller and its engine's threads, each switch a wake-up that hands the loop an event).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry

from bench.gateway_path import gateway_method, request_of
from bench.loopback import cpu_s, switches_between, thread_switches
from services.common import event_loop
from services.common.door import Door
from services.common.door_config import DoorConfig
from services.common.interceptors import Stage
from services.common.lifecycle import new_server
from services.common.tracing import Tracing
from services.gateway.admission import TenantAdmission
from services.gateway.auth import Authentication
from services.gateway.http.server import HeldBodies, auth_middleware
from services.gateway.metrics import GatewayMetrics
from services.gateway.server import DOOR_METHODS
from services.gateway.tenants import TenantLabels
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference.v1 import inference_pb2 as api

SERVICE = api.DESCRIPTOR.services_by_name["InferenceService"].full_name
METHOD = f"/{SERVICE}/Predict"
MODES = ("bare", "errors", "stages", "door", "door-refusing", "grpc-refusing", "grpc-dropping",
         "http", "http-door-refusing", "predict", "kserve")  # fmt: skip
#: The modes serving a real gateway call: the method each calls (bench.gateway_path's modes).
GATEWAY_MODES = {"predict": "bundled", "kserve": "kserve"}
KSERVE_SERVICE = kserve.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
#: The faked router's and worker's time a bundle, seconds (their bundles' round trip in the
#: stand-in stack is a few ms).
GATEWAY_HOP_S = 0.002
#: How each refusing mode's refusals end at the caller.
REFUSALS = {
    "door-refusing": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "grpc-refusing": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "grpc-dropping": grpc.StatusCode.CANCELLED,
}
#: HTTP modes: what their refusals are priced against, and the path they call.
HTTP_REFUSALS = {"http-door-refusing": "http"}
HTTP_PATH = "/v2/models/echo/infer"
HTTP_REFUSED = 429
#: `door-refusing`'s door: its limit held at one call in flight.
REFUSING_DOOR = DoorConfig(initial_limit=1, min_limit=1, max_limit=1)


async def _echo(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return request


async def _slow_echo(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    """`door-refusing`'s: a call served holds the door's one place for 50 ms."""
    await asyncio.sleep(0.05)
    return request


def _server(mode: str) -> tuple[grpc.aio.Server, Door | None]:
    if mode == "bare":
        return grpc.aio.server(), None
    if mode == "errors":
        return new_server(), None
    stages: list[Stage] = [Tracing(), Authentication(None)]
    if mode == "stages" or mode in GATEWAY_MODES:
        return new_server(stages), None
    if mode == "grpc-refusing":
        return new_server(stages, max_concurrent_rpcs=1), None
    if mode == "grpc-dropping":
        return new_server(stages, max_pending_calls=2), None
    config = REFUSING_DOOR if mode.endswith("door-refusing") else DoorConfig()
    door = Door(DOOR_METHODS, config, CollectorRegistry())
    return new_server(stages, door=door), door


async def _start_http(door: Door | None, refusing: bool) -> tuple[web.AppRunner, int]:
    """The gateway's HTTP middleware (no keys) in front of an echo route; with `refusing`, a
    call served holds the door's one place for 50 ms."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        if refusing:
            await asyncio.sleep(0.05)
        return web.Response(body=body, content_type="application/json")

    admission = TenantAdmission(GatewayMetrics(CollectorRegistry()), TenantLabels())
    bodies = HeldBodies(4 * 1024 * 1024)
    app = web.Application(middlewares=[auth_middleware(None, admission, door, bodies)])
    app.router.add_post(HTTP_PATH, echo)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])


async def _gateway_handlers(mode: str, root: Path) -> grpc.GenericRpcHandler:
    """The gateway's Predict (or ModelInfer, `mode` "kserve") over the identity model written
    in `root`, as bench.gateway_path serves it (`gateway_method`)."""
    method = await gateway_method(mode, root, hop_s=GATEWAY_HOP_S)
    handler = grpc.unary_unary_rpc_method_handler(
        method.serve, request_deserializer=method.parse, response_serializer=_serialized
    )
    if mode == "kserve":
        return grpc.method_handlers_generic_handler(KSERVE_SERVICE, {"ModelInfer": handler})
    return grpc.method_handlers_generic_handler(SERVICE, {"Predict": handler})


def _serialized(answer: Any) -> bytes:
    """A gateway answer's bytes (the handler's response serializer)."""
    return answer.SerializeToString()


def _request(mode: str) -> tuple[str, bytes]:
    """The method a mode's client calls and the bytes it sends."""
    if mode not in GATEWAY_MODES:
        return METHOD, b"x" * 40
    method = f"/{KSERVE_SERVICE}/ModelInfer" if mode == "kserve" else METHOD
    return method, request_of(GATEWAY_MODES[mode]).SerializeToString()


def _pin(cpu: int) -> None:
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {cpu})


def _serve(mode: str, loop: str, ports: multiprocessing.Queue[int], stop: Event) -> None:
    _pin(1)

    async def run() -> None:
        server, door = _server(mode)  # `http` gets the stages and a door at rest
        repository = tempfile.TemporaryDirectory(prefix="server-calls-")  # the gateway modes'
        if mode in GATEWAY_MODES:
            generic = await _gateway_handlers(GATEWAY_MODES[mode], Path(repository.name))
        else:
            echo = _slow_echo if mode == "door-refusing" else _echo
            handler: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(echo)
            generic = grpc.method_handlers_generic_handler(SERVICE, {"Predict": handler})
        server.add_generic_rpc_handlers((generic,))
        port = server.add_insecure_port("127.0.0.1:0")
        if door is not None:
            door.listen(server)
        await server.start()
        if door is not None:
            door.start()
        http = None
        if mode.startswith("http"):
            http, port = await _start_http(door, mode in HTTP_REFUSALS)
        ports.put(port)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        if http is not None:
            await http.cleanup()
        if door is not None:
            await door.stop()
        await server.stop(0)
        repository.cleanup()

    event_loop.run(run(), loop)


async def _calls(
    port: int, seconds: float, concurrency: int, mode: str = "bare"
) -> tuple[int, int]:
    """Calls answered, and of them refused (RESOURCE_EXHAUSTED, or CANCELLED when grpc dropped
    them unseen), in `seconds` by `concurrency` closed-loop callers of `mode`'s `_request`."""
    method, body = _request(mode)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method)
        answered, refused, end = 0, 0, time.monotonic() + seconds

        async def caller() -> None:
            nonlocal answered, refused
            while time.monotonic() < end:
                try:
                    await call(body, metadata=(("authorization", "Bearer bench"),))
                except grpc.aio.AioRpcError as error:
                    if error.code() not in REFUSALS.values():
                        raise
                    refused += 1
                answered += 1

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return answered, refused


async def _http_calls(
    port: int, seconds: float, concurrency: int, mode: str = "http"
) -> tuple[int, int]:
    """`_calls` over HTTP/1.1 (one keep-alive connection per caller): refused is 429."""
    url, body = f"http://127.0.0.1:{port}{HTTP_PATH}", b'{"inputs": []}' + b" " * 26
    headers = {"Authorization": "Bearer bench", "Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        answered, refused, end = 0, 0, time.monotonic() + seconds

        async def caller() -> None:
            nonlocal answered, refused
            while time.monotonic() < end:
                async with session.post(url, data=body, headers=headers) as answer:
                    await answer.read()
                    if answer.status == HTTP_REFUSED:
                        refused += 1
                    elif answer.status != 200:
                        raise RuntimeError(f"HTTP {answer.status}: {await answer.text()}")
                answered += 1

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return answered, refused


def measure(mode: str, seconds: float, concurrency: int, loop: str) -> dict[str, Any]:
    ports: multiprocessing.Queue[int] = multiprocessing.Queue()
    stop = multiprocessing.Event()
    server = multiprocessing.Process(target=_serve, args=(mode, loop, ports, stop))
    server.start()
    try:
        port = ports.get(timeout=60)
        _pin(0)
        calls_of = _http_calls if mode.startswith("http") else _calls
        asyncio.run(calls_of(port, seconds / 4, concurrency, mode))  # warm-up
        before, switched = cpu_s(server.pid), thread_switches(server.pid)
        calls, refused = asyncio.run(calls_of(port, seconds, concurrency, mode))
        used_s = cpu_s(server.pid) - before
        loop_switches, other_switches = switches_between(
            server.pid, switched, thread_switches(server.pid)
        )
    finally:
        stop.set()
        server.join(timeout=10)
    return {
        "mode": mode,
        "event_loop": loop,
        "calls": calls,
        "refused_share": round(refused / calls, 3),
        "server_cpu_us_per_call": round(used_s / calls * 1e6, 1),
        "loop_switches_per_call": round(loop_switches / calls, 2),
        "other_threads_switches_per_call": round(other_switches / calls, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.server_calls", description=__doc__)
    parser.add_argument("modes", nargs="*", metavar="MODE", help=f"of {', '.join(MODES)} (all)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--event-loop",
        type=event_loop.parse_event_loop,
        default="asyncio",
        help="the server's event loop: asyncio (default: the yardstick every earlier figure "
        "used) or uvloop (as the tiers run since services.common.event_loop)",
    )
    args = parser.parse_args()
    unknown = [mode for mode in args.modes if mode not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    results = {}
    for mode in args.modes or MODES:
        results[mode] = measure(mode, args.seconds, args.concurrency, args.event_loop)
        print(json.dumps(results[mode]), flush=True)
    priced_against = {**dict.fromkeys(REFUSALS, "stages"), **HTTP_REFUSALS}
    for mode, base in priced_against.items():
        if base not in results or mode not in results:
            continue
        served = results[base]["server_cpu_us_per_call"]
        mixed = results[mode]
        share = mixed["refused_share"]
        if share > 0:
            refused = (mixed["server_cpu_us_per_call"] - (1 - share) * served) / share
            print(f"{mode}: a refused call about {refused:.0f} us ({refused / served:.2f} of "
                  f"one served in `{base}`: {served:.0f} us)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
