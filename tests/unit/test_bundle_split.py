"""services.router.bundle_split: a bundle no worker can take whole, cut into parts along its
slices, each part's request, the relay of cancelled slices, and the merged answer."""

from __future__ import annotations

import logging
import random

import grpc
import numpy as np
import pytest

from services.common.bundles import SliceCancels, pack_token_rows, unpack_token_rows
from services.common.errors import Overloaded, UpstreamError
from services.common.registry_schema import WorkerRecord
from services.common.tensors import tensor_from_pb, tensor_to_pb
from services.pb.inference.v1 import worker_pb2 as pb
from services.router.bundle_split import (
    MAX_SPLIT_DEPTH,
    Bundle,
    Decide,
    Part,
    merge,
    plan,
    relay_cancels,
)
from services.router.routing import Reject, RejectReason, Route, RouteTable
from services.router.routing_config import RoutingConfig
from tests.support.records import model_record

pytestmark = pytest.mark.unit

OK = grpc.StatusCode.OK.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def text_bundle(rows_per_slice: list[int], *, tenants: list[str] | None = None) -> pb.InferRequest:
    """Slice i has rows of i*100 + row tokens, each row as long as its index in the slice + 1."""
    request = pb.InferRequest(model_name="minilm", model_version="1", fingerprint="fp")
    rows = []
    for i, num_rows in enumerate(rows_per_slice):
        tenant = tenants[i] if tenants else ""
        request.slices.add(rows=num_rows, earlier_us=1_000 * i, tenant=tenant, request_id=f"r{i}")
        rows += [np.full(r + 1, i * 100 + r, dtype=np.int32) for r in range(num_rows)]
    request.packed.token_ids, request.packed.row_lengths = pack_token_rows(rows)
    return request


def tensor_bundle(rows_per_slice: list[int]) -> pb.InferRequest:
    request = pb.InferRequest(model_name="affine", model_version="1")
    for num_rows in rows_per_slice:
        request.slices.add(rows=num_rows)
    stacked = np.arange(sum(rows_per_slice) * 4, dtype=np.float32).reshape(-1, 4)
    request.packed.tensor.CopyFrom(tensor_to_pb(stacked))
    return request


def parsed(request: pb.InferRequest) -> Bundle:
    bundle = Bundle.parse(request.SerializeToString())
    assert bundle is not None
    return bundle


def busy_table(*, reserved_rows: int = 100) -> RouteTable:
    """Two workers of minilm@1 at 10 ms a row, each with `reserved_rows` rows this router sent."""
    table = RouteTable(RoutingConfig(explore_share=0.0), random.Random(0))
    model = model_record(max_batch_size=256, slo_p99_ms=10_000)
    workers = [WorkerRecord(w, f"{w}:1", False, 0, (model,)) for w in ("w1", "w2")]
    table.update([(w, 0.0) for w in workers], 0.0)
    for worker in workers:
        others = frozenset({"w1", "w2"} - {worker.worker_id})
        route = table.route("minilm", "1", reserved_rows, 100.0, 0.0, others)
        assert isinstance(route, Route) and route.worker_id == worker.worker_id
    return table


def decide_on(table: RouteTable, remaining_s: float) -> Decide:
    def decide(part: Part) -> Route | Reject:
        return table.route("minilm", "1", part.rows, remaining_s - part.earlier_us / 1e6, 0.0)

    return decide


def test_a_bundle_no_worker_takes_whole_goes_out_in_halves_to_two_workers() -> None:
    table = busy_table()
    bundle = parsed(text_bundle([10, 10, 10, 10]))
    # 1.25 s of budget (less the 5 ms margin): 100 queued + 40 rows is 1.4 s, + 20 rows 1.2 s.
    assert isinstance(table.route("minilm", "1", 40, 1.255, 0.0), Reject)
    decided = plan(bundle, decide_on(table, 1.255))
    assert [(p.first, p.stop, p.rows) for p, _ in decided] == [(0, 2, 20), (2, 4, 20)]
    assert [d.worker_id for _, d in decided if isinstance(d, Route)] == ["w1", "w2"]


def test_a_slice_no_worker_can_take_is_refused_alone_and_its_mates_are_routed() -> None:
    table = busy_table()
    bundle = parsed(text_bundle([10, 10, 10, 30]))
    decided = plan(bundle, decide_on(table, 1.255))
    assert [(p.first, p.stop) for p, _ in decided] == [(0, 1), (1, 3), (3, 4)]
    first, second, last = (d for _, d in decided)
    assert isinstance(first, Route) and first.worker_id == "w1"
    assert isinstance(second, Route) and second.worker_id == "w2"
    assert isinstance(last, Reject) and last.reason is RejectReason.DEADLINE


