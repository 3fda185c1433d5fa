"""A bundle that no worker can take whole in time, through a real router server and two real
workers: the router routes it in parts (services.router.bundle_split), each worker runs its
part's rows, and the caller gets one answer with every slice's status and rows in order.

The router here is the router's own forwarding and gRPC wiring (`Forwarder`,
`add_worker_service`) over a route table that the test loads itself, as the registry sync
would, with a cost per row the test chooses: so which bundle fits where is the test's to say,
whatever the workers' measured costs on a shared machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.errors import UpstreamError
from services.common.lifecycle import new_server
from services.common.multiplex import MultiplexClient
from services.common.registry_schema import ModelRecord, WorkerRecord, route_metadata
from services.common.tensors import tensor_from_pb, tensor_to_pb
from services.pb.inference.v1 import worker_pb2 as pb
from services.router.catalog import Catalog
from services.router.drain import DrainGate
from services.router.forwarder import Forwarder
from services.router.metrics import RouterMetrics
from services.router.routing import RetryBudget, Route, RouteTable
from services.router.routing_config import RoutingConfig
from services.router.server import add_worker_service
from tests.support.in_process import Fabric, metric, running_fabric
from tests.support.models import (
    STALL,
    affine_reference,
    release_stall,
    write_affine_model,
    write_stalling_model,
)
from tests.support.records import model_record
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

#: The cost of a row the route table believes, and the rows it holds reserved on each worker
#: for each model: a worker is predicted to finish n more rows of a model in
#: (RESERVED_ROWS + n) * PER_ROW_S seconds.
PER_ROW_S = 1.0
RESERVED_ROWS = 10
#: The bundles' time: a worker takes 20 more rows (30 s predicted) with ten seconds to spare,
#: and not 40 (50 s), so no delay a loaded machine makes changes what fits. (The predictions
#: are the route table's; the rows themselves run in milliseconds.)
TIMEOUT_S = 40.0
OK = grpc.StatusCode.OK.value[0]


@dataclass
class SplittingRouter:
    address: str
    metrics: RouterMetrics
    table: RouteTable

    def reserved_rows(self) -> list[int]:
        """Rows reserved on each worker, both models (2 * RESERVED_ROWS when every call has
        released its own)."""
        return [self.table.inflight_rows(w) for w in ("w0", "w1")]

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics.registry, name, **labels)


@pytest.fixture
async def fabric(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fabric]:
    gate = tmp_path / "gate"
    write_affine_model(tmp_path / "repo", slo_p99_ms=30_000)
    write_stalling_model(tmp_path / "repo", gate)
    try:
        async with running_fabric(
            tmp_path / "repo", redis_server, num_workers=2, with_gateway=False
        ) as fabric:
            yield fabric
    finally:
        release_stall(gate)


@pytest.fixture
async def router(fabric: Fabric) -> AsyncIterator[SplittingRouter]:
    table = RouteTable(RoutingConfig(explore_share=0.0), random.Random(0))
    records = [
        WorkerRecord(
            w.config.worker_id,
            f"127.0.0.1:{w.port}",
            False,
            0,
            (_record("affine"), _record("stall")),
        )
        for w in fabric.workers
    ]
    now_s = time.monotonic()  # the router's clock
    table.update([(r, now_s) for r in records], now_s)
    for record in records:  # never released: the workers stay busy in the table's eyes
        others = frozenset(r.worker_id for r in records) - {record.worker_id}
        for model in ("affine", "stall"):
            held = table.route(model, "1", RESERVED_ROWS, 100.0, now_s, others)
            assert isinstance(held, Route) and held.worker_id == record.worker_id
    metrics = RouterMetrics(CollectorRegistry())
    forwarder = Forwarder(table, RetryBudget(), metrics, default_timeout_s=TIMEOUT_S, max_retries=1)
    server = new_server(is_internal=True)
    add_worker_service(server, forwarder, Catalog(table), DrainGate())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield SplittingRouter(f"127.0.0.1:{port}", metrics, table)
    finally:
        await server.stop(grace=None)
        await forwarder.close()


def _record(name: str) -> ModelRecord:
    return model_record(
        name=name,
        fingerprint="",
        tokenizer_fingerprint="",
        kind="torchscript",
        max_batch_size=64,
        slo_p99_ms=30_000,
        per_row_s=PER_ROW_S,
        min_batch_s=PER_ROW_S,
    )


def bundle_of(
    rows_per_slice: list[int], model: str = "affine"
) -> tuple[pb.InferRequest, np.ndarray]:
    """A bundle of rows for `model` (one slice per entry, of that many rows), and its rows."""
    rows = np.random.default_rng(len(rows_per_slice)).normal(size=(sum(rows_per_slice), 4))
    stacked = rows.astype(np.float32)
    request = pb.InferRequest(
        model_name=model,
        model_version="1",
        slices=[pb.Slice(rows=n, request_id=f"caller-{i}") for i, n in enumerate(rows_per_slice)],
        packed=pb.PackedRows(tensor=tensor_to_pb(stacked)),
    )
    return request, stacked


async def call(router: SplittingRouter, request: pb.InferRequest) -> pb.InferResponse:
    num_rows = sum(s.rows for s in request.slices)
    model = request.model_name
    async with grpc.aio.insecure_channel(router.address) as channel:
        client = MultiplexClient(channel, "router")
        try:
            body = await client.call(
                request.SerializeToString(),
                metadata=route_metadata(model, "1", num_rows),
                timeout_s=TIMEOUT_S,
            )
        finally:
            await client.close()
    return pb.InferResponse.FromString(body)


def expected(rows: np.ndarray) -> np.ndarray:
    return affine_reference(torch.from_numpy(rows)).numpy()


async def test_a_bundle_no_worker_takes_whole_is_served_in_parts_by_two_workers(
    fabric: Fabric, router: SplittingRouter
) -> None:
    # 40 rows: 50 s on either worker; 20 rows: 30 s, on each.
    request, rows = bundle_of([10, 10, 10, 10])
    response = await call(router, request)
    assert [s.code for s in response.slices] == [OK] * 4
    np.testing.assert_allclose(
        tensor_from_pb(response.packed_outputs), expected(rows), rtol=1e-5, atol=1e-6
    )
    assert router.metric(names.ROUTER_SPLIT_BUNDLES_TOTAL, model="affine") == 1
    for worker in fabric.workers:
        assert router.metric(names.ROUTER_ROUTED_TOTAL, worker=worker.config.worker_id) == 1
        assert metric(worker.metrics.registry, names.WORKER_ROWS_TOTAL, model="affine") == 20
    assert router.reserved_rows() == [2 * RESERVED_ROWS] * 2


async def test_a_slice_no_worker_can_take_is_refused_alone_while_its_mates_are_served(
    fabric: Fabric, router: SplittingRouter
) -> None:
    # 50 rows do not fit; the first three slices (15 rows, 25 s) do, on w0; the last (35 rows,
    # 45 s on w1) nowhere.
    request, rows = bundle_of([5, 5, 5, 35])
    response = await call(router, request)
    codes = [s.code for s in response.slices]
    assert codes == [OK, OK, OK, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    assert "retry-after-ms" in response.slices[3].trailers
    np.testing.assert_allclose(
        tensor_from_pb(response.packed_outputs), expected(rows[:15]), rtol=1e-5, atol=1e-6
    )
    assert router.metric(names.ROUTER_REJECTED_TOTAL, reason="deadline") == 1
    assert router.reserved_rows() == [2 * RESERVED_ROWS] * 2
    served = [
        metric(w.metrics.registry, names.WORKER_ROWS_TOTAL, model="affine") for w in fabric.workers
    ]
    assert sorted(served) == [0, 15]
    assert router.reserved_rows() == [2 * RESERVED_ROWS] * 2


async def test_a_slice_whose_deadline_passed_on_the_way_is_answered_deadline_exceeded(
    fabric: Fabric, router: SplittingRouter
) -> None:
    """The bundle of the test above, its last slice's caller's deadline past before the bundle
    left the gateway (`earlier_us` beyond the call's time left): that slice is answered
    DEADLINE_EXCEEDED, as a worker sent it would answer it, not refused as overload with a
    retry hint (as it was), and counted as no refusal of the router's."""
    request, rows = bundle_of([5, 5, 5, 35])
    request.slices[3].earlier_us = round((TIMEOUT_S + 5.0) * 1e6)
    response = await call(router, request)
    codes = [s.code for s in response.slices]
    assert codes == [OK, OK, OK, grpc.StatusCode.DEADLINE_EXCEEDED.value[0]]
    assert "retry-after-ms" not in response.slices[3].trailers
    np.testing.assert_allclose(
        tensor_from_pb(response.packed_outputs), expected(rows[:15]), rtol=1e-5, atol=1e-6
    )
    assert router.metric(names.ROUTER_REJECTED_TOTAL, reason="deadline") == 0
    assert router.reserved_rows() == [2 * RESERVED_ROWS] * 2


async def test_a_bundle_nothing_of_which_fits_is_refused_whole_as_before(
    router: SplittingRouter,
) -> None:
    request, _ = bundle_of([40, 40])
    with pytest.raises(UpstreamError) as raised:
        await call(router, request)
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert router.metric(names.ROUTER_SPLIT_BUNDLES_TOTAL, model="affine") == 0
    assert router.metric(names.ROUTER_REJECTED_TOTAL, reason="deadline") == 1
    assert router.reserved_rows() == [2 * RESERVED_ROWS] * 2


async def test_a_caller_gone_while_its_split_bundle_runs_leaves_no_rows_queued_or_reserved(
    fabric: Fabric, router: SplittingRouter, tmp_path: Path
) -> None:
    """The first part's first row stalls w0's executor; the caller goes away: the router's
    part calls end, their reservations are released, and w0 withdraws the part's queued rows
    unrun (the stalled row itself is no longer counted in flight)."""
    request, _ = bundle_of([10, 10, 10, 10], model="stall")
    request.packed.tensor.raw_data = (
        np.full(4, STALL, dtype=np.float32).tobytes() + request.packed.tensor.raw_data[16:]
    )
    w0 = fabric.workers[0]
    batching = w0.batching
    assert batching is not None
    caller = asyncio.ensure_future(call(router, request))
    try:
        await eventually(lambda: batching.is_executing, interval_s=0.01, message="stalled")
        await eventually(
            lambda: (
                metric(w0.metrics.registry, names.WORKER_ROWS_TOTAL, model="stall") == 0
                and batching.num_in_flight == 20
            ),
            interval_s=0.01,
            message="the first part's rows did not queue behind the stalled one",
        )
        assert router.reserved_rows()[0] == 2 * RESERVED_ROWS + 20
        caller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await caller
        await eventually(
            lambda: router.reserved_rows() == [2 * RESERVED_ROWS] * 2,
            interval_s=0.01,
            message="a part's reservation outlived its caller",
        )
        await eventually(
            lambda: batching.num_in_flight == 0,
            interval_s=0.01,
            message="w0 kept the gone caller's queued rows",
        )
        # The stalled row runs on (an executor cannot be interrupted); the other 19 never will.
        dropped = metric(
            w0.metrics.registry, names.WORKER_DROPPED_TOTAL, model="stall", reason="cancelled"
        )
        assert dropped == 19
    finally:
        release_stall(tmp_path / "gate")


async def test_a_worker_that_no_longer_serves_the_model_is_left_for_one_that_does(
    fabric: Fabric, router: SplittingRouter
) -> None:
    """The route table still lists affine on w0 (a snapshot is up to a heartbeat old), but w0
    has stopped serving it, as an unload does first: its NOT_FOUND sends the bundle on to w1,
    as an unavailable worker's would, instead of answering the caller that the model does not
    exist while another worker serves it. With none left to try, the answer is UNAVAILABLE
    with the last worker's words: the version was served, and may be again (before, NOT_FOUND, which
    clients take as permanent; review finding). Not marked not started: other routers' snapshots
    are as stale, and a gateway would resend it to each."""
    fabric.workers[0].models.remove("affine", "1")
    for size in range(1, 7):
        request, rows = bundle_of([1] * size)
        response = await call(router, request)
        assert [s.code for s in response.slices] == [OK] * size
        np.testing.assert_allclose(
            tensor_from_pb(response.packed_outputs), expected(rows), rtol=1e-5, atol=1e-6
        )
    assert router.metric(names.ROUTER_ROUTED_TOTAL, worker="w0") >= 1
    assert metric(fabric.workers[1].metrics.registry, names.WORKER_ROWS_TOTAL, model="affine") == 21
    # With no other worker to try (w1 has stopped serving it too, the snapshot not knowing it
    # yet; an ejected w1 would still be tried, the last one routable), the last worker's words
    # are the answer, not the router's 'no ready worker' for the workers it has tried.
    fabric.workers[1].models.remove("affine", "1")
    with pytest.raises(UpstreamError) as raised:
        await call(router, bundle_of([1])[0])
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE and not raised.value.is_not_started
    assert "not" in str(raised.value) and "no other worker serves it now" in str(raised.value)


async def test_a_worker_that_no_longer_serves_the_model_beside_a_busy_one_is_overload(
    fabric: Fabric, router: SplittingRouter
) -> None:
    """w0 has stopped serving affine (its NOT_FOUND sends the bundle on), and w1, which still
    serves it, is predicted past the bundle's deadline: the caller is refused as overload,
    with a hint, not told that the model does not exist (before, w0's NOT_FOUND stood)."""
    fabric.workers[0].models.remove("affine", "1")
    now_s = time.monotonic()
    busy = router.table.route("affine", "1", 20, 100.0, now_s, frozenset({"w0"}))
    assert isinstance(busy, Route) and busy.worker_id == "w1"  # w1: (30 + n) s for n rows
    # 15 rows: 25 s on w0, which is tried first and answers NOT_FOUND; 45 s on w1.
    with pytest.raises(UpstreamError) as raised:
        await call(router, bundle_of([5, 5, 5])[0])
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value
    assert raised.value.retry_after_s is not None and raised.value.retry_after_s > 0
    assert router.metric(names.ROUTER_ROUTED_TOTAL, worker="w0") == 1
    router.table.release(busy.reservation_id)
    assert router.reserved_rows() == [2 * RESERVED_ROWS] * 2
