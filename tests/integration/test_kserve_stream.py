"""ModelStreamInfer serves models that are not decoupled, as Triton does: one response per
request, by id, the requests of one stream in flight together (a real in-process fabric: a
redis-server, the router, a worker and the gateway over gRPC on loopback, serving the affine
model and the `stall` model of tests/support/models.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from services.common import metric_names as names
from services.common.door_config import DoorConfig
from services.gateway import kserve_infer
from services.gateway.auth import LOCAL_PRINCIPAL
from services.gateway.kserve_infer import StreamInfer
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from tests.support.in_process import Fabric, affine_and_stall_fabric
from tests.support.models import (
    STALL,
    affine_reference,
    release_stall,
)
from tests.support.redis import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

PATIENT_S = 30.0


@pytest.fixture
async def fabric(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fabric]:
    async with affine_and_stall_fabric(tmp_path, redis_server) as fabric:
        yield fabric


def _infer(request_id: str, rows: np.ndarray, *, model: str = "affine") -> kserve.ModelInferRequest:
    tensor = kserve.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=list(rows.shape)
    )
    return kserve.ModelInferRequest(
        model_name=model, id=request_id, inputs=[tensor], raw_input_contents=[rows.tobytes()]
    )


async def _sent_from(
    queue: asyncio.Queue[kserve.ModelInferRequest | None],
) -> AsyncIterator[kserve.ModelInferRequest]:
    """A stream's requests as the test puts them in `queue`, until it puts None."""
    while (request := await queue.get()) is not None:
        yield request


def _rows(response: kserve.ModelInferResponse) -> np.ndarray:
    (output,) = response.outputs
    assert output.name == "y" and output.datatype == "FP32"
    return np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(output.shape)


async def test_a_stream_answers_each_request_of_a_model_that_is_not_decoupled(
    fabric: Fabric,
) -> None:
    """32 one-row requests, a two-row one, a wrong one and one of an unknown model on one
    stream: each answered once with its own rows, the wrong one in-band INVALID_ARGUMENT and
    the unknown model's NOT_FOUND with their ids, and each counted (api kserve_v2_stream) by
    its own status, as ModelInfer counts its calls."""
    generator = np.random.default_rng(5)
    sent = {f"r{i}": generator.uniform(-1, 1, (1, 4)).astype("<f4") for i in range(32)}
    sent["two-rows"] = generator.uniform(-1, 1, (2, 4)).astype("<f4")
    requests = [_infer(request_id, rows) for request_id, rows in sent.items()]
    wrong = _infer("wrong", np.zeros((1, 4), dtype="<i4"))
    wrong.inputs[0].datatype = "INT32"
    requests.insert(10, wrong)
    requests.insert(20, _infer("unknown", np.ones((1, 4), dtype="<f4"), model="no-such-model"))
    answers: dict[str, np.ndarray] = {}
    errors: dict[str, str] = {}
    async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
        call = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter(requests), timeout=PATIENT_S
        )
        async for response in call:
            request_id = response.infer_response.id
            assert request_id not in answers and request_id not in errors, request_id
            # Each answer its request's last, as Triton flags every streamed answer: a stock
            # client waiting for the flag waited for good (review finding).
            final = response.infer_response.parameters["triton_final_response"]
            assert final.bool_param, request_id
            if response.error_message:
                errors[request_id] = response.error_message
            else:
                answers[request_id] = _rows(response.infer_response)
        assert await call.code() == grpc.StatusCode.OK
    assert set(answers) == set(sent)
    for request_id, rows in sent.items():
        expected = affine_reference(torch.from_numpy(rows)).numpy()
        np.testing.assert_allclose(answers[request_id], expected, rtol=1e-5, atol=1e-6)
    assert sorted(errors) == ["unknown", "wrong"]
    assert errors["wrong"].startswith("INVALID_ARGUMENT: input x must be FP32"), errors
    assert errors["unknown"].startswith("NOT_FOUND: model 'no-such-model'"), errors
    counted = {
        code: fabric.gateway_metric(
            names.GATEWAY_REQUESTS_TOTAL, api="kserve_v2_stream", model="affine", code=code
        )
        for code in ("OK", "INVALID_ARGUMENT")
    }
    assert counted == {"OK": 33, "INVALID_ARGUMENT": 1}
    assert (
        fabric.gateway_metric(
            names.GATEWAY_REQUESTS_TOTAL, api="kserve_v2_stream", model="other", code="NOT_FOUND"
        )
        == 1
    )
    assert fabric.worker_metric(names.WORKER_ROWS_TOTAL) == 34


