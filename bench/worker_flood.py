"""Open-loop floods of one worker: what it answers within the SLO past what it can take.

Feeds the GPU-speed stand-in's worker directly, as a router would (bench.worker_feed's
bundles: `--slices` one-row slices of 16 token ids each), over one InferStream, at each rate
of `--rates` (bundles a second, evenly spaced, whatever the answers), each call allowing
`--timeout-s`. On a GPU box the worker process, not the model, is what a fleet of gateways
and routers floods; here the stand-in makes it so too. For each rate it reports the rows
offered and answered a second, the rows answered within the model's SLO (a call's latency),
the accepted calls' p99, what was refused (whole calls, and slices), and the worker's CPU.

    python -m bench.worker_flood --rates 140,560,140    # about 40 s

140 bundles a second is about half of what the stand-in's worker serves on this machine, 560
about twice. Method: docs/benchmarks.md (the worker under a flood).
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

from bench import loopback
from bench.fabric.stack import start_stack, write_minilm_repository
from bench.fabric.stand_in import worker_args
from bench.worker_feed import OWN_CONNECTION, bundle_bytes, write_report
from services.common.channel_options import CHANNEL_OPTIONS
from services.common.model_repository import load_repository
from services.common.multiplex import MultiplexClient
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc

RESULTS = Path(__file__).parent / "results" / "worker_flood.json"


class Phase:
    """What one rate's calls came to."""

    def __init__(self, slo_s: float) -> None:
        self.slo_s = slo_s
        self.ok_rows = self.good_rows = 0
        self.codes: dict[str, int] = {}
        self.latencies: list[float] = []

    def count(self, code: str, rows: int) -> None:
        self.codes[code] = self.codes.get(code, 0) + rows

    async def call(self, client: MultiplexClient, body: bytes, rows: int, timeout_s: float) -> None:
        sent_s = time.monotonic()
        try:
            reply = pb.InferResponse.FromString(await client.call(body, timeout_s=timeout_s))
        except Exception as error:  # the whole call refused or failed: every row alike
            self.count(f"call {getattr(error, 'code', type(error).__name__)}", rows)
            return
        latency_s = time.monotonic() - sent_s
        for status in reply.slices:
            self.count("OK" if status.code == 0 else f"slice {status.code}", 1)
        ok = sum(status.code == 0 for status in reply.slices)
        if ok:
            self.ok_rows += ok
            self.good_rows += ok if latency_s <= self.slo_s else 0
            self.latencies.append(latency_s)


async def flood(
    client: MultiplexClient, body: bytes, rows: int, rate: float, settings: argparse.Namespace
) -> tuple[Phase, int, float]:
    """Calls `rate` a second for `settings.duration_s`; (what they came to, calls sent, seconds
    sent)."""
    phase: Phase = Phase(settings.slo_s)
    calls: list[asyncio.Future[None]] = []
    duration_s, timeout_s = settings.duration_s, settings.timeout_s
    started_s = time.monotonic()
    while (elapsed_s := time.monotonic() - started_s) < duration_s:
        while len(calls) < int(elapsed_s * rate) + 1:
            calls.append(asyncio.ensure_future(phase.call(client, body, rows, timeout_s)))
        await asyncio.sleep(max(0.0, len(calls) / rate - (time.monotonic() - started_s)))
    sent_s = time.monotonic() - started_s
    await asyncio.gather(*calls)
    return phase, len(calls), sent_s


async def measure(
    address: str, pid: int, rates: list[float], settings: argparse.Namespace
) -> list[dict[str, Any]]:
    channel = grpc.aio.insecure_channel(address, options=(*CHANNEL_OPTIONS, *OWN_CONNECTION))
    client = MultiplexClient(channel, "worker")
    results = []
    try:
        models = await pb_grpc.WorkerServiceStub(channel).ListModels(pb.ListWorkerModelsRequest())
        fingerprint = next(v.fingerprint for v in models.versions if v.model_name == "minilm")
        slices = settings.slices
        body = bundle_bytes(fingerprint, slices, seed=1)
        for rate in rates:
            before_cpu_s, before_s = loopback.cpu_s(pid), time.monotonic()
            phase, calls, sent_s = await flood(client, body, slices, rate, settings)
            cpu_s = loopback.cpu_s(pid) - before_cpu_s
            latencies = sorted(phase.latencies)
            p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else None
            result = {
                "bundles_per_s": rate,
                "rows_offered_per_s": round(calls * slices / sent_s),
                "rows_ok_per_s": round(phase.ok_rows / sent_s),
                "rows_within_slo_per_s": round(phase.good_rows / sent_s),
                "accepted_p99_ms": None if p99 is None else round(p99 * 1e3),
                "rows_by_outcome": phase.codes,
                "worker_cpu_share": round(cpu_s / (time.monotonic() - before_s), 2),
            }
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        await client.close()
        await channel.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="140,560,140", help="bundles a second, one per phase")
    parser.add_argument("--slices", type=int, default=64, help="one-row slices a bundle")
    parser.add_argument("--duration-s", type=float, default=8.0, help="per rate")
    parser.add_argument("--timeout-s", type=float, default=1.0, help="each call's deadline")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if not rates or min(rates) <= 0 or args.slices < 1:
        parser.error("--rates must be positive bundles a second, --slices at least 1")
    root = Path(tempfile.mkdtemp(prefix="worker-flood-"))
    write_minilm_repository(root / "repo")
    (version,) = load_repository(root / "repo")
    args.slo_s = version.config.slo_s
    stack = start_stack(root / "repo", root / "stack", extra_worker_args=tuple(worker_args()))
    try:
        (worker,) = stack.ready["workers"]
        address = f"127.0.0.1:{worker['grpc_port']}"
        results = asyncio.run(measure(address, worker["pid"], rates, args))
    finally:
        stack.stop()
    report = {"slices": args.slices, "timeout_s": args.timeout_s, "slo_s": args.slo_s}
    write_report(args.output, {**report, "rates": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
