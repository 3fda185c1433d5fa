"""Inference requests of the Open Inference Protocol v2 (KServe v2) over gRPC: one
`ModelInfer`, and the requests of a `ModelStreamInfer` stream, whatever the model.

Triton serves every model on the stream, not only decoupled ones: a model that is not
decoupled answers each request with exactly one response, and stock clients
(tritonclient.grpc's `start_stream` and `async_stream_infer`) use it to keep many requests in
flight over one call. That is also the cheap way in: a unary call costs the gateway grpc's
whole per-call path (about one bare echo call of CPU, services.common.door), where a message on
an open stream costs a read and a write. So embedding models and classifiers are served on
the stream as `ModelInfer` serves them (same checks, admission, coalescing and answers), and
generation models as services.gateway.kserve_generate streams them.

Wire conventions (as tritonclient sends and reads them): BYTES inputs arrive in
`raw_input_contents` as 4-byte little-endian lengths each followed by the bytes (or typed in
`contents.bytes_contents`); outputs go back in `raw_output_contents`, one entry per output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from services.common.door import Door
from services.common.errors import InvalidInput, ServingError, Unavailable
from services.common.interceptors import Metadata
from services.common.model_repository import ModelConfig
from services.common.tensors import MAX_ELEMENTS, NUMPY_DTYPES, stack_rows
from services.gateway import stream_answers
from services.gateway.admission import StreamRequests
from services.gateway.auth import KeyStore, Principal, principal_for
from services.gateway.kserve_generate import check_inputs, generate_one
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_inputs import check_num_inputs
from services.gateway.predictor import PredictCall, Predictor, PredictValue
from services.gateway.stream_answers import Answer, StreamAnswers, error_response
from services.gateway.triton_info import request_parameters
from services.pb.inference import grpc_service_pb2 as kserve

log = logging.getLogger(__name__)

#: The `api` label of requests served on a ModelStreamInfer stream (one count per request).
STREAM_API = "kserve_v2_stream"
#: The door's `method` label for the requests of streams it refuses.
STREAM_DOOR_LABEL = "stream"
#: What one stream may hold at once: requests in flight and answers not written yet. At it,
#: the gateway reads no more of the stream until answers are written (HTTP/2's flow control
#: then holds the caller's further requests), so one call holds bounded memory: a stream's
#: answers are written one at a time, and a flood past what they carry would otherwise pile
#: up answers (and refusals, each one more message) without end. A generation in flight may
#: add tokens beyond it, as many as it generates before they are written.
MAX_STREAM_HELD = 1024
#: ... and the bytes of the requests and answers it holds: 1024 of 4 MiB were 4 GiB, past a
#: gateway pod's memory limit, from one call (review finding).
MAX_STREAM_BYTES = 32 * 1024 * 1024

_TYPED_FIELDS = {
    "FP32": "fp32_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
}


def _decode_bytes(raw: bytes, count: int) -> list[str]:
    """Length-prefixed BYTES elements; INVALID_ARGUMENT if the framing or UTF-8 is wrong."""
    texts: list[str] = []
    offset = 0
    while offset < len(raw):
        if len(texts) == count:  # more than its shape says: refused before it is all read
            raise InvalidInput(f"BYTES tensor holds more elements than its shape's {count}")
        if offset + 4 > len(raw):
            raise InvalidInput("BYTES tensor: truncated length prefix")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput("BYTES tensor: element runs past the end of the data")
        try:
            texts.append(raw[offset : offset + length].decode("utf-8"))
        except UnicodeDecodeError as error:
            raise InvalidInput("BYTES tensor elements must be UTF-8 text") from error
        offset += length
    if len(texts) != count:
        raise InvalidInput(f"BYTES tensor holds {len(texts)} elements; its shape says {count}")
    return texts


def _num_rows(shape: list[int], row_dims: tuple[int, ...], name: str, *, is_bytes: bool) -> int:
    """Rows in a [batch, *row_dims] input (BYTES: [batch] or [batch, 1])."""
    if is_bytes:
        is_valid = len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)
        expected = "[batch] or [batch, 1]"
    else:
        is_valid = len(shape) == len(row_dims) + 1 and tuple(shape[1:]) == row_dims
        expected = f"[batch, {', '.join(map(str, row_dims))}]"
    if not is_valid or shape[0] < 0:
        raise InvalidInput(f"input {name} has shape {shape}; expected {expected}")
    if shape[0] == 0:
        raise InvalidInput(f"input {name} is empty")
    return shape[0]


def _values(
    config: ModelConfig, request: kserve.ModelInferRequest, max_rows: int
) -> list[PredictValue]:
    """The request's rows, decoded only after every check on the tensor's metadata (name,
    dtype, shape, row cap) has passed (`check_inputs` first)."""
    spec = config.inputs[0]
    # Each read of a field builds a wrapper: read once.
    inputs, raw_contents = request.inputs, request.raw_input_contents
    # Names are unique (check_inputs), so this is the input of that name and no other.
    if len(inputs) != 1 or (tensor := inputs[0]).name != spec.name:
        names = sorted({t.name for t in inputs})
        raise InvalidInput(
            f"{config.name} takes exactly one input named {spec.name!r}, got {names}"
        )
    if (datatype := tensor.datatype) != spec.dtype:
        raise InvalidInput(f"input {spec.name} must be {spec.dtype}, got {datatype or 'none'}")
    shape = list(tensor.shape)
    is_bytes = datatype == "BYTES"
    count = _num_rows(shape, spec.dims, spec.name, is_bytes=is_bytes)
    check_num_inputs(count, max_rows)
    if is_bytes:
        if raw_contents:
            return list(_decode_bytes(raw_contents[0], count))
        elements = list(tensor.contents.bytes_contents)
        if len(elements) != count:
            raise InvalidInput(
                f"input {spec.name} holds {len(elements)} elements; shape says {count}"
            )
        try:
            return [e.decode("utf-8") for e in elements]
        except UnicodeDecodeError as error:
            raise InvalidInput("BYTES tensor elements must be UTF-8 text") from error
    dtype = NUMPY_DTYPES[datatype]
    num_elements = math.prod(shape)  # Python ints: a numpy product would wrap around
    if num_elements > MAX_ELEMENTS:
        raise InvalidInput(f"input {spec.name} of {num_elements} elements exceeds the limit")
    if raw_contents:
        raw = raw_contents[0]
        if len(raw) != num_elements * dtype.itemsize:
            raise InvalidInput(f"input {spec.name}: {len(raw)} bytes do not match shape {shape}")
        array = np.frombuffer(raw, dtype=dtype)
    else:
        field = _TYPED_FIELDS.get(datatype)
        values = getattr(tensor.contents, field) if field else []
        if len(values) != num_elements:
            raise InvalidInput(
                f"input {spec.name}: {len(values)} values do not match shape {shape}"
            )
        array = np.asarray(values, dtype=dtype)
    return list(array.reshape((count, *spec.dims)))


async def infer_one(
    predictor: Predictor,
    request: kserve.ModelInferRequest,
    principal: Principal,
    time_left_s: float | None,
    max_rows: int,
) -> kserve.ModelInferResponse:
    """One inference request of a model that is not decoupled; errors raise (ServingError).
    `time_left_s` is the caller's (None: the model's default applies), `max_rows` the most
    rows it may carry, checked before any element is decoded."""
    config = predictor.catalog.config(request.model_name)
    # Before any input is decoded: a caller may not spend our CPU on a model it may not use,
    # nor on more rows than the cap.
    principal.check_model(config.name)
    if config.generation is not None:
        raise InvalidInput(f"{config.name} is a decoupled model: call ModelStreamInfer")
    options = request_parameters(request.parameters)
    check_inputs(request)  # its tensors counted before any list of them is made
    output = config.outputs[0]
    requested = [o.name for o in request.outputs]
    if requested and requested != [output.name]:
        raise InvalidInput(f"{config.name} has one output, {output.name!r}; asked {requested}")
    result = await predictor.predict(
        PredictCall(
            model_name=request.model_name,
            version_spec=request.model_version,
            inputs=_values(config, request, max_rows),
            principal=principal,
            request_id=request.id,
            timeout_s=options.deadline_s(time_left_s),
            priority=options.priority,
        )
    )
    batch = stack_rows(result.outputs).astype(NUMPY_DTYPES[output.dtype], copy=False)
    response = kserve.ModelInferResponse(
        model_name=result.model_name,
        model_version=result.model_version,
        id=request.id,
        raw_output_contents=[batch.tobytes()],
    )
    # Added in place: a nested message passed to the constructor is built, then copied.
    response.outputs.add(name=output.name, datatype=output.dtype, shape=batch.shape)
    return response


@dataclass(frozen=True)
class StreamInfer:
    """Serves ModelStreamInfer streams (`serve`): what every stream of a gateway shares."""

    predictor: Predictor
    metrics: GatewayMetrics
    #: Most rows one request may carry.
    max_rows: int
    #: The process's door (services.common.door), which each request of a model that is not
    #: decoupled passes as a call of its own would (None: no door).
    door: Door | None = None
    #: The gateway's keys: each request's caller is read from them as they stand when it
    #: arrives (None: no keys, every caller local).
    keys: KeyStore | None = None

    def _is_generation(self, model_name: str) -> bool:
        """Whether `model_name` is a known generation model (any other request is served as
        ModelInfer serves it, an unknown model's refused NOT_FOUND there)."""
        try:
            return self.predictor.catalog.config(model_name).generation is not None
        except ServingError:
            return False

    async def serve(
        self,
        requests: AsyncIterator[kserve.ModelInferRequest],
        principal: Principal,
        metadata: Metadata,
        time_remaining: Callable[[], float | None],
    ) -> AsyncGenerator[kserve.ModelStreamInferResponse, None]:
        """Runs every request of the stream concurrently and yields their responses: one for a
        model that is not decoupled, in the order the requests came, and a generation's as it
        streams them, never held behind those (services.gateway.stream_answers). A
        request's error is reported in-band (`error_message`), as Triton does; the stream and
        the other requests go on. Each request's deadline is its `timeout` parameter, else what
        is left of the stream's when it arrives (`time_remaining`: None without one, then the
        model's default applies). A request of a model that is not decoupled first passes the
        door as a call with the stream's `metadata` would, refused in-band at once past its
        limit or while it sheds (not counted as a request: the door counts it). Each request
        is then admitted against its tenant's quotas beside the stream
        (admission.StreamRequests), so one stream runs no more requests at once than its
        tenant's `max_concurrency`. Each request is counted (api `kserve_v2_stream`), a
        generation by how its stream ends (it was not counted at all). While the stream holds
        MAX_STREAM_HELD requests in flight and answers not written, no more of it is read."""
        predictor, max_rows = self.predictor, self.max_rows
        answers = StreamAnswers()
        admission = StreamRequests(predictor.admission, principal.policy.name)
        headers = {key: value for key, value in metadata if isinstance(value, str)}

        def caller() -> Principal:
            """The stream's caller as the keys stand now: a key revoked while its stream is
            open is refused (Unauthenticated, in-band) from its next request, and a tenant's
            changed limits apply to it."""
            return principal if self.keys is None else principal_for(self.keys, headers)

        async def run(
            request: kserve.ModelInferRequest, place: asyncio.Future[Answer] | None
        ) -> None:
            """Answers `request` in its `place` (None: a generation, answered as it streams)."""
            try:
                acting = caller()
                with admission.admitted(acting.policy):
                    label = predictor.catalog.label_for(request.model_name)
                    time_left_s = time_remaining()
                    # Counted as it ends (a generation, with its stream); with the stream's time
                    # left, so that a request its deadline cuts off counts DEADLINE_EXCEEDED.
                    with self.metrics.observe_request(STREAM_API, label, time_left_s):
                        if place is None:  # closed as it is cancelled, not when collected
                            generation = generate_one(predictor, request, acting, time_left_s)
                            async with contextlib.aclosing(generation) as stream:
                                async for streamed in stream:
                                    await answers.put_streamed(streamed)
                            return
                        response = await infer_one(
                            predictor, request, acting, time_left_s, max_rows
                        )
                    # Its one answer, and its last, as Triton flags every streamed answer.
                    response.parameters["triton_final_response"].bool_param = True
                    answers.answer(place, kserve.ModelStreamInferResponse(infer_response=response))
            except Exception as error:  # every request gets an answer, whatever failed
                if not isinstance(error, ServingError):
                    log.exception("stream request %r failed", request.id)
                answer = error_response(request.id, error)
                if place is None:
                    answers.put_decoupled(answer)
                else:
                    answers.answer(place, answer)

        tasks: set[asyncio.Task[None]] = set()
        room = asyncio.Event()  # set while the stream holds less than it may (`has_room`)
        held_bytes = 0  # of the requests its tasks hold
        is_reading, is_stopped, draining = True, False, self.predictor.draining  # see ender

        def has_room() -> bool:
            held = len(tasks) + answers.unwritten
            return (
                held < MAX_STREAM_HELD and held_bytes + answers.unwritten_bytes < MAX_STREAM_BYTES
            )

        def finished(
            task: asyncio.Task[None],
            *,
            has_entered: bool,
            place: asyncio.Future[Answer] | None,
            request_id: str,
            num_bytes: int,
        ) -> None:
            # A done callback, not `run`'s own `finally`: a task cancelled before it ever ran
            # (the stream ending in the loop turn that made it) runs no `finally`, and its
            # place at the door would never be given back.
            nonlocal held_bytes
            tasks.discard(task)
            held_bytes -= num_bytes
            if place is not None and not place.done():  # cancelled (the stream ends): filled
                answers.answer(place, error_response(request_id, Unavailable("cancelled")))
            if has_entered:
                assert self.door is not None  # entered only where there is one
                self.door.leave()
            if has_room():
                room.set()

        async def read_all() -> None:
            nonlocal held_bytes, is_reading
            try:
                async for request in requests:
                    is_generation = self._is_generation(request.model_name)
                    # Generation requests do not pass the door: they have their own admission,
                    # and would hold a place for a whole generation.
                    has_entered, refusal = False, None
                    if self.door is not None and not is_generation and not draining.is_set():
                        refusal = self.door.enter(metadata, STREAM_DOOR_LABEL)
                        has_entered = refusal is None
                    if draining.is_set():  # not run: the stream ends once those running are
                        answers.put(error_response(request.id, stream_answers.DRAINING))
                    elif refusal is not None:
                        answers.put(error_response(request.id, refusal))
                    else:
                        place = None if is_generation else answers.place()
                        task = asyncio.create_task(run(request, place))
                        tasks.add(task)
                        num_bytes = request.ByteSize()
                        held_bytes += num_bytes
                        task.add_done_callback(
                            partial(
                                finished,
                                has_entered=has_entered,
                                place=place,
                                request_id=request.id,
                                num_bytes=num_bytes,
                            )
                        )
                    while not has_room():  # read on once answers are written
                        room.clear()
                        await room.wait()
            except Exception:
                # A message that does not parse ends the stream with its status, once the
                # requests read before it are answered (they were admitted and are running).
                is_reading = False
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            else:
                is_reading = False
                await asyncio.gather(*tasks)
            finally:
                answers.end()  # also when reading failed: the stream must not hang

        async def end_once_drained() -> None:
            """The gateway stopping: the stream ends once the requests it runs are answered
            (the grace cut them unanswered: review finding); those read meanwhile, refused."""
            nonlocal is_stopped
            await draining.wait()
            while tasks:  # (a wait yields: the tasks' done callbacks run, `tasks` shrinks)
                await asyncio.wait(list(tasks))
            if is_reading:  # what it would read later would be answered after the end
                is_stopped = True
                reader.cancel()
            answers.end()

        reader = asyncio.create_task(read_all())
        ender = asyncio.create_task(end_once_drained())
        try:
            while (response := await answers.next()) is not None:
                if has_room():
                    room.set()
                yield response
            if is_stopped:  # drained while reading: what it sends now is not read, nor run
                raise Unavailable(stream_answers.DRAINED, is_not_started=True)
            await reader  # raises what ended the reading (a message that does not parse)
        finally:
            # The client went away (or the stream failed): its requests stop too (a generation
            # frees its KV blocks, a bundled call its slice), not running on for nobody.
            reader.cancel()
            ender.cancel()
            for task in list(tasks):
                task.cancel()
