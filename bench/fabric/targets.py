"""What the load generator calls: the fabric's public Predict, the identity model through all
three tiers, the bare echo server, and the workload's texts.

Every target is an `async def send() -> None` closure over one shared channel and requests
built once up front, so the generator spends its CPU on sending, not on building messages.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
from tokenizers import Tokenizer

from bench.fabric.echo_server import echo_stub
from bench.fabric.loadgen import Send
from bench.fabric.stack import IDENTITY_DIMS
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as wpb

#: Common English words that are one WordPiece each in MiniLM's vocabulary, so a text of n
#: words is n + 2 tokens ([CLS] and [SEP]); checked against the real tokenizer at start.
_WORDS = (
    "the quick brown fox jumps over a lazy dog while people walk home after work and "
    "children play in the park near old trees with green leaves under blue sky on warm "
    "summer day some cars drive down long road to small town where friends meet for "
    "coffee tea bread music news food water light house city time year world life"
).split()
#: Workload texts: ~8-16 tokens each, special tokens included (one length bucket: 16).
MIN_TOKENS, MAX_TOKENS = 8, 16


def make_texts(count: int, seed: int, tokenizer_json: Path | None = None) -> list[str]:
    """`count` seeded short texts. With `tokenizer_json`, every text is checked to encode to
    MIN_TOKENS..MAX_TOKENS tokens (so the raw-model comparison uses the same bucket)."""
    rng = random.Random(seed)
    texts = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(MIN_TOKENS - 2, MAX_TOKENS - 2)))
        for _ in range(count)
    ]
    if tokenizer_json is not None:
        tokenizer = Tokenizer.from_file(str(tokenizer_json))
        tokenizer.no_truncation()
        tokenizer.no_padding()
        lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
        pairs = zip(texts, lengths, strict=True)
        bad = [(text, n) for text, n in pairs if not MIN_TOKENS <= n <= MAX_TOKENS]
        if bad:
            raise ValueError(f"texts outside {MIN_TOKENS}..{MAX_TOKENS} tokens: {bad[:3]}")
    return texts


#: The mixed-length workload (docs/benchmarks.md): this share of short queries of SHORT_WORDS words,
#: the rest passages of PASSAGE_WORDS words.
SHORT_SHARE = 0.85
SHORT_WORDS = (3, 14)
PASSAGE_WORDS = (60, 120)


def make_mixed_texts(count: int, seed: int) -> list[str]:
    """`count` seeded texts of the mixed-length workload: about 85% short queries of 3-14
    words, 15% passages of 60-120 words, in a shuffled order (the order traffic arrives)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        low, high = SHORT_WORDS if rng.random() < SHORT_SHARE else PASSAGE_WORDS
        texts.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high))))
    return texts


def predict_sender(
    channel: grpc.aio.Channel, model: str, texts: Sequence[str], timeout_s: float
) -> Send:
    """One text per Predict call, cycling through `texts`."""
    stub = api_grpc.InferenceServiceStub(channel)
    requests = itertools.cycle(
        [api.PredictRequest(model_name=model, inputs=[api.PredictInput(text=t)]) for t in texts]
    )

    async def send() -> None:
        await stub.Predict(next(requests), timeout=timeout_s)

    return send


def identity_request(model: str = "identity") -> api.PredictRequest:
    row = np.arange(IDENTITY_DIMS, dtype="<f4")
    tensor = wpb.Tensor(dtype=wpb.DATA_TYPE_FP32, shape=[IDENTITY_DIMS], raw_data=row.tobytes())
    return api.PredictRequest(model_name=model, inputs=[api.PredictInput(tensor=tensor)])


def identity_sender(channel: grpc.aio.Channel, timeout_s: float, model: str = "identity") -> Send:
    """The identity model through gateway, router and worker."""
    stub = api_grpc.InferenceServiceStub(channel)
    request = identity_request(model)

    async def send() -> None:
        await stub.Predict(request, timeout=timeout_s)

    return send


def echo_sender(channel: grpc.aio.Channel, payload: bytes, timeout_s: float) -> Send:
    """The bare echo server, with a payload as large as the identity model's request."""
    call = echo_stub(channel)

    async def send() -> None:
        await call(payload, timeout=timeout_s)

    return send


def text_sender(peer: object, texts: Sequence[str]) -> Send:
    """A peer's `async def send(text)`, cycling through `texts` like predict_sender."""
    cycle = itertools.cycle(texts)
    peer_send = peer.send

    async def send() -> None:
        await peer_send(next(cycle))

    return send
