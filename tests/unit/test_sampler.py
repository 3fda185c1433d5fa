from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from services.common.sampling import SamplingParams, sampling_from_pb
from services.gpu_worker.generation.sampler import Sampler, make_generator
from services.gpu_worker.generation.sequence import ScheduledSequence
from services.pb.inference.v1 import worker_pb2 as pb

pytestmark = pytest.mark.unit

VOCAB = 50


def make_logits(*, num_rows: int = 4, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn((num_rows, VOCAB), generator=torch.Generator().manual_seed(seed)) * scale


def sample_many(params: SamplingParams, logits_row: torch.Tensor, num_steps: int) -> list[int]:
    """Sample one request for several steps with its own generator, as the engine does."""
    generator = make_generator(params)
    return [Sampler().sample(logits_row[None], [params], [generator])[0] for _ in range(num_steps)]


def test_greedy_is_argmax() -> None:
    logits = make_logits()
    params = [SamplingParams()] * logits.shape[0]

    tokens = Sampler().sample(logits, params, [None] * logits.shape[0])

    assert tokens == logits.argmax(dim=-1).tolist()


def test_same_seed_same_tokens_different_seeds_differ() -> None:
    # Nearly flat: many tokens are plausible, so two seeds agreeing on 20 draws is ~impossible.
    row = make_logits(num_rows=1, scale=0.1)[0]

    first = sample_many(SamplingParams(temperature=1.0, seed=7), row, num_steps=20)
    again = sample_many(SamplingParams(temperature=1.0, seed=7), row, num_steps=20)
    other = sample_many(SamplingParams(temperature=1.0, seed=8), row, num_steps=20)

    assert first == again
    assert first != other
    assert len(set(first)) > 1  # the generator advances between steps


def test_seeded_row_ignores_its_batch_neighbours() -> None:
    logits = make_logits(num_rows=3, scale=0.1)
    seeded = SamplingParams(temperature=1.0, seed=3)
    alone = Sampler().sample(logits[1:2], [seeded], [make_generator(seeded)])
    neighbour = SamplingParams(temperature=1.0, seed=99)

    batched = Sampler().sample(
        logits,
        [neighbour, seeded, neighbour],
        [make_generator(neighbour), make_generator(seeded), make_generator(neighbour)],
    )

    assert batched[1] == alone[0]


def test_greedy_and_seeded_rows_in_one_batch_get_what_each_gets_alone() -> None:
    logits = make_logits(num_rows=5, scale=0.1)
    greedy, seeded = SamplingParams(), SamplingParams(temperature=1.0, seed=5)
    params = [greedy, seeded, greedy, seeded, greedy]
    alone = [
        Sampler().sample(logits[i : i + 1], [p], [make_generator(p)])[0]
        for i, p in enumerate(params)
    ]

    batched = Sampler().sample(logits, params, [make_generator(p) for p in params])

    assert batched == alone
    assert batched[0::2] == logits[0::2].argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=5.0, top_k=1, seed=0),
        SamplingParams(temperature=5.0, top_p=1e-6, seed=0),
    ],
    ids=["top_k=1", "tiny top_p"],
)
def test_narrowest_filter_is_greedy(params: SamplingParams) -> None:
    logits = make_logits(num_rows=8, scale=0.5)

    tokens = Sampler().sample(logits, [params] * 8, [make_generator(params) for _ in range(8)])

    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_most_likely() -> None:
    row = make_logits(num_rows=1, scale=0.1)[0]
    allowed = set(row.topk(3).indices.tolist())

    tokens = sample_many(SamplingParams(temperature=1.0, top_k=3, seed=1), row, num_steps=50)

    assert set(tokens) <= allowed
    assert len(set(tokens)) > 1


def test_top_p_keeps_the_nucleus() -> None:
    # Weights 96 and 64 against 48 tokens of weight 1: probabilities 0.46, 0.31, then a tail of
    # 0.23 that unfiltered sampling would hit often. top_p=0.7 needs exactly the first two.
    row = torch.zeros(VOCAB)
    row[4], row[9] = math.log(96), math.log(64)

    tokens = sample_many(SamplingParams(temperature=1.0, top_p=0.7, seed=2), row, num_steps=60)

    assert set(tokens) == {4, 9}


def test_make_generator_only_for_seeded_sampling() -> None:
    assert make_generator(SamplingParams(seed=5)) is None  # greedy needs no randomness
    assert make_generator(SamplingParams(temperature=1.0)) is None
    assert isinstance(make_generator(SamplingParams(temperature=1.0, seed=5)), torch.Generator)


