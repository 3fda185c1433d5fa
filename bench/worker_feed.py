"""How many rows one worker process takes when rows arrive in bundles.

The data-path issue asks whether a worker's gRPC front must run in processes of its own
(vLLM's API-server / engine split), or whether one process can feed a GPU once the per-row
path is cheap. This feeds the GPU-speed stand-in's worker (bench.fabric.stand_in: minilm at
the H100's measured speed, so the worker's CPU is all tiers' work and no model's) directly,
as a router would: over one InferStream, `--callers` bundles in flight, each of `rows`
one-text rows of 16 token ids. For each bundle size it reports rows/s, the worker process's
CPU per row, and the rows/s one fully busy core would take at that cost (its ceiling), and it
fits CPU per bundle = fixed + rows * per_row over the sizes.

With `--front-processes N` the worker runs N gRPC fronts relaying to its engine
(services.gpu_worker.front), fed over as many connections as fronts (the kernel places
connections, so two may land on one front): the figures are then the engine's CPU, with the
fronts' CPU per bundle beside them.

With `--through-router` the bundles go to the stack's router instead, as a gateway sends them
(with their routing metadata), and the router's CPU per bundle is reported beside the
worker's: set beside `python -m bench.stream_floor` (grpc.aio's own cost of relaying a
message) it shows what the router's own work per bundle costs.

    python -m bench.worker_feed            # about 1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench import loopback
from bench.fabric.stack import start_stack, write_minilm_repository
from bench.fabric.stand_in import worker_args
from services.common.bundles import pack_token_rows
from services.common.channel_options import CHANNEL_OPTIONS
from services.common.multiplex import MultiplexClient
from services.common.procfs import descendants, is_alive
from services.common.registry_schema import route_metadata
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc

#: Tokens per row: the stand-in curve's 16-token bucket, as bench.fabric's uniform texts.
TOKENS = 16
RESULTS = Path(__file__).parent / "results" / "worker_feed.json"
#: One connection per channel (grpc otherwise shares one among a process's like channels), so
#: that a worker's fronts each take some.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def bundle_bytes(fingerprint: str, rows: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    ids = [
        np.concatenate(([101], rng.integers(2000, 20000, TOKENS - 2), [102])).astype("<i4")
        for _ in range(rows)
    ]
    token_ids, lengths = pack_token_rows(ids)
    request = pb.InferRequest(
        model_name="minilm",
        model_version="1",
        fingerprint=fingerprint,
        slices=[pb.Slice(rows=1, tenant="bench") for _ in range(rows)],
        packed=pb.PackedRows(token_ids=token_ids, row_lengths=lengths),
    )
    return request.SerializeToString()


async def feed(
    clients: list[MultiplexClient],
    body: bytes,
    *,
    callers: int,
    duration_s: float,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[int, int]:
    """(bundles answered OK, bundles failed) in `duration_s` with `callers` in flight, spread
    over `clients`; `metadata`: each call's (a router's routing facts)."""
    ok = failed = 0
    end_s = time.monotonic() + duration_s

    async def caller(client: MultiplexClient) -> None:
        nonlocal ok, failed
        while time.monotonic() < end_s:
            try:
                answer = await client.call(body, metadata=metadata, timeout_s=5.0)
                reply = pb.InferResponse.FromString(answer)
                ok += all(s.code == 0 for s in reply.slices)
                failed += any(s.code != 0 for s in reply.slices)
            except Exception:
                failed += 1

    await asyncio.gather(*(caller(clients[i % len(clients)]) for i in range(callers)))
    return ok, failed


async def measure(
    address: str,
    pid: int,
    sizes: list[int],
    callers: int,
    duration_s: float,
    connections: int,
    router_pid: int | None = None,
) -> list[dict[str, Any]]:
    """With fronts (`--front-processes`), `pid` is the engine's: the figures are the engine's
    CPU, and its fronts' CPU is reported beside them. With `router_pid`, `address` is that
    router's, and its CPU per bundle is reported too."""
    results = []
    channels = [
        grpc.aio.insecure_channel(address, options=(*CHANNEL_OPTIONS, *OWN_CONNECTION))
        for _ in range(connections)
    ]
    clients = [MultiplexClient(channel, f"worker-{i}") for i, channel in enumerate(channels)]
    try:
        models = await pb_grpc.WorkerServiceStub(channels[0]).ListModels(
            pb.ListWorkerModelsRequest()
        )
        fingerprint = next(v.fingerprint for v in models.versions if v.model_name == "minilm")
        fronts = [child for child in descendants(pid) if is_alive(child)]
        for rows in sizes:
            body = bundle_bytes(fingerprint, rows, seed=rows)
            metadata = () if router_pid is None else route_metadata("minilm", "1", rows)
            run = {"callers": callers, "metadata": metadata}
            await feed(clients, body, duration_s=duration_s / 4, **run)  # warm
            routers = [] if router_pid is None else [router_pid]
            before_cpu, before_s = _cpu_s([pid]), time.monotonic()
            before_fronts, before_router = _cpu_s(fronts), _cpu_s(routers)
            ok, failed = await feed(clients, body, duration_s=duration_s, **run)
            cpu_s, elapsed_s = _cpu_s([pid]) - before_cpu, time.monotonic() - before_s
            fronts_cpu_s = _cpu_s(fronts) - before_fronts
            router_cpu_s = _cpu_s(routers) - before_router
            answered_rows = ok * rows
            per_row_s = cpu_s / answered_rows if answered_rows else float("nan")
            result = {
                "rows_per_bundle": rows,
                "bundles_ok": ok,
                "bundles_failed": failed,
                "rows_per_s": round(answered_rows / elapsed_s, 1),
                "worker_cpu_share": round(cpu_s / elapsed_s, 3),
                "cpu_us_per_row": round(per_row_s * 1e6, 1),
                "cpu_us_per_bundle": round(per_row_s * rows * 1e6, 1),
                "one_core_rows_per_s": round(1.0 / per_row_s) if answered_rows else 0,
            }
            if fronts:
                result["fronts_cpu_us_per_bundle"] = round(fronts_cpu_s / max(ok, 1) * 1e6, 1)
            if routers:
                result["router_cpu_us_per_bundle"] = round(router_cpu_s / max(ok, 1) * 1e6, 1)
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        await asyncio.gather(*(client.close() for client in clients))
        await asyncio.gather(*(channel.close() for channel in channels))
    return results


