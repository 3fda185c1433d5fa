"""The embedding APIs' pure parts: OpenAI's and TEI's request bodies (every input shape, every
refusal with its reason), the answer's vectors (shortened, normalized or not), OpenAI's
response (base64 as OpenAI writes it), a model's `[embedding]` table, truncation by the
model's own tokenizer, and the worker's per-row normalization."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.errors import InvalidInput
from services.common.model_repository import (
    ModelConfigError,
    load_repository,
    parse_model_config,
)
from services.common.text import TextEncoder, TokenIds
from services.gateway.http.embeddings_codec import (
    openai_embedding_request,
    openai_embedding_response,
    shaped_vectors,
    tei_embed_request,
)
from services.gpu_worker.backends.bert import normalize_rows

pytestmark = pytest.mark.unit

REPOSITORY = Path(__file__).resolve().parents[2] / "models"


def test_openai_input_shapes() -> None:
    one = openai_embedding_request({"model": "m", "input": "hello"})
    assert one.inputs == ["hello"] and one.encoding == "float" and one.dimensions is None
    many = openai_embedding_request({"model": "m", "input": ["a", "b"], "user": "u"})
    assert many.inputs == ["a", "b"]
    (ids,) = openai_embedding_request({"model": "m", "input": [101, 7592, 102]}).inputs
    assert isinstance(ids, TokenIds) and ids.ids.tolist() == [101, 7592, 102]
    lists = openai_embedding_request({"model": "m", "input": [[101, 102], [101, 5, 102]]})
    assert [i.ids.tolist() for i in lists.inputs if isinstance(i, TokenIds)] == [
        [101, 102], [101, 5, 102],
    ]  # fmt: skip
    shaped = openai_embedding_request(
        {"model": "m", "input": "x", "encoding_format": "base64", "dimensions": 8}
    )
    assert (shaped.encoding, shaped.dimensions) == ("base64", 8)
    assert shaped.normalize is None and shaped.truncate is None


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"input": "x"}, "model"),
        ({"model": "m"}, "input is required"),
        ({"model": "m", "input": ""}, "empty string"),
        ({"model": "m", "input": []}, "input is empty"),
        ({"model": "m", "input": ["a", ""]}, "empty string"),
        ({"model": "m", "input": [[]]}, "token-id list is empty"),
        ({"model": "m", "input": ["a", [1, 2]]}, "every input"),
        ({"model": "m", "input": [1, -2]}, "token ids"),
        ({"model": "m", "input": [True, 2]}, "every input"),
        ({"model": "m", "input": {"text": "a"}}, "must be a string"),
        ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "m", "input": "a", "dimensions": 0}, "dimensions"),
        ({"model": "m", "input": "a", "dimensions": True}, "dimensions"),
        ({"model": "m", "input": "a", "user": 3}, "user"),
        ({"model": "m", "input": "a", "truncate": True}, "unsupported fields ['truncate']"),
    ],
)
def test_openai_refusals_name_the_reason(body: dict, reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason.replace("[", r"\[").replace("]", r"\]")):
        openai_embedding_request(body)


def test_whitespace_alone_is_text_to_embed() -> None:
    """As OpenAI's and TEI's APIs take it: refused, a document splitter's "\n" chunk failed its
    whole batch (review finding). Embedded as the model's special tokens around nothing."""
    texts = ["a", " ", "\n", "\t "]
    assert openai_embedding_request({"model": "m", "input": texts}).inputs == texts
    assert tei_embed_request({"inputs": " "}).inputs == [" "]
    version = next(v for v in load_repository(REPOSITORY) if v.config.name == "minilm")
    encoder = TextEncoder(version.weights_dir, version.config)
    rows = encoder.encode_many(texts[1:])
    assert [r.tolist() for r in rows] == [[101, 102]] * 3  # [CLS] [SEP]
    with pytest.raises(InvalidInput, match="empty"):
        encoder.encode_many([""])


def test_tei_bodies() -> None:
    plain = tei_embed_request({"inputs": "hi"})
    assert plain.inputs == ["hi"] and plain.normalize is True and plain.truncate is None
    assert plain.model == ""
    raw = tei_embed_request({"inputs": ["a", "b"], "normalize": False, "truncate": True,
                             "truncation_direction": "Right", "prompt_name": None})  # fmt: skip
    assert (raw.normalize, raw.truncate, raw.inputs) == (False, True, ["a", "b"])
    # Hugging Face's InferenceClient sends these at the root too.
    client = tei_embed_request({"inputs": ["a"], "dimensions": 8, "encoding_format": "float"})
    assert client.dimensions == 8 and client.encoding == "float"
    for body, reason in (
        ({}, "inputs is required"),
        ({"inputs": []}, "inputs is empty"),
        ({"inputs": "a", "normalize": "no"}, "normalize must be a boolean"),
        ({"inputs": "a", "truncation_direction": "left"}, "'right'"),
        ({"inputs": "a", "prompt_name": "query"}, "prompt_name"),
        ({"inputs": "a", "model": "m"}, "unsupported fields"),
        ({"inputs": "a", "encoding_format": "base64"}, "encoding_format"),
        ({"inputs": "a", "dimensions": -1}, "dimensions"),
    ):
        with pytest.raises(InvalidInput, match=reason):
            tei_embed_request(body)


