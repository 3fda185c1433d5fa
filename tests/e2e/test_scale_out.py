"""Every tier scaled out at once (the data-path issue's e2e): 64 concurrent one-text callers
through a gateway of two processes (`--processes 2`, one port by SO_REUSEPORT) balancing over
two routers, to one minilm worker with two fronts (`--front-processes 2`: its engine and two
gRPC front processes on its port). Each answer equals the row computed alone, the calls
travelled in bundles, both gateway processes and both routers carried them, and the worker's
fronts relayed the routers' streams to its engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from services.common import metric_names as names
from services.common.tensors import tensor_from_pb
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.metrics import samples, scrape, total
from tests.support.models import write_small_minilm_repository
from tests.support.processes import ServiceProcess, health_status
from tests.support.stack import Stack, start_stack
from tests.support.texts import sentences
from tests.support.tiers import command_line, start_tier, with_flags
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e

CALLERS = 64
#: Channels the callers share: the kernel spreads connections, not calls, over the gateway's
#: processes, so 16 connections leave both processes idle with odds of 2 in 65,536.
CHANNELS = 16
CALLS_EACH = 3


@pytest.fixture(scope="module")
def scaled(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Stack, ServiceProcess, list[ServiceProcess]]]:
    """The stack (its router A), a router B beside it, and a gateway group of two processes
    over both routers; the tiers started here stop before the stack."""
    tmp_path = tmp_path_factory.mktemp("scale-out")
    repository = write_small_minilm_repository(tmp_path / "repo")
    stack = start_stack(
        tmp_path, model_repository=repository, extra_worker_args=("--front-processes", "2")
    )
    started: list[ServiceProcess] = []
    try:
        router_argv = command_line(stack.router.pid)
        free = {"grpc_port": "0", "metrics_port": "0"}
        router_b = start_tier(tmp_path, "router-b", with_flags(router_argv, **free))
        started.append(router_b)
        both = f"127.0.0.1:{stack.router.grpc_port},127.0.0.1:{router_b.grpc_port}"
        # A ready bundle may wait up to 1 s for an answer, not the default's 20 ms: a key whose
        # worker takes longer than the hold on its bundles never holds (the bundle clock), and
        # beside the parallel suite this minilm's bundles took longer, so that every call
        # could leave alone (CI: 192 bundles of 192 calls). Six busy loops beside this test
        # (2 cores): 165-168 bundles of 192 at the default hold, 46 and 89 at 1 s.
        gateway_argv = [
            *with_flags(command_line(stack.gateway.pid), **free, router_address=both),
            "--processes",
            "2",
            "--bundle-max-hold-s",
            "1.0",
        ]
        gateway = start_tier(tmp_path, "gateway-group", gateway_argv)
        started.append(gateway)
        yield stack, gateway, [stack.router, router_b]
    finally:
        for tier in reversed(started):
            tier.terminate(timeout_s=60.0)
        assert stack.stop() == 0, stack.stop_report()


def _predict(text: str) -> api.PredictRequest:
    return api.PredictRequest(model_name="minilm", inputs=[api.PredictInput(text=text)])


def _row(response: api.PredictResponse) -> np.ndarray:
    return tensor_from_pb(response.outputs[0]).reshape(-1)


@pytest.mark.timeout(600)
async def test_64_callers_through_two_gateway_processes_and_two_routers(
    scaled: tuple[Stack, ServiceProcess, list[ServiceProcess]],
) -> None:
    stack, gateway, routers = scaled

    async def gateway_serving() -> bool:
        return await health_status(gateway.address) == health_pb2.HealthCheckResponse.SERVING

    await eventually(gateway_serving, timeout_s=60.0)
    texts = sentences(CALLERS * CALLS_EACH, max_words=24, seed=11)
    # A subchannel pool of its own per channel: otherwise grpc shares one connection between
    # channels to the same address, and the kernel has one connection to place.
    own_pool = (("grpc.use_local_subchannel_pool", 1),)
    channels = [
        grpc.aio.insecure_channel(gateway.address, options=own_pool) for _ in range(CHANNELS)
    ]
    try:
        stubs = [api_grpc.InferenceServiceStub(channel) for channel in channels]
        # Each text alone first: one call at a time, so each is a bundle of one.
        alone = [_row(await stubs[0].Predict(_predict(t), timeout=60.0)) for t in texts]
        before = scrape(gateway.metrics_port)

        async def caller(index: int) -> list[np.ndarray]:
            stub = stubs[index % CHANNELS]
            mine = texts[index * CALLS_EACH : (index + 1) * CALLS_EACH]
            return [_row(await stub.Predict(_predict(t), timeout=60.0)) for t in mine]

        answers = await asyncio.gather(*(caller(i) for i in range(CALLERS)))
    finally:
        for channel in channels:
            await channel.close()

    together = [row for rows in answers for row in rows]
    assert len(together) == len(alone) == CALLERS * CALLS_EACH
    for row, reference in zip(together, alone, strict=True):
        assert row.shape == reference.shape == (384,)
        cosine = float(row @ reference / (np.linalg.norm(row) * np.linalg.norm(reference)))
        assert cosine >= 0.999, cosine
    after = scrape(gateway.metrics_port)
    # Bundles: every call one slice of one, and under 64 callers some carried several.
    slices = total(after, f"{names.GATEWAY_BUNDLE_SLICES}_sum") - total(
        before, f"{names.GATEWAY_BUNDLE_SLICES}_sum"
    )
    bundles = total(after, f"{names.GATEWAY_BUNDLE_SLICES}_count") - total(
        before, f"{names.GATEWAY_BUNDLE_SLICES}_count"
    )
    assert slices == CALLERS * CALLS_EACH, (slices, bundles)
    assert 0 < bundles < slices, (slices, bundles)
    # Both gateway processes served (the group's series carry gateway_process).
    served = {
        labels["gateway_process"]
        for labels, value in samples(after, names.GATEWAY_REQUESTS_TOTAL)
        if value > 0 and "gateway_process" in labels
    }
    assert served == {"0", "1"}, served
    # Both routers routed.
    for router in routers:
        assert total(scrape(router.metrics_port), names.ROUTER_ROUTED_TOTAL) > 0, router
    # Through the worker's fronts: at least as many streams as routers.
    (worker,) = stack.workers
    relayed = scrape(worker.metrics_port)
    assert total(relayed, names.WORKER_FRONT_STREAMS_TOTAL) >= len(routers), relayed
