"""CPU per call of the gateway's own Predict path, timed in one process without gRPC.

Under 64 closed-loop callers the gateway spends about 1.5-2 bare echo calls of CPU a request,
all of its excess over the echo on its event loop's thread (docs/benchmarks.md, "Each tier's
CPU by thread"). Cutting the served path short in a scratch copy of the stand-in stack showed
where (docs/benchmarks.md, "Where the gateway's call goes"): grpc.aio with the interceptors
and the door is most of it, and the Predict path's own Python the rest, dearer in the
process than timed alone. This times that Python alone, as the gateway runs it, so that a
change to it can be measured to a few percent where the whole stack's spread is 10-30%:
`InferenceServicer.Predict` for the identity model's one-row calls by `--callers` concurrent
callers (uvloop, authentication off: the `local` tenant), the router's side faked, in one of
three modes:

- `bundled`: the real coalescer; each bundle it sends is decoded and answered at once with its
  own rows, packed as a worker answers, without a network (that faked worker's protobuf and
  numpy, once a bundle, count in the figure too);
- `answered`: the coalescer replaced by an answer at once: the path up to it and back;
- `kserve`: as `bundled`, through KServe's `ModelInfer` (a stock Triton client's unary call:
  the request a `ModelInferRequest` of one `[1, 4]` FP32 row in `raw_input_contents`, the
  answer a `ModelInferResponse`) instead of `Predict`.

It prints, per mode, the process's CPU per call in each round and their median.

    python -m bench.gateway_path [--rounds 7] [--calls 20000] [--callers 64] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from prometheus_client import CollectorRegistry

from bench.fabric.stack import write_identity_model
from bench.fabric.stream_target import identity_infer
from bench.fabric.targets import identity_request
from services.common import event_loop
from services.common.bundles import SliceCancels
from services.common.model_repository import load_repository
from services.common.tensors import tensor_from_pb, tensor_to_pb
from services.gateway.admission import TenantAdmission
from services.gateway.auth import LOCAL_PRINCIPAL
from services.gateway.bundle_parts import Answered, BundleKey
from services.gateway.catalog import ModelCatalog
from services.gateway.kserve_api import KServeServicer
from services.gateway.metrics import GatewayMetrics
from services.gateway.predictor import Predictor
from services.gateway.public_api import InferenceServicer
from services.gateway.tenants import TenantLabels
from services.gateway.throttle import ThrottleConfig
from services.pb.inference.v1 import worker_pb2 as pb

MODES = ("bundled", "answered", "kserve")


class _Context:
    """What Predict asks of its grpc context: the caller's time left."""

    def time_remaining(self) -> float:
        return 5.0


async def _answer_bundle(
    request: bytes,
    metadata: Sequence[tuple[str, str]],
    deadline_s: float,
    cancels: SliceCancels,
    *,
    after_s: float = 0.0,
) -> bytes:
    """A worker's answer to a bundle of tensor rows, `after_s` later: each row back, every
    slice OK."""
    if after_s > 0:
        await asyncio.sleep(after_s)
    bundle = pb.InferRequest.FromString(request)
    response = pb.InferResponse(slices=[pb.SliceStatus() for _ in bundle.slices])
    response.packed_outputs.CopyFrom(tensor_to_pb(tensor_from_pb(bundle.packed.tensor)))
    return response.SerializeToString()


async def _answer_call(key: BundleKey, rows: Sequence[Any], piece: pb.Slice, **_: Any) -> Answered:
    return Answered(list(rows), rows)


class ServedMethod(NamedTuple):
    """A gateway method as the benchmark calls it."""

    #: The method: a request and a grpc context (`_Context` has what Predict and ModelInfer
    #: read of one).
    serve: Callable[[Any, Any], Awaitable[Any]]
    parse: Callable[[bytes], Any]
    #: One request's bytes (`request_of`).
    body: bytes


def request_of(mode: str) -> Any:
    """One request of `mode`'s method, of one identity row: KServe's ModelInferRequest for
    `kserve`, else a v1 PredictRequest; its deadline the call's."""
    if mode == "kserve":
        return identity_infer("", "identity", timeout_s=None)  # the deadline the call's
    return identity_request()


async def gateway_method(mode: str, root: Path, *, hop_s: float = 0.0) -> ServedMethod:
    """The method a mode times over the identity model written in `root`, each bundle
    answered `hop_s` after it is sent (the router's and worker's time, during which the next
    bundle forms as in the stack; 0: at once, as the callers of one process need)."""
    write_identity_model(root)
    catalog = ModelCatalog(load_repository(root))
    catalog.update_served([pb.ModelVersionInfo(model_name="identity", model_version="1",
                                               is_ready=True)])  # fmt: skip
    metrics = GatewayMetrics(CollectorRegistry())
    tenants = {LOCAL_PRINCIPAL.tenant: LOCAL_PRINCIPAL.policy}
    admission = TenantAdmission(metrics, TenantLabels(tenants))
    predictor = Predictor(
        catalog,
        grpc.aio.insecure_channel("127.0.0.1:1"),  # never called: the router's side is faked
        metrics,
        max_inputs=64,
        admission=admission,
        throttle=ThrottleConfig(),
        pickup_delay_s=lambda: 0.0,
    )
    if mode == "answered":
        predictor._bundles.call = _answer_call  # type: ignore[method-assign]
    else:
        predictor._bundles._send = functools.partial(_answer_bundle, after_s=hop_s)  # faked
    request = request_of(mode)
    if mode == "kserve":
        serve = KServeServicer(predictor, metrics, max_inputs=64).ModelInfer
    else:
        serve = InferenceServicer(predictor, metrics).Predict
    return ServedMethod(serve, type(request).FromString, request.SerializeToString())


async def _calls(method: ServedMethod, calls: int, callers: int) -> None:
    serve, parse, body = method
    context = _Context()

    async def caller(count: int) -> None:
        for _ in range(count):
            answer = await serve(parse(body), context)
            answer.SerializeToString()

    await asyncio.gather(*(caller(calls // callers) for _ in range(callers)))


async def measure(
    mode: str, rounds: int, calls: int, callers: int, profile: bool
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gateway-path-") as state:
        method = await gateway_method(mode, Path(state))
        await _calls(method, min(calls, 2_000), callers)  # warm: first bundles, caches
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            await _calls(method, calls, callers)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        us_per_call = []
        for _ in range(rounds):
            started = time.process_time()
            await _calls(method, calls, callers)
            us_per_call.append(1e6 * (time.process_time() - started) / (calls // callers * callers))
    return {
        "mode": mode,
        "callers": callers,
        "us_per_call": [round(us, 1) for us in us_per_call],
        "median_us_per_call": round(statistics.median(us_per_call), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top 30 first")
    parser.add_argument("modes", nargs="*", help=f"of {', '.join(MODES)} (default: both)")
    args = parser.parse_args()
    unknown = [mode for mode in args.modes if mode not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    if not 1 <= args.callers <= args.calls:
        parser.error("--callers must be at least 1 and at most --calls")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for mode in args.modes or MODES:
        result = event_loop.run(
            measure(mode, args.rounds, args.calls, args.callers, args.profile), "uvloop"
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
