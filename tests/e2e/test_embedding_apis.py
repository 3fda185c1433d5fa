"""The embedding APIs end to end on a fresh stack: the stock `openai` client against
`/v1/embeddings` (base64 by default and floats, texts and token ids, 100 texts, in input order,
equal to sentence-transformers' reference embeddings), TEI's `/embed` and `/info` over plain
HTTP (normalized and not, truncation) and through Hugging Face's stock InferenceClient, and
every refusal with its status and its API's error body: bad inputs, limits, models of another
kind, API keys and tenant quotas (429 with Retry-After)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest
import torch
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError
from tokenizers import Tokenizer

from services.common.tensors import tensor_from_pb
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.conftest import cosine
from tests.support.keys import write_keys_with_tight_tenant
from tests.support.processes import REPO_ROOT
from tests.support.stack import Stack, start_stack
from tests.support.texts import sentences

pytestmark = pytest.mark.e2e

API_KEY = "embeddings-test-key"
#: A tenant with a quota of one request per 100 s.
TIGHT_KEY = "embeddings-tight-key"
#: minilm's config with [embedding] shortenable and truncate, and short buckets (16, 32).
MATRYOSHKA = "minilm-matryoshka"
TEXTS = ["The cat sat on the mat.", "A quick brown fox", "Embeddings in input order"]


def write_repository(root: Path) -> Path:
    """The default repository's minilm and tiny-llama, and MATRYOSHKA beside them."""
    root.mkdir()
    for name in ("minilm", "tiny-llama"):
        (root / name).symlink_to(REPO_ROOT / "models" / name, target_is_directory=True)
    source = REPO_ROOT / "models" / "minilm"
    (root / MATRYOSHKA / "1").mkdir(parents=True)
    config = (
        (source / "config.toml")
        .read_text()
        .replace("length_buckets = [16, 32, 64, 128, 256]", "length_buckets = [16, 32]")
    )
    (root / MATRYOSHKA / "config.toml").write_text(
        config + "\n[embedding]\nshortenable = true\ntruncate = true\n"
    )
    (root / MATRYOSHKA / "1" / "version.toml").write_text(
        (source / "1" / "version.toml").read_text()
    )
    return root


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("embeddings")
    keys = write_keys_with_tight_tenant(
        tmp / "api-keys.toml", tenant="embed", key=API_KEY, tight_key=TIGHT_KEY
    )
    stack = start_stack(
        tmp,
        model_repository=write_repository(tmp / "models"),
        extra_gateway_args=(f"--api-keys-file={keys}", "--tei-model=minilm"),
    )
    yield stack
    assert stack.stop() == 0, stack.stop_report()


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway.http_url}/v1", api_key=API_KEY, timeout=120,
                         max_retries=0)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(minilm_dir: Path) -> Tokenizer:
    """minilm's own tokenizer, without its shipped truncation and padding."""
    tokenizer = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@pytest.fixture(scope="module")
def raw_embedder(minilm_dir: Path):
    """sentence-transformers' Transformer and Pooling modules without its Normalize: the
    reference for unnormalized embeddings."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")

    def embed(texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            features = model.tokenize(texts)
            return model[1](model[0](features))["sentence_embedding"].numpy()

    return embed


def post(
    stack: Stack, path: str, body: Any, *, key: str | None = API_KEY
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, parsed JSON body) of one HTTP call; errors are answers too."""
    request = urllib.request.Request(stack.gateway.http_url + path,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def assert_matches(vectors: list[Any], reference: np.ndarray) -> None:
    assert len(vectors) == len(reference)
    for i, (vector, expected) in enumerate(zip(vectors, reference, strict=True)):
        assert cosine(np.asarray(vector, dtype=np.float32), expected) >= 0.999, i


def test_openai_client_base64_default_and_floats(
    client: openai.OpenAI, reference_embedder, tokenizer: Tokenizer
) -> None:
    reference = reference_embedder(TEXTS)
    default = client.embeddings.create(model="minilm", input=TEXTS)  # the client asks base64
    floats = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    for answer in (default, floats):
        assert answer.model == "minilm" and [d.index for d in answer.data] == [0, 1, 2]
        assert_matches([d.embedding for d in answer.data], reference)
        assert all(len(d.embedding) == 384 for d in answer.data)
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(TEXTS))
    assert default.usage.prompt_tokens == default.usage.total_tokens == tokens


