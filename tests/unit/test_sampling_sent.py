"""The sampling parameters a gateway sends a worker with a generation: max_tokens is always
set, so that a worker older than `fills_context` (mid-rollout: gateways are often upgraded
before workers) reads a chat reply that fills the context as it did before that field, not as
the default of 16 tokens (review finding)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidInput
from services.common.sampling import SamplingParams, sampling_from_pb, sampling_sent
from services.pb.inference.v1 import types_pb2 as tpb

pytestmark = pytest.mark.unit


def test_a_reply_that_fills_the_context_is_sent_the_rest_of_the_context() -> None:
    sent = sampling_sent(
        tpb.SamplingParameters(temperature=0.5), max_model_len=256, prompt_len=10,
        fills_context=True,
    )  # fmt: skip
    assert sent.max_tokens == 246
    assert sent.temperature == 0.5
    # How a worker that knows nothing of fills_context reads it.
    assert sampling_from_pb(sent).max_tokens == 246


@pytest.mark.parametrize(("asked", "expected"), [(0, SamplingParams.max_tokens), (40, 40)])
def test_a_reply_of_a_set_or_default_length_is_sent_that_length(asked: int, expected: int) -> None:
    sent = sampling_sent(
        tpb.SamplingParameters(max_tokens=asked), max_model_len=256, prompt_len=10,
        fills_context=False,
    )  # fmt: skip
    assert sent.max_tokens == expected


def test_a_reply_past_the_context_is_refused() -> None:
    with pytest.raises(InvalidInput, match="256"):
        sampling_sent(
            tpb.SamplingParameters(max_tokens=250), max_model_len=256, prompt_len=10,
            fills_context=False,
        )  # fmt: skip