def test_shaped_vectors_shorten_and_normalize() -> None:
    raw = [np.array([3.0, 4.0, 12.0], dtype=np.float32), np.array([0.0, 2.0, 0.0], np.float32)]
    as_is = shaped_vectors(raw, dimensions=None, is_normalized=False, normalize=False)
    assert as_is.tolist() == [[3.0, 4.0, 12.0], [0.0, 2.0, 0.0]]
    whole = shaped_vectors(raw, dimensions=None, is_normalized=False, normalize=True)
    np.testing.assert_allclose(whole[0], [3 / 13, 4 / 13, 12 / 13], rtol=1e-6)
    short = shaped_vectors(raw, dimensions=2, is_normalized=True, normalize=True)
    np.testing.assert_allclose(short, [[0.6, 0.8], [0.0, 1.0]], rtol=1e-6)
    unscaled = shaped_vectors(raw, dimensions=2, is_normalized=False, normalize=False)
    assert unscaled.tolist() == [[3.0, 4.0], [0.0, 2.0]]


def test_openai_response_floats_and_base64_in_input_order() -> None:
    vectors = np.array([[0.5, -1.25], [2.0, 0.0]], dtype=np.float32)
    floats = openai_embedding_response(vectors, model="m", num_tokens=7, encoding="float")
    assert floats["object"] == "list" and floats["model"] == "m"
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert floats["data"][1] == {"object": "embedding", "embedding": [2.0, 0.0], "index": 1}
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    encoded = openai_embedding_response(vectors, model="m", num_tokens=7, encoding="base64")
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == [0.5, -1.25]


def test_embedding_table_of_a_model_config(tmp_path: Path) -> None:
    source = (REPOSITORY / "minilm" / "config.toml").read_text()
    path = tmp_path / "config.toml"
    assert (
        parse_model_config("minilm", REPOSITORY / "minilm" / "config.toml").embedding.truncate
        is False
    )
    path.write_text(source + "\n[embedding]\nshortenable = true\ntruncate = true\n")
    settings = parse_model_config("m", path).embedding
    assert settings.shortenable and settings.truncate
    for table, reason in (
        ("[embedding]\nshortenable = 1\n", "must be bool"),
        ("[embedding]\nmatryoshka = true\n", "unknown keys"),
    ):
        path.write_text(source + "\n" + table)
        with pytest.raises(ModelConfigError, match=reason):
            parse_model_config("m", path)
    generation = (REPOSITORY / "tiny-llama" / "config.toml").read_text()
    path.write_text(generation + "\n[embedding]\ntruncate = true\n")
    with pytest.raises(ModelConfigError, match="embedding models only"):
        parse_model_config("m", path)


def test_truncation_keeps_the_special_tokens_and_refusal_names_the_limit() -> None:
    version = next(v for v in load_repository(REPOSITORY) if v.config.name == "minilm")
    encoder = TextEncoder(version.weights_dir, version.config)
    text = "word " * 400
    with pytest.raises(InvalidInput, match=f"at most {encoder.max_tokens}"):
        encoder.encode_many([text])
    (cut,) = encoder.encode_many([text], truncate=True)
    (whole,) = encoder.encode_many(["word " * 10])
    assert len(cut) == encoder.max_tokens
    assert cut[0] == whole[0] and cut[-1] == whole[-1]  # [CLS] ... [SEP]
    # The refusing tokenizer is untouched by the truncating one.
    with pytest.raises(InvalidInput):
        encoder.encode_many([text])
    # JSON can carry a lone surrogate, which no tokenizer takes: a clear refusal, not a crash.
    with pytest.raises(InvalidInput, match="not valid Unicode"):
        encoder.encode_many(["a\ud800b"])


def test_rows_are_normalized_only_where_asked() -> None:
    pooled = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.0, 5.0]])
    mixed = normalize_rows(pooled, [True, False, True])
    np.testing.assert_allclose(mixed.numpy(), [[0.6, 0.8], [6.0, 8.0], [0.0, 1.0]], rtol=1e-6)
    assert normalize_rows(pooled, [False] * 3).tolist() == pooled.tolist()
    assert normalize_rows(pooled, [True] * 3)[1].tolist() == pytest.approx([0.6, 0.8])


def test_a_bundles_token_rows_are_checked_at_once_as_row_by_row() -> None:
    version = next(v for v in load_repository(REPOSITORY) if v.config.name == "minilm")
    encoder = TextEncoder(version.weights_dir, version.config)
    rows = [np.array([101, 7592, 102], "<i4"), np.array([101, 102], "<i4"), np.arange(3, 40)]
    at_once = encoder.check_ids_many(rows)
    assert [r.dtype for r in at_once] == [np.int64] * 3
    assert [r.tolist() for r in at_once] == [encoder.check_ids(r).tolist() for r in rows]
    # One bad row: the error is that row's, as checking row by row gives it.
    for bad, reason in (
        (np.array([101], "<i4"), "at least 2 token"),
        (np.array([101, encoder.vocab_size, 102], "<i4"), "token ids must be in"),
        (np.array([101, -1, 102], "<i4"), "token ids must be in"),
        (np.full(encoder.max_tokens + 1, 7, "<i4"), f"at most {encoder.max_tokens}"),
    ):
        with pytest.raises(InvalidInput, match=reason):
            encoder.check_ids_many([rows[0], bad, rows[1]])