def test_openai_token_ids_and_100_texts(
    client: openai.OpenAI, reference_embedder, tokenizer: Tokenizer
) -> None:
    ids = [e.ids for e in tokenizer.encode_batch(TEXTS)]
    as_ids = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    assert_matches([d.embedding for d in as_ids.data], reference_embedder(TEXTS))
    (single,) = client.embeddings.create(model="minilm", input=ids[1]).data
    assert_matches([single.embedding], reference_embedder(TEXTS[1:2]))
    texts = sentences(100, min_words=1, max_words=40, seed=11)
    many = client.embeddings.create(model="minilm", input=texts)
    assert [d.index for d in many.data] == list(range(100))
    assert_matches([d.embedding for d in many.data], reference_embedder(texts))


def test_openai_dimensions_and_truncation_where_the_model_allows(
    client: openai.OpenAI, reference_embedder, tokenizer: Tokenizer
) -> None:
    with pytest.raises(openai.BadRequestError, match="minilm cannot shorten"):
        client.embeddings.create(model="minilm", input="hi", dimensions=64)
    # Its own size shortens nothing: answered as it is, by any model.
    (same,) = client.embeddings.create(model="minilm", input=TEXTS[0], dimensions=384).data
    assert len(same.embedding) == 384
    assert cosine(np.asarray(same.embedding), reference_embedder(TEXTS[:1])[0]) >= 0.999
    (short,) = client.embeddings.create(model=MATRYOSHKA, input=TEXTS[0], dimensions=64).data
    expected = reference_embedder(TEXTS[:1])[0][:64]
    assert len(short.embedding) == 64
    assert np.linalg.norm(short.embedding) == pytest.approx(1.0, abs=1e-4)
    assert cosine(np.asarray(short.embedding), expected) >= 0.999
    with pytest.raises(openai.BadRequestError, match="exceeds"):
        client.embeddings.create(model=MATRYOSHKA, input="hi", dimensions=385)
    # MATRYOSHKA's config truncates: a long text is cut to its 32 tokens, [SEP] kept.
    long_text = " ".join(sentences(1, min_words=60, max_words=60, seed=5))
    (cut,) = client.embeddings.create(model=MATRYOSHKA, input=long_text).data
    ids = tokenizer.encode(long_text).ids
    assert len(ids) > 32
    (expected_cut,) = client.embeddings.create(model=MATRYOSHKA, input=ids[:31] + ids[-1:]).data
    assert cosine(np.asarray(cut.embedding), np.asarray(expected_cut.embedding)) >= 0.999


def test_a_config_that_truncates_truncates_on_the_grpc_apis_too(
    stack: Stack, client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    """`[embedding] truncate = true` cut long texts on the HTTP APIs only: v1 Predict and
    KServe ModelInfer refused them, whatever the config said (review finding)."""
    long_text = " ".join(sentences(1, min_words=60, max_words=60, seed=5))
    assert len(tokenizer.encode(long_text).ids) > 32
    (cut,) = client.embeddings.create(model=MATRYOSHKA, input=long_text).data
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(stack.gateway.address) as channel:
        predicted = api_grpc.InferenceServiceStub(channel).Predict(
            api.PredictRequest(model_name=MATRYOSHKA, inputs=[api.PredictInput(text=long_text)]),
            timeout=60, metadata=metadata,
        )  # fmt: skip
        tensor = kserve.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(long_text.encode())
        inferred = kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            kserve.ModelInferRequest(model_name=MATRYOSHKA, inputs=[tensor]),
            timeout=60, metadata=metadata,
        )  # fmt: skip
    from_predict = tensor_from_pb(predicted.outputs[0])
    from_infer = np.frombuffer(inferred.raw_output_contents[0], dtype="<f4")
    for embedding in (from_predict, from_infer):
        assert cosine(embedding.ravel(), np.asarray(cut.embedding)) >= 0.999


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({"model": "minilm", "input": ""}, 400, "empty"),
        ({"model": "minilm", "input": []}, 400, "empty"),
        ({"model": "minilm", "input": ["x"] * 257}, 400, "limit of 256"),
        ({"model": "minilm", "input": "word " * 300}, 400, "at most 256"),
        ({"model": "minilm", "input": [[101, 10**6, 102]]}, 400, "token ids must be in"),
        ({"model": "tiny-llama", "input": "hi"}, 400, "generation model"),
        ({"model": "no-such-model", "input": "hi"}, 404, "no-such-model"),
        ({"model": "minilm", "input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"model": "minilm", "input": "a\ud800b"}, 400, "not valid Unicode"),
    ],
)
def test_openai_refusals_are_openai_errors(
    stack: Stack, body: dict[str, Any], status: int, reason: str
) -> None:
    code, _, answer = post(stack, "/v1/embeddings", body)
    assert code == status, answer
    assert reason in answer["error"]["message"]
    assert answer["error"]["param"] is None
    assert answer["error"]["code"] == ("model_not_found" if status == 404 else None)


