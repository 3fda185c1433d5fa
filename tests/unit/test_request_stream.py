"""A generation request's stream of deltas (services.gpu_worker.generation.request_stream): the
text a reply ends with reaches its reader however the reply ends."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from services.common import metric_names as names
from services.common.sampling import SamplingParams
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.generation.request_stream import Delta, RequestStream
from services.gpu_worker.generation.tiny_llama import build_tokenizer

pytestmark = pytest.mark.unit

TOKENIZER = build_tokenizer()
EOS = 257


async def reply(text: str, last: int | None, params: SamplingParams) -> Delta:
    """The stream's deltas, merged, for `text`'s tokens and then `last` (None: nothing)."""
    stream = RequestStream.open(1, params, TOKENIZER, [5, 6, 7], arrival_s=0.0, tenant="t")
    bound = GenerationMetrics(CollectorRegistry()).bind(("m", "1"))
    tokens = TOKENIZER.encode(text, add_special_tokens=False).ids
    tokens += [] if last is None else [last]
    for n, token in enumerate(tokens, start=1):
        if stream.push_token(token, n, float(n), frozenset({EOS}), bound):
            break
    delta = await stream.output.get()
    assert isinstance(delta, Delta)
    return delta


@pytest.mark.parametrize(
    ("last", "params"),
    [
        (EOS, SamplingParams(max_tokens=32, stop=("###",))),  # the model's EOS
        (7, SamplingParams(max_tokens=32, stop=("###",), stop_token_ids=(7,))),  # a stop token
        (None, SamplingParams(max_tokens=10, stop=("###",))),  # its length
    ],
)
async def test_text_held_back_for_a_stop_string_is_sent_when_the_reply_ends_without_it(
    last: int | None, params: SamplingParams
) -> None:
    """ "Answer: 5#" could be the start of "###" until the reply ends: then its "#" is the
    reply's own text (it was dropped when a stop or EOS token ended the reply). The usage
    counts the stop or EOS token, as OpenAI and vLLM do (it counted only those streamed)."""
    delta = await reply("Answer: 5#", last, params)
    assert delta.text == "Answer: 5#"
    assert delta.finish_reason in ("stop", "length")
    assert delta.completion_tokens == len("Answer: 5#") + (last is not None)


async def test_a_stop_string_is_cut_with_what_follows_it() -> None:
    delta = await reply("Answer: 5### more", None, SamplingParams(max_tokens=32, stop=("###",)))
    assert (delta.text, delta.finish_reason) == ("Answer: 5", "stop")


async def test_a_stop_string_the_last_tokens_complete_ends_the_reply_at_it() -> None:
    """The reply reaches its length in half a character ("é"'s first byte, shown as U+FFFD),
    which completes a stop string: cut there, and its finish reason is the stop's."""
    params = SamplingParams(max_tokens=4, stop=("k \ufffd",))
    delta = await reply("ok é", None, params)
    assert (delta.text, delta.finish_reason) == ("o", "stop")


def test_streamed_tokens_are_recorded_at_the_flush_as_one_observation_each() -> None:
    """A step's tokens share their time per output token: counted, then written in one flush
    as the counter and histogram would have recorded them a token at a time."""
    registry = CollectorRegistry()
    bound = GenerationMetrics(registry).bind(("m", "1"))
    labels = {"model": "m", "version": "1"}
    tokens, tpot = names.GENERATION_TOKENS_TOTAL, names.GENERATION_TPOT_SECONDS
    for num_tokens, tpot_s in ((1, None), (1, 0.004), (1, 0.004), (1, 0.03), (0, 0.004)):
        bound.streamed(num_tokens, tpot_s)  # the last a stop token: timed, no token
    assert not registry.get_sample_value(tokens, labels)  # not yet
    assert not registry.get_sample_value(f"{tpot}_count", labels)
    for _ in range(2):  # a second flush, with nothing counted since, records nothing
        bound.flush_tokens()
        assert registry.get_sample_value(tokens, labels) == 4.0
        assert registry.get_sample_value(f"{tpot}_count", labels) == 4.0
        assert registry.get_sample_value(f"{tpot}_sum", labels) == pytest.approx(0.042)
        assert registry.get_sample_value(f"{tpot}_bucket", labels | {"le": "0.005"}) == 3.0