def test_splitting_stops_at_the_depth_bound_and_at_refusals_splitting_cannot_mend() -> None:
    bundle = parsed(text_bundle([1] * 64))
    asked: list[Part] = []

    def never(part: Part) -> Route | Reject:
        asked.append(part)
        return Reject(RejectReason.DEADLINE, 0.1, "late")

    decided = plan(bundle, never)
    assert len(decided) == 2**MAX_SPLIT_DEPTH
    assert [p.rows for p, _ in decided] == [64 // 2**MAX_SPLIT_DEPTH] * 2**MAX_SPLIT_DEPTH
    assert len(asked) == 2 * (2**MAX_SPLIT_DEPTH - 1)

    def no_worker(part: Part) -> Route | Reject:
        return Reject(RejectReason.NO_WORKER, 1.0, "none")

    assert len(plan(bundle, no_worker)) == 2


def test_a_part_carries_its_slices_rows_and_deadlines_from_its_own() -> None:
    request = text_bundle([2, 1, 3, 1], tenants=["a", "a", "b", "b"])
    bundle = parsed(request)
    whole_rows = unpack_token_rows(request.packed.token_ids, request.packed.row_lengths, 7)
    part = bundle.part(1, 3)
    assert (part.rows, part.earlier_us, part.tenant) == (4, 1_000, "")
    assert bundle.part(2, 4).tenant == "b"
    sent = pb.InferRequest.FromString(bundle.body(part))
    assert (sent.model_name, sent.model_version, sent.fingerprint) == ("minilm", "1", "fp")
    assert [(s.rows, s.earlier_us, s.request_id) for s in sent.slices] == [
        (1, 0, "r1"),
        (3, 1_000, "r2"),
    ]
    rows = unpack_token_rows(sent.packed.token_ids, sent.packed.row_lengths, 4)
    for got, want in zip(rows, whole_rows[2:6], strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_tensor_part_carries_its_rows() -> None:
    request = tensor_bundle([1, 2, 2])
    bundle = parsed(request)
    sent = pb.InferRequest.FromString(bundle.body(bundle.part(1, 3)))
    np.testing.assert_array_equal(
        tensor_from_pb(sent.packed.tensor), tensor_from_pb(request.packed.tensor)[1:5]
    )


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xff not a protobuf",
        pb.InferRequest(
            slices=[pb.Slice(rows=1), pb.Slice(rows=1)],
            packed=pb.PackedRows(
                token_ids=pack_token_rows([[1], [2]])[0],
                row_lengths=pack_token_rows([[1], [2]])[1],
                tensor=tensor_to_pb(np.zeros((2, 4), dtype=np.float32)),
            ),
        ).SerializeToString(),  # two columns
        text_bundle([3]).SerializeToString(),  # one slice: nothing to split
        pb.InferRequest(
            slices=[pb.Slice(rows=1), pb.Slice(rows=1)],
            packed=pb.PackedRows(token_ids=b"\0" * 12, row_lengths=pack_token_rows([[1], [2]])[1]),
        ).SerializeToString(),  # lengths add up to 2 ids, 3 sent
        pb.InferRequest(
            slices=[pb.Slice(rows=2), pb.Slice(rows=1)],
            packed=pb.PackedRows(tensor=tensor_to_pb(np.zeros((2, 4), dtype=np.float32))),
        ).SerializeToString(),  # 3 rows claimed, 2 stacked
        pb.InferRequest(
            slices=[pb.Slice(rows=0), pb.Slice(rows=1)],
            packed=pb.PackedRows(tensor=tensor_to_pb(np.zeros((1, 4), dtype=np.float32))),
        ).SerializeToString(),
    ],
)
def test_what_is_no_well_formed_bundle_is_not_split(body: bytes) -> None:
    assert Bundle.parse(body) is None


def test_a_cancelled_slice_reaches_the_part_that_carries_it_by_its_index_there() -> None:
    whole = SliceCancels()
    whole.cancel(0)
    parts = [Part(0, 2, (1, 1), 0, "", 1.0), Part(2, 5, (1, 1, 1), 0, "", 1.0)]
    cancels, stop = relay_cancels(whole, parts)
    whole.cancel(3)
    assert (cancels[0].cancelled, cancels[1].cancelled) == ({0}, {1})
    stop()
    whole.cancel(4)
    assert cancels[1].cancelled == {1}


def answered(
    num_rows: list[int], codes: list[int], *, packed: bool = True, worker_us: int = 0
) -> bytes:
    """A part's answer: slice i of code 0 answers rows filled with its first row's index;
    `worker_us`, its worker's time on it."""
    response = pb.InferResponse(
        model_name="minilm", model_version="1", fingerprint="fp", worker_us=worker_us
    )
    rows = []
    for count, code in zip(num_rows, codes, strict=True):
        response.slices.add(code=code)
        if code == OK:
            rows += [np.full(2, len(rows), dtype=np.float32)] * count
    if rows and packed:
        response.packed_outputs.CopyFrom(tensor_to_pb(np.stack(rows)))
    else:
        response.outputs.extend(tensor_to_pb(r) for r in rows)
    return response.SerializeToString()