@pytest.mark.parametrize(
    ("params", "prompt_len", "message"),
    [
        (SamplingParams(max_tokens=0), 4, "max_tokens"),
        (SamplingParams(max_tokens=10), 60, "maximum length"),
        (SamplingParams(temperature=-0.5), 4, "temperature"),
        (SamplingParams(temperature=math.nan), 4, "temperature"),
        (SamplingParams(temperature=math.inf), 4, "temperature"),
        (SamplingParams(top_k=-1), 4, "top_k"),
        (SamplingParams(top_p=0.0), 4, "top_p"),
        (SamplingParams(top_p=1.5), 4, "top_p"),
        (SamplingParams(seed=-1), 4, "seed"),
        (SamplingParams(seed=2**64), 4, "seed"),
        (SamplingParams(stop_token_ids=(-3,)), 4, "stop_token_ids"),
        (SamplingParams(stop=("",)), 4, "stop"),
        # Issue 16: a tiny positive temperature turned logits into inf/NaN and killed the
        # engine loop; huge stop lists were scanned on every token.
        (SamplingParams(temperature=1e-45), 4, "temperature"),
        (SamplingParams(temperature=1e6), 4, "temperature"),
        (SamplingParams(stop=("x" * 1_000_000,)), 4, "stop strings must be"),
        (SamplingParams(stop=tuple(str(i) for i in range(17))), 4, "at most 16 stop"),
        (SamplingParams(stop_token_ids=tuple(range(65))), 4, "stop_token_ids"),
    ],
)
def test_validate_rejects(params: SamplingParams, prompt_len: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params.validate(max_model_len=64, prompt_len=prompt_len)


def test_validate_accepts_the_boundaries() -> None:
    SamplingParams(temperature=0.01, stop=("s" * 256,) * 16, stop_token_ids=(1,) * 64).validate(
        max_model_len=64, prompt_len=4
    )
    SamplingParams(max_tokens=4, temperature=0.7, top_k=5, top_p=1.0, seed=2**64 - 1).validate(
        max_model_len=64, prompt_len=60
    )
    # The smallest temperature as a client sends it (a float32 on the wire: 0.0099999998),
    # and every uint64 seed (the proto's field).
    sampled = sampling_from_pb(pb.SamplingParameters(temperature=0.01, seed=2**64 - 1))
    sampled.validate(max_model_len=64, prompt_len=4)
    make_generator(sampled)


def test_a_row_whose_probabilities_are_not_finite_fails_alone() -> None:
    """Before, the first such row raised out of `sample`, and its step-mates got no token."""
    logits = make_logits(num_rows=3)
    logits[1] = math.nan
    sampled = SamplingParams(temperature=1.0, seed=5)
    params = [SamplingParams(), sampled, sampled]
    generators = [None, make_generator(sampled), make_generator(sampled)]
    first, failed, last = Sampler().sample_rows(logits, params, generators)
    assert isinstance(failed, RuntimeError)
    assert first == int(logits[0].argmax()) and isinstance(last, int)
    with pytest.raises(RuntimeError):
        Sampler().sample(logits, params, generators)


@dataclass
class _Request:  # what sample_step reads of a live request
    params: SamplingParams
    generator: torch.Generator | None


def test_a_step_samples_its_sampling_sequences_rows_in_order() -> None:
    """The step's logits hold a row for each sequence that samples, in order: a prefill chunk
    that does not sample has none. A request gone samples greedily; a row that fails fails
    its sequence alone."""
    logits = make_logits(num_rows=3)
    logits[0] = 0.0  # nearly flat: a draw from it would seldom be its argmax
    logits[0, 7] = 0.05
    logits[2] = math.nan
    seeded = SamplingParams(temperature=1.0, seed=5)
    requests = {3: _Request(seeded, make_generator(seeded)), 4: _Request(seeded, None)}
    scheduled = [
        ScheduledSequence(1, (7,), 9, (0,), samples=True),  # its request gone
        ScheduledSequence(2, (1, 2), 0, (1,), samples=False),
        ScheduledSequence(3, (8,), 4, (2,), samples=True),
        ScheduledSequence(4, (9,), 4, (3,), samples=True),
    ]
    request_of: Any = requests.get
    sampled, failed = Sampler().sample_step(scheduled, logits, request_of)
    alone = Sampler().sample(logits[1:2], [seeded], [make_generator(seeded)])
    assert sampled == {1: 7, 3: alone[0]}
    assert [(seq_id, type(error)) for seq_id, error in failed] == [(4, RuntimeError)]
    none_samples = Sampler().sample_step(scheduled[1:2], logits[:0], request_of)
    assert none_samples == ({}, [])  # a prefill chunk alone: no row samples, no logits


def test_a_row_with_nothing_cut_draws_each_token_at_its_probability() -> None:
    """No top-k and no top-p (the defaults): drawn from the whole vocabulary unsorted, each
    token as often as its softmax says (20,000 seeded draws over three tokens)."""
    row = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    tokens = sample_many(SamplingParams(temperature=1.0, seed=11), row, num_steps=20_000)
    shares = [tokens.count(t) / len(tokens) for t in range(3)]
    assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.02), shares