async def test_a_message_that_does_not_parse_ends_the_stream_after_the_requests_before_it(
    fabric: Fabric,
) -> None:
    """A request, then bytes that are no ModelInferRequest: the request is answered, then the
    stream ends INVALID_ARGUMENT. Before, the stream ended at once and cancelled the request
    read before the bad message, which got no answer."""
    rows = np.ones((1, 4), np.float32)
    async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=lambda body: body,
            response_deserializer=kserve.ModelStreamInferResponse.FromString,
        )(timeout=PATIENT_S)
        await stream.write(_infer("first", rows).SerializeToString())
        await stream.write(b"\xff\xff\xff")  # no protobuf message
        await stream.done_writing()
        answers = []
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for response in stream:
                answers.append(response)
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ended.value
    (answer,) = answers
    assert answer.error_message == "" and answer.infer_response.id == "first"
    np.testing.assert_allclose(
        _rows(answer.infer_response), affine_reference(torch.from_numpy(rows)).numpy(), rtol=1e-5
    )


async def test_a_request_past_its_timeout_parameter_ends_alone(
    fabric: Fabric, tmp_path: Path
) -> None:
    """A request held at the worker (the stall model) past its own `timeout` parameter is
    answered DEADLINE_EXCEEDED in-band with its id, and the stream goes on: a request sent on
    it afterwards is answered."""
    stalled = _infer("stalled", np.full((1, 4), STALL, dtype="<f4"), model="stall")
    stalled.parameters["timeout"].int64_param = 300_000  # microseconds, as Triton's
    queue: asyncio.Queue[kserve.ModelInferRequest | None] = asyncio.Queue()

    async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
        call = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            _sent_from(queue), timeout=PATIENT_S
        )
        queue.put_nowait(stalled)
        late = await call.read()
        release_stall(tmp_path / "gate")
        queue.put_nowait(_infer("after", np.ones((1, 4), dtype="<f4")))
        after = await call.read()
        queue.put_nowait(None)
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    assert late.infer_response.id == "stalled"
    assert late.error_message.startswith("DEADLINE_EXCEEDED"), late.error_message
    assert after.infer_response.id == "after" and not after.error_message
    expected = affine_reference(torch.ones((1, 4))).numpy()
    np.testing.assert_allclose(_rows(after.infer_response), expected, rtol=1e-5, atol=1e-6)


async def test_a_timeout_parameter_of_ages_is_served_as_no_bound(fabric: Fabric) -> None:
    """Triton's `timeout` is a uint64 of microseconds: its largest value was turned into a
    deadline the internal calls' uint64 field could not hold, and the request failed
    INTERNAL."""
    request = _infer("ages", np.ones((1, 4), dtype="<f4"))
    request.parameters["timeout"].uint64_param = 2**64 - 1
    queue: asyncio.Queue[kserve.ModelInferRequest | None] = asyncio.Queue()
    async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
        # No gRPC deadline: the parameter alone bounds the request.
        call = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(_sent_from(queue))
        queue.put_nowait(request)
        answer = await asyncio.wait_for(call.read(), PATIENT_S)
        queue.put_nowait(None)
    assert not answer.error_message, answer.error_message
    expected = affine_reference(torch.ones((1, 4))).numpy()
    np.testing.assert_allclose(_rows(answer.infer_response), expected, rtol=1e-5, atol=1e-6)


