"""OpenAI's /v1/embeddings and TEI's /embed bodies <-> this server's predict terms. Pure: dicts
in, dicts out.

OpenAI: `model`, `input` (a string, a list of strings, a list of token ids or a list of such
lists), `encoding_format` ("float" or "base64": little-endian float32, as OpenAI sends it),
`dimensions`, `user`. TEI (text-embeddings-inference): `inputs` (a string or a list; token-id
lists too), `normalize` (default true), `truncate` (default false), `truncation_direction`
("right" only), `prompt_name` (null only), and `dimensions` and `encoding_format` ("float")
as Hugging Face's InferenceClient sends them. Token ids are the model's own, special tokens
included, used as given (with `truncate`, a list longer than the model takes is cut to its
first ids, as TEI cuts it). Unknown fields are refused rather than silently ignored.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.errors import InvalidInput
from services.common.tensors import stack_rows
from services.common.text import TokenIds
from services.gateway.http.codec import is_json_int

ENCODINGS = ("float", "base64")
_OPENAI_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
_TEI_FIELDS = frozenset({"inputs", "normalize", "truncate", "truncation_direction",
                         "prompt_name", "dimensions", "encoding_format"})  # fmt: skip


@dataclass(frozen=True)
class EmbeddingRequest:
    """What one embedding call asks for, in either API's terms."""

    #: The model named ("" for TEI, which serves the gateway's TEI model).
    model: str
    inputs: list[str | TokenIds]
    #: "float" or "base64" (OpenAI); TEI answers floats.
    encoding: str = "float"
    #: Leading dims to keep (OpenAI's `dimensions`); None keeps all.
    dimensions: int | None = None
    #: True/False: L2-normalized or not (TEI's `normalize`); None: as the model does.
    normalize: bool | None = None
    #: True/False: cut over-long inputs or refuse them; None: as the model's config says.
    truncate: bool | None = None


def _token_ids(values: list[Any], field: str) -> TokenIds:
    if not values:
        raise InvalidInput(f"{field}: a token-id list is empty")
    if not all(is_json_int(v) and 0 <= v < 2**31 for v in values):
        raise InvalidInput(f"{field}: token ids must be integers in [0, 2^31)")
    return TokenIds(np.asarray(values, dtype=np.int64))


def _inputs(value: Any, field: str) -> list[str | TokenIds]:
    """A string, a token-id list, or a non-empty list of either (one kind throughout)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(is_json_int(v) for v in value):
        return [_token_ids(value, field)]
    elif isinstance(value, list):
        items = value
    else:
        raise InvalidInput(f"{field} must be a string, a list of strings or token-id lists")
    if not items:
        raise InvalidInput(f"{field} is empty")
    if all(isinstance(v, str) for v in items):
        if not all(items):  # whitespace alone is text, as OpenAI's and TEI's APIs take it
            raise InvalidInput(f"{field}: an input is an empty string")
        return list(items)
    if all(isinstance(v, list) for v in items):
        return [_token_ids(v, field) for v in items]
    raise InvalidInput(f"{field}: every input must be a string, or every input a token-id list")


def _check_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidInput(f"unsupported fields {unknown}")


def _encoding(body: dict[str, Any], allowed: tuple[str, ...]) -> str:
    encoding = body.get("encoding_format") or "float"
    if encoding not in allowed:
        raise InvalidInput(f"encoding_format must be one of {list(allowed)}, got {encoding!r}")
    return str(encoding)


def _dimensions(body: dict[str, Any]) -> int | None:
    dimensions = body.get("dimensions")
    if dimensions is not None and not (is_json_int(dimensions) and dimensions >= 1):
        raise InvalidInput(f"dimensions must be an integer >= 1, got {dimensions!r}")
    return dimensions


def openai_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    """A /v1/embeddings body."""
    _check_fields(body, _OPENAI_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidInput("model (a string) is required")
    if "input" not in body:
        raise InvalidInput("input is required")
    encoding = _encoding(body, ENCODINGS)
    dimensions = _dimensions(body)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise InvalidInput("user must be a string")
    return EmbeddingRequest(model, _inputs(body["input"], "input"), encoding, dimensions)


def tei_embed_request(body: dict[str, Any]) -> EmbeddingRequest:
    """A TEI /embed body."""
    _check_fields(body, _TEI_FIELDS)
    if "inputs" not in body:
        raise InvalidInput("inputs is required")
    flags = {k: body.get(k) for k in ("normalize", "truncate")}
    for key, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise InvalidInput(f"{key} must be a boolean")
    direction = body.get("truncation_direction")
    if direction is not None and str(direction).lower() != "right":
        raise InvalidInput("only truncation_direction 'right' is supported")
    if body.get("prompt_name") is not None:
        raise InvalidInput("prompt_name is not supported: this model has no prompts")
    normalize = True if flags["normalize"] is None else flags["normalize"]
    return EmbeddingRequest(
        "", _inputs(body["inputs"], "inputs"), _encoding(body, ("float",)), _dimensions(body),
        normalize=normalize, truncate=flags["truncate"],
    )  # fmt: skip


def shaped_vectors(
    outputs: list[np.ndarray], *, dimensions: int | None, is_normalized: bool, normalize: bool
) -> np.ndarray:
    """The answer's [rows, dims] float32 vectors: cut to `dimensions` (which must not exceed
    the model's), then L2-normalized when `normalize` asks for it and they are not already."""
    vectors = stack_rows(outputs).astype(np.float32, copy=False)
    if dimensions is not None and dimensions < vectors.shape[1]:
        vectors = vectors[:, :dimensions]
        is_normalized = False
    if normalize and not is_normalized:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    return vectors


def openai_embedding_response(
    vectors: np.ndarray, *, model: str, num_tokens: int, encoding: str
) -> dict[str, Any]:
    """OpenAI's answer: one `embedding` object per input, in input order, and the usage."""
    data = []
    for index, vector in enumerate(vectors):
        if encoding == "base64":
            embedding: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        else:
            embedding = vector.tolist()
        data.append({"object": "embedding", "embedding": embedding, "index": index})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