def test_tei_embed_normalized_and_not(stack: Stack, reference_embedder, raw_embedder) -> None:
    status, _, normalized = post(stack, "/embed", {"inputs": TEXTS})
    assert status == 200, normalized
    assert_matches(normalized, reference_embedder(TEXTS))
    assert [np.linalg.norm(v) for v in normalized] == pytest.approx([1.0] * 3, abs=1e-4)
    status, _, (one,) = post(stack, "/embed", {"inputs": TEXTS[0]})
    assert status == 200 and cosine(np.asarray(one), reference_embedder(TEXTS[:1])[0]) >= 0.999
    status, _, raw = post(stack, "/embed", {"inputs": TEXTS, "normalize": False})
    assert status == 200
    expected = raw_embedder(TEXTS)
    assert_matches(raw, expected)
    norms = [float(np.linalg.norm(v)) for v in raw]
    assert norms == pytest.approx([float(np.linalg.norm(e)) for e in expected], rel=1e-3)
    assert all(abs(n - 1.0) > 0.1 for n in norms)  # really before normalization


def test_hugging_face_inference_client(stack: Stack, reference_embedder) -> None:
    """The stock TEI client posts to the server's URL itself (TEI's `/`)."""
    client = InferenceClient(model=stack.gateway.http_url, token=API_KEY, timeout=120)
    vectors = client.feature_extraction(TEXTS)
    assert vectors.shape == (3, 384)
    assert_matches(list(vectors), reference_embedder(TEXTS))
    with pytest.raises(HfHubHTTPError, match="minilm cannot shorten"):
        client.feature_extraction(TEXTS, dimensions=64)


def test_tei_limits_truncation_and_info(stack: Stack) -> None:
    long_text = "word " * 300
    status, _, refused = post(stack, "/embed", {"inputs": [long_text]})
    assert status == 400 and "at most 256" in refused["error"]
    assert refused["error_type"] == "Validation"
    status, _, (cut,) = post(stack, "/embed", {"inputs": [long_text], "truncate": True})
    assert status == 200 and len(cut) == 384
    # Token ids past the model's 256 likewise: refused, or cut to their first 256 (as TEI
    # cuts them), which embed as those 256 sent alone (they were refused either way).
    long_ids = [101, *range(2000, 2298), 102]
    status, _, refused = post(stack, "/embed", {"inputs": [long_ids]})
    assert status == 400 and "at most 256" in refused["error"]
    status, _, (cut_ids,) = post(stack, "/embed", {"inputs": [long_ids], "truncate": True})
    assert status == 200, cut_ids
    status, _, (first_ids,) = post(stack, "/embed", {"inputs": [long_ids[:256]]})
    assert status == 200 and cut_ids == pytest.approx(first_ids, abs=1e-5)
    status, _, empty = post(stack, "/embed", {"inputs": []})
    assert status == 400 and empty["error_type"] == "Validation"
    request = urllib.request.Request(stack.gateway.http_url + "/info",
                                     headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as response:
        info = json.loads(response.read())
    assert (info["model_id"], info["dims"], info["max_input_length"]) == ("minilm", 384, 256)
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    # TEI's /health, which its deployments' probes read: 200 with a ready worker, no key.
    with urllib.request.urlopen(stack.gateway.http_url + "/health", timeout=60) as response:
        assert response.status == 200


def test_api_keys_and_tenant_quotas_apply(stack: Stack) -> None:
    for path, body in (("/v1/embeddings", {"model": "minilm", "input": "hi"}),
                       ("/embed", {"inputs": "hi"})):  # fmt: skip
        status, _, answer = post(stack, path, body, key=None)
        assert status == 401, answer
    status, _, missing = post(stack, "/v1/embeddings", {"model": "minilm", "input": "hi"}, key=None)
    assert "API key" in missing["error"]["message"]
    # The tight tenant's one request of burst goes; the next is refused on either API.
    status, _, answer = post(stack, "/embed", {"inputs": "hi"}, key=TIGHT_KEY)
    assert status == 200, answer
    for path, body in (("/v1/embeddings", {"model": "minilm", "input": "hi"}),
                       ("/embed", {"inputs": "hi"})):  # fmt: skip
        status, headers, answer = post(stack, path, body, key=TIGHT_KEY)
        assert status == 429, answer
        assert int(headers["Retry-After"]) >= 1
    assert answer["error_type"] == "Overloaded"