async def _held_two_then_answered(fabric: Fabric, gate: Path) -> None:
    """Two requests held at the worker, then a third: the gateway reads no third request
    (none refused, none passing the door, none run) until an answer is written; then every
    request is answered."""
    held = [_infer(f"held{i}", np.full((1, 4), STALL, dtype="<f4"), model="stall") for i in (0, 1)]
    queue: asyncio.Queue[kserve.ModelInferRequest | None] = asyncio.Queue()
    for request in (*held, _infer("third", np.ones((1, 4), dtype="<f4"))):
        queue.put_nowait(request)
    async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
        call = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            _sent_from(queue), timeout=PATIENT_S
        )
        door = fabric.gateway.door
        assert door is not None
        await eventually(lambda: door.num_in_flight == 2, message="both held requests read")
        await eventually(lambda: queue.empty(), message="the client sent all three")
        await asyncio.sleep(0.5)  # time for a third request to be read, were it to be
        # Every request read passes the door: it holds the two, not the third.
        unread = (door.num_in_flight, fabric.worker_metric(names.WORKER_ROWS_TOTAL))
        release_stall(gate)
        answers = [await call.read() for _ in range(3)]
        queue.put_nowait(None)
        assert await call.read() == grpc.aio.EOF
    assert unread == (2, 0)
    assert sorted(a.infer_response.id for a in answers) == ["held0", "held1", "third"]
    assert not any(a.error_message for a in answers), answers


def _stream_requests(fabric: Fabric, model: str) -> float:
    return fabric.gateway_metric(names.GATEWAY_REQUESTS_TOTAL, api="kserve_v2_stream", model=model)


async def test_a_stream_past_what_it_may_hold_is_read_no_further_until_answers_go_out(
    fabric: Fabric, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that may hold two requests (MAX_STREAM_HELD)."""
    monkeypatch.setattr(kserve_infer, "MAX_STREAM_HELD", 2)
    await _held_two_then_answered(fabric, tmp_path / "gate")
    assert _stream_requests(fabric, "affine") == 1 and _stream_requests(fabric, "stall") == 2


async def test_a_stream_past_the_bytes_it_may_hold_is_read_no_further_until_answers_go_out(
    fabric: Fabric, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requests a stream holds are bounded in bytes too (MAX_STREAM_BYTES): 1024 of 4 MiB
    were 4 GiB from one call (review finding). A bound the two held requests reach."""
    held_bytes = _infer("held0", np.full((1, 4), STALL, dtype="<f4"), model="stall").ByteSize()
    monkeypatch.setattr(kserve_infer, "MAX_STREAM_BYTES", 2 * held_bytes)
    await _held_two_then_answered(fabric, tmp_path / "gate")


async def test_a_request_cut_off_by_the_streams_deadline_counts_deadline_exceeded(
    fabric: Fabric, tmp_path: Path
) -> None:
    """The stream's deadline passes while its request is held: the caller is told
    DEADLINE_EXCEEDED, and the request counts so (it counted CANCELLED). The request's own
    deadline is the stream's, so either may end it first: its in-band DEADLINE_EXCEEDED
    answer, then the stream's status, or the stream's status alone."""
    queue: asyncio.Queue[kserve.ModelInferRequest | None] = asyncio.Queue()
    queue.put_nowait(_infer("held", np.full((1, 4), STALL, dtype="<f4"), model="stall"))

    def counted(code: str) -> float:
        return fabric.gateway_metric(
            names.GATEWAY_REQUESTS_TOTAL, api="kserve_v2_stream", model="stall", code=code
        )

    try:
        async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
            call = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                _sent_from(queue), timeout=3.0
            )
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                answer = await call.read()
                assert answer.infer_response.id == "held", answer
                assert answer.error_message.startswith("DEADLINE_EXCEEDED: "), answer
                await call.read()
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: counted("DEADLINE_EXCEEDED") == 1, message="counted")
        assert counted("CANCELLED") == 0
    finally:
        release_stall(tmp_path / "gate")


