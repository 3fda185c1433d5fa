"""The answers of one ModelStreamInfer stream, in the order they are written.

Triton writes the responses of a model that is not decoupled in the order its requests came
(its stream handler queues each request's state for its response as it reads it), and stock
clients rely on it: tritonclient's `start_stream` callback gets a response with no request id
when none was sent, so a caller pairs answers with requests by their order. A request that is
not decoupled therefore takes its place when it is read (`place`), answered there however long
it runs (`answer`); a generation's answers, as they stream, and the door's refusals are
written where they are made (`put`).
"""

from __future__ import annotations

import asyncio

from services.pb.inference import grpc_service_pb2 as kserve

#: One answer on a ModelStreamInfer stream.
Answer = kserve.ModelStreamInferResponse


class StreamAnswers:
    """A stream's answers in writing order, and how many are made and not written yet."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Answer | asyncio.Future[Answer] | None] = asyncio.Queue()
        #: Answers made and not taken for writing yet.
        self.unwritten = 0

    def put(self, answer: Answer) -> None:
        """Writes `answer` after those before it."""
        self._queue.put_nowait(answer)
        self.unwritten += 1

    def place(self) -> asyncio.Future[Answer]:
        """A place for a request's one answer, after those before it (`answer` fills it)."""
        place: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(place)
        return place

    def answer(self, place: asyncio.Future[Answer], answer: Answer) -> None:
        """Fills `place` (once: a place filled already keeps its answer)."""
        if not place.done():
            place.set_result(answer)
            self.unwritten += 1

    def end(self) -> None:
        """No answer follows those put or placed so far (each place must be filled)."""
        self._queue.put_nowait(None)

    async def next(self) -> Answer | None:
        """The next answer to write, once it is made; None after `end`."""
        item = await self._queue.get()
        if item is None:
            return None
        answer = await item if isinstance(item, asyncio.Future) else item
        self.unwritten -= 1
        return answer
