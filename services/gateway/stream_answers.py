"""The answers of one ModelStreamInfer stream, in the order they are written.

Triton writes the responses of a model that is not decoupled in the order its requests came
(its stream handler queues each request's state for its response as it reads it), and stock
clients rely on it: tritonclient's `start_stream` callback gets a response with no request id
when none was sent, so a caller pairs answers with requests by their order. A request that is
not decoupled therefore takes its place when it is read (`place`), answered there however long
it runs (`answer`), and the door's refusals take theirs when made (`put`). A decoupled
model's answers (a generation's tokens) are written as they come (`put_decoupled`), as Triton
writes them, never held behind a request that is not decoupled.
"""

from __future__ import annotations

import asyncio
from collections import deque

from services.common.errors import RETRY_AFTER_MS_KEY, Unavailable
from services.common.grpc_errors import status_of
from services.pb.inference import grpc_service_pb2 as kserve

#: One answer on a ModelStreamInfer stream.
Answer = kserve.ModelStreamInferResponse

#: A request read on a stream while the gateway drains is answered DRAINING, and the stream
#: then ends UNAVAILABLE, DRAINED, marked not started (its requests unanswered did not run).
DRAINING = Unavailable("the gateway is stopping: send it again (another gateway serves it)")
DRAINED = "the gateway is stopping: requests of this stream not answered did not run"

#: Decoupled answers (a generation's token messages) a stream holds unwritten before its
#: generations wait for its writer: a caller that stops reading holds them, not memory.
MAX_STREAMED_HELD = 256


class StreamAnswers:
    """A stream's answers in writing order, and how many are made and not written yet."""

    def __init__(self) -> None:
        #: Answers of requests that are not decoupled and refusals, in request order (a
        #: place: a future, filled once answered); None after the last.
        self._ordered: deque[Answer | asyncio.Future[Answer] | None] = deque()
        self._decoupled: deque[Answer] = deque()
        self._changed = asyncio.Event()
        self._taken = asyncio.Event()  # set when a decoupled answer is taken for writing
        #: Answers made and not taken for writing yet, and their bytes.
        self.unwritten = 0
        self.unwritten_bytes = 0
        self._sizes: dict[int, int] = {}  # by id: the bytes of each answer not taken yet

    def put(self, answer: Answer) -> None:
        """Writes `answer` after those before it."""
        self._ordered.append(answer)
        self._made(answer)

    def put_decoupled(self, answer: Answer) -> None:
        """Writes `answer` (a decoupled model's) as soon as the writer is free."""
        self._decoupled.append(answer)
        self._made(answer)

    async def put_streamed(self, answer: Answer) -> None:
        """`put_decoupled`, once fewer than MAX_STREAMED_HELD such answers wait: a generation
        whose caller stopped reading waits here, and its stream from the router with it (gRPC's
        flow control), where its tokens piled up in the gateway without bound (review
        finding)."""
        while len(self._decoupled) >= MAX_STREAMED_HELD:
            self._taken.clear()
            await self._taken.wait()
        self.put_decoupled(answer)

    def place(self) -> asyncio.Future[Answer]:
        """A place for a request's one answer, after those before it (`answer` fills it)."""
        place: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._ordered.append(place)
        return place

    def answer(self, place: asyncio.Future[Answer], answer: Answer) -> None:
        """Fills `place` (once: a place filled already keeps its answer)."""
        if not place.done():
            place.set_result(answer)
            self._made(answer)

    def end(self) -> None:
        """No answer follows those put or placed so far (each place must be filled)."""
        self._ordered.append(None)
        self._changed.set()

    async def next(self) -> Answer | None:
        """The next answer to write, once it is made; None after `end` and every answer."""
        ordered = self._ordered
        while True:
            # A request's answer made goes first (one a request: tokens cannot starve), so a
            # generation's backlog of tokens never holds it back.
            head = ordered[0] if ordered else False
            if isinstance(head, Answer) or (isinstance(head, asyncio.Future) and head.done()):
                ordered.popleft()
                return self._taken_out(head if isinstance(head, Answer) else head.result())
            if self._decoupled:
                self._taken.set()
                return self._taken_out(self._decoupled.popleft())
            if head is None:
                return None
            self._changed.clear()
            await self._changed.wait()

    def _made(self, answer: Answer) -> None:
        self.unwritten += 1
        self._sizes[id(answer)] = size = answer.ByteSize()  # once: it serializes the answer
        self.unwritten_bytes += size
        self._changed.set()

    def _taken_out(self, answer: Answer) -> Answer:
        self.unwritten -= 1
        size = self._sizes.pop(id(answer), None)  # None: one object put twice, taken again
        self.unwritten_bytes -= answer.ByteSize() if size is None else size
        return answer


def error_response(request_id: str, error: BaseException) -> kserve.ModelStreamInferResponse:
    """A request's error, in-band as Triton reports it: "<CODE>: <message>", with its id, and
    its retry hint (`retry-after-ms`, jittered) as a parameter of the response: a unary call
    carries it as a trailer, and a stream's requests have none of their own. Flagged its
    request's last answer (`triton_final_response`), as Triton flags every streamed answer,
    a decoupled (generation) request's or not: a client waiting for the flag, as stock
    streaming clients do, waited for good on every answer but a generation's (review
    finding)."""
    status = status_of(error)
    response = kserve.ModelInferResponse(id=request_id)
    response.parameters["triton_final_response"].bool_param = True
    for key, value in status.trailers:
        if key == RETRY_AFTER_MS_KEY:
            response.parameters[key].int64_param = int(value)
    return kserve.ModelStreamInferResponse(
        error_message=f"{status.code.name}: {status.message}", infer_response=response
    )