def test_the_merged_answer_has_every_slice_in_order_and_the_ok_rows_packed() -> None:
    refusal = Overloaded("late", retry_after_s=0.2)
    merged = pb.InferResponse.FromString(
        merge(
            [
                (Part(0, 2, (1, 2), 0, "", 1.0), answered([1, 2], [OK, OK], worker_us=900)),
                (Part(2, 3, (1,), 0, "", 1.0), refusal),
                (Part(3, 5, (1, 1), 0, "", 1.0), answered([1, 1], [EXHAUSTED, OK], worker_us=7)),
            ]
        )
    )
    assert merged.model_name == "minilm" and merged.fingerprint == "fp"
    assert merged.worker_us == 0  # a part failed: its time is not known
    assert [s.code for s in merged.slices] == [OK, OK, EXHAUSTED, EXHAUSTED, OK]
    assert "retry-after-ms" in merged.slices[2].trailers
    assert tensor_from_pb(merged.packed_outputs).shape == (4, 2)


def test_a_merged_answer_reports_its_parts_longest_time_in_a_worker() -> None:
    merged = pb.InferResponse.FromString(
        merge(
            [
                (Part(0, 1, (1,), 0, "", 1.0), answered([1], [OK], worker_us=7)),
                (Part(1, 2, (1,), 0, "", 1.0), answered([1], [OK], worker_us=900)),
                (Part(2, 3, (1,), 0, "", 1.0), answered([1], [EXHAUSTED], worker_us=40)),
            ]
        )
    )
    assert merged.worker_us == 900


@pytest.mark.parametrize(
    "refusal",
    [
        Overloaded("late", retry_after_s=0.2),
        UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", (("retry-after-ms", "200"),)),
    ],
)
def test_the_callers_of_a_refused_part_get_retry_hints_of_their_own(
    refusal: Exception,
) -> None:
    merged = pb.InferResponse.FromString(merge([(Part(0, 8, (1,) * 8, 0, "", 1.0), refusal)]))
    hints = [int(s.trailers["retry-after-ms"]) for s in merged.slices]
    assert len(hints) == 8 and all(150 <= h <= 250 for h in hints)
    assert len(set(hints)) > 1  # 8 draws of a 100 ms spread: alike with odds below 1e-12


def test_parts_that_answer_row_by_row_merge_row_by_row_in_order() -> None:
    merged = pb.InferResponse.FromString(
        merge(
            [
                (Part(0, 1, (2,), 0, "", 1.0), answered([2], [OK], packed=True)),
                (Part(1, 2, (1,), 0, "", 1.0), answered([1], [OK], packed=False)),
            ]
        )
    )
    assert not merged.HasField("packed_outputs")
    assert [tensor_from_pb(t).shape for t in merged.outputs] == [(2,), (2,), (2,)]


def test_a_part_answered_with_the_wrong_statuses_or_rows_fails_its_own_slices_internal() -> None:
    merged = pb.InferResponse.FromString(
        merge(
            [
                (Part(0, 2, (1, 1), 0, "", 1.0), answered([1], [OK])),
                (Part(2, 3, (1,), 0, "", 1.0), UpstreamError(grpc.StatusCode.UNAVAILABLE, "gone")),
                # Two OK slices of one row each, answered with one row.
                (Part(3, 5, (1, 1), 0, "", 1.0), answered([1, 0], [OK, OK])),
            ]
        )
    )
    internal = grpc.StatusCode.INTERNAL.value[0]
    assert [s.code for s in merged.slices] == [
        internal,
        internal,
        grpc.StatusCode.UNAVAILABLE.value[0],
        internal,
        internal,
    ]
    assert not merged.HasField("packed_outputs") and not merged.outputs


@pytest.mark.parametrize("weight", [-1.0, 0.0, float("nan"), float("inf")])
def test_a_slice_weight_that_is_no_positive_number_routes_as_the_default(weight: float) -> None:
    request = text_bundle([1, 1], tenants=["a", "a"])
    for piece in request.slices:
        piece.tenant_weight = weight
    part = parsed(request).part(0, 2)
    assert (part.tenant, part.weight) == ("a", 1.0)


def test_a_part_answered_with_what_does_not_read_fails_its_slices_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two statuses for a part of three slices (a worker's bug, a version mismatch): its
    callers get INTERNAL, and the log says which part, where nothing did (review finding)."""
    short = answered([1, 1], [OK, OK])
    with caplog.at_level(logging.ERROR, logger="services.router.bundle_split"):
        merged = pb.InferResponse.FromString(
            merge(
                [
                    (Part(0, 1, (1,), 0, "", 1.0), answered([1], [OK])),
                    (Part(1, 4, (1, 1, 1), 0, "", 1.0), short),
                ]
            )
        )
    assert [s.code for s in merged.slices] == [OK] + [grpc.StatusCode.INTERNAL.value[0]] * 3
    (record,) = [r for r in caplog.records if "split bundle" in r.getMessage()]
    assert "slices 1-3" in record.getMessage() and record.exc_info is not None