async def test_a_streams_requests_pass_the_door_as_calls_of_their_own(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A gateway door of one place: a stream's request held at the worker takes it, so the
    stream's next request is refused in-band with the door's words before any work, and so is a
    unary ModelInfer beside it; once the held request is answered its place is free again.
    The refusal, made at once, is written after the held request's answer, as Triton orders
    the answers of models that are not decoupled: tritonclient's stream callback gets no
    request id where none was sent, so callers pair answers with requests by their order
    (before, the refusal was written first)."""
    # One caller, over its share however long the test takes (a caller unseen for two share
    # windows would count as new, and a new caller is let in); and a door that never sheds, so
    # that only its one place decides, however slow the machine.
    one_place = DoorConfig(
        initial_limit=1, min_limit=1, max_limit=1, share_window_s=3600, shed_factor=0
    )
    queue: asyncio.Queue[kserve.ModelInferRequest | None] = asyncio.Queue()

    async with (
        affine_and_stall_fabric(
            tmp_path, redis_server, gateway_settings={"door": one_place}
        ) as fabric,
        grpc.aio.insecure_channel(fabric.gateway_address) as channel,
    ):
        door = fabric.gateway.door
        assert door is not None
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(_sent_from(queue), timeout=PATIENT_S)
        queue.put_nowait(_infer("held", np.full((1, 4), STALL, dtype="<f4"), model="stall"))
        await eventually(lambda: door.num_in_flight == 1, message="the held request entered")
        queue.put_nowait(_infer("refused", np.ones((1, 4), dtype="<f4")))
        await eventually(
            lambda: fabric.gateway_metric(names.DOOR_REFUSED_TOTAL, method="stream") == 1,
            message="the second request refused",
        )
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.ModelInfer(_infer("unary", np.ones((1, 4), dtype="<f4")), timeout=5)
        release_stall(tmp_path / "gate")
        held, refused = await call.read(), await call.read()
        await eventually(lambda: door.num_in_flight == 0, message="the place is free")
        queue.put_nowait(_infer("after", np.ones((1, 4), dtype="<f4")))
        after = await call.read()
        queue.put_nowait(None)
        assert await call.read() == grpc.aio.EOF
        rows = fabric.worker_metric(names.WORKER_ROWS_TOTAL, model="affine")
        refusals = fabric.gateway_metric(names.DOOR_REFUSED_TOTAL, method="stream")
    assert refused.infer_response.id == "refused"
    assert refused.error_message.startswith("RESOURCE_EXHAUSTED: overloaded: this process has 1")
    # Its retry hint, as the unary call's trailer has it: a stream's request has no trailers.
    assert refused.infer_response.parameters["retry-after-ms"].int64_param > 0
    assert unary.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(unary.value.trailing_metadata() or ())["retry-after-ms"]) > 0
    assert held.infer_response.id == "held" and not held.error_message
    assert after.infer_response.id == "after" and not after.error_message
    assert rows == 1  # the request after; neither refused one reached the worker
    assert refusals == 1


async def test_a_stream_that_ends_before_its_request_ran_gives_the_door_place_back(
    fabric: Fabric,
) -> None:
    """The stream's consumer is cancelled (the client went away) in the loop turn that made a
    request's task, before it first ran: the task is cancelled unstarted, and the place it
    took at the door is given back all the same."""
    gateway = fabric.gateway
    door = gateway.door
    assert door is not None
    streams = StreamInfer(gateway.predictor, gateway.metrics, 8, door)
    consumer: asyncio.Task[kserve.ModelStreamInferResponse] | None = None

    async def requests() -> AsyncIterator[kserve.ModelInferRequest]:
        assert consumer is not None
        consumer.cancel()  # runs before the task made for the request below
        yield _infer("unstarted", np.ones((1, 4), dtype="<f4"))
        await asyncio.Event().wait()  # the client sends nothing more

    served = streams.serve(requests(), LOCAL_PRINCIPAL, (), lambda: PATIENT_S)
    consumer = asyncio.create_task(anext(served))
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await served.aclose()
    await eventually(lambda: door.num_in_flight == 0, message="the place was given back")
    assert fabric.worker_metric(names.WORKER_ROWS_TOTAL) == 0


async def test_a_stream_that_may_hold_one_request_serves_one_after_another(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for one: each answer written lets the next request be read, so three requests sent
    at once are all answered (reading resumes when a request's task ends, not only when an
    answer is taken for writing, which would leave the reader waiting for ever)."""
    monkeypatch.setattr(kserve_infer, "MAX_STREAM_HELD", 1)
    requests = [_infer(f"r{i}", np.full((1, 4), i, dtype="<f4")) for i in range(3)]
    async with grpc.aio.insecure_channel(fabric.gateway_address) as channel:
        call = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter(requests), timeout=PATIENT_S
        )
        answers = [response async for response in call]
        assert await call.code() == grpc.StatusCode.OK
    assert [a.infer_response.id for a in answers] == ["r0", "r1", "r2"]
    assert not any(a.error_message for a in answers), answers
