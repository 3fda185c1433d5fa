"""The order a ModelStreamInfer stream writes its answers in (services.gateway.stream_answers):
requests that are not decoupled answered in the order they came, as Triton writes them; a
decoupled model's answers as they come, never behind those."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.stream_answers import MAX_STREAMED_HELD, Answer, StreamAnswers
from services.pb.inference import grpc_service_pb2 as kserve

pytestmark = pytest.mark.unit


def named(request_id: str) -> Answer:
    return kserve.ModelStreamInferResponse(infer_response=kserve.ModelInferResponse(id=request_id))


async def written(answers: StreamAnswers) -> str | None:
    """The id of the next answer written, once one is ready (within 5 s: it is at once)."""
    answer = await asyncio.wait_for(answers.next(), timeout=5.0)
    return None if answer is None else answer.infer_response.id


async def test_a_request_answered_first_is_written_after_the_one_read_before_it() -> None:
    """A slow request, then a quick one: the quick one's answer waits for the slow one's (a
    caller without request ids pairs them by order; before, the quick one's came first)."""
    answers = StreamAnswers()
    slow, quick = answers.place(), answers.place()
    answers.answer(quick, named("quick"))
    waiting = asyncio.ensure_future(written(answers))
    await asyncio.sleep(0.05)
    assert not waiting.done() and answers.unwritten == 1
    answers.answer(slow, named("slow"))
    assert await waiting == "slow"
    assert await written(answers) == "quick"
    assert answers.unwritten == 0


async def test_a_decoupled_models_answers_pass_a_request_still_running() -> None:
    """A generation's tokens are written as they come, as Triton writes a decoupled model's,
    while a request read before them is still running (a review finding: they waited for it)."""
    answers = StreamAnswers()
    slow = answers.place()
    answers.put_decoupled(named("token-1"))
    answers.put(named("refused"))  # a door refusal takes its place in order
    answers.put_decoupled(named("token-2"))
    assert [await written(answers), await written(answers)] == ["token-1", "token-2"]
    answers.put_decoupled(named("token-3"))
    answers.answer(slow, named("slow"))
    answers.end()
    # Made, the request's answers go before the tokens queued: a backlog never holds them.
    assert [await written(answers) for _ in range(3)] == ["slow", "refused", "token-3"]
    assert await written(answers) is None


async def test_a_place_filled_twice_keeps_its_first_answer() -> None:
    answers = StreamAnswers()
    place = answers.place()
    answers.answer(place, named("answered"))
    answers.answer(place, named("cancelled"))
    answers.end()
    assert await written(answers) == "answered"
    assert await written(answers) is None and answers.unwritten == 0


async def test_a_generation_whose_caller_stops_reading_waits_for_the_writer() -> None:
    """A caller that stops reading its stream: the tokens of its generations piled up in the
    gateway without bound (up to 1024 generations, each to its max_tokens); now a generation
    waits once MAX_STREAMED_HELD of them are unwritten, and goes on as one is written."""
    answers = StreamAnswers()
    put = 0

    async def generate() -> None:
        nonlocal put
        for i in range(MAX_STREAMED_HELD + 10):
            await answers.put_streamed(named(f"token {i}"))
            put += 1

    generation = asyncio.ensure_future(generate())
    await asyncio.sleep(0.05)
    assert not generation.done() and put == MAX_STREAMED_HELD == answers.unwritten
    assert await written(answers) == "token 0"
    await asyncio.sleep(0.05)
    assert put == MAX_STREAMED_HELD + 1, "one written, one more in"
    for i in range(1, MAX_STREAMED_HELD + 10):
        assert await written(answers) == f"token {i}"
    await asyncio.wait_for(generation, timeout=5.0)


async def test_the_bytes_of_answers_not_written_yet_are_counted() -> None:
    """A stream's bound on what it holds counts its answers not written yet as well as its
    requests in flight: answers as large as their requests, unread, were bounded only by
    their count, 1,024 (diff review)."""
    answers = StreamAnswers()
    first, second = named("a" * 100), named("b" * 1000)
    place = answers.place()
    answers.put(first)
    answers.answer(place, second)
    answers.put_decoupled(named("token"))
    sizes = [a.ByteSize() for a in (first, second, named("token"))]
    assert answers.unwritten_bytes == sum(sizes) and answers.unwritten == 3
    assert await written(answers) == "b" * 1000  # its place came first
    assert answers.unwritten_bytes == sizes[0] + sizes[2]
    assert await written(answers) == "a" * 100
    assert await written(answers) == "token"
    assert answers.unwritten_bytes == 0 and answers.unwritten == 0