def _cpu_s(pids: list[int]) -> float:
    return sum(loopback.cpu_s(pid) for pid in pids)


def fit(results: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares of CPU per bundle = fixed + rows * per_row, microseconds."""
    rows = np.array([r["rows_per_bundle"] for r in results], dtype=float)
    cost = np.array([r["cpu_us_per_bundle"] for r in results], dtype=float)
    per_row, fixed = np.polyfit(rows, cost, 1)
    return {"fixed_us_per_bundle": round(float(fixed), 1), "us_per_row": round(float(per_row), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,32,64", help="rows per bundle, comma-separated")
    parser.add_argument("--callers", type=int, default=16, help="bundles in flight")
    parser.add_argument("--duration-s", type=float, default=8.0, help="per bundle size")
    parser.add_argument(
        "--front-processes",
        type=int,
        default=0,
        help="the worker's fronts (its --front-processes); the figures are then its engine's",
    )
    parser.add_argument(
        "--connections", type=int, default=0, help="connections fed (0: one per front, or one)"
    )
    parser.add_argument(
        "--through-router",
        action="store_true",
        help="feed the stack's router, as a gateway does, and report its CPU per bundle too",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="worker-feed-"))
    repository = root / "repo"
    write_minilm_repository(repository)
    fronts = ("--front-processes", str(args.front_processes)) if args.front_processes else ()
    connections = args.connections or max(1, args.front_processes)
    stack = start_stack(repository, root / "stack", extra_worker_args=(*worker_args(), *fronts))
    try:
        (worker,) = stack.ready["workers"]
        (router,) = stack.ready["routers"]
        fed = router if args.through_router else worker
        address = f"127.0.0.1:{fed['grpc_port']}"
        router_pid = router["pid"] if args.through_router else None
        results = asyncio.run(
            measure(
                address,
                worker["pid"],
                sizes,
                args.callers,
                args.duration_s,
                connections,
                router_pid,
            )
        )
    finally:
        stack.stop()
    report = {
        "callers": args.callers,
        "front_processes": args.front_processes,
        "connections": connections,
        "through_router": args.through_router,
        "tokens_per_row": TOKENS,
        "sizes": results,
    }
    if len(results) >= 2:
        report["fit"] = fit(results)
        print(json.dumps(report["fit"]))
    write_report(args.output, report)
    return 0


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
