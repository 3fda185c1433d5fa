"""The gateway's bundle tokenizers (services.gateway.model_inputs.BundleTokenizers): one per
text model version in use, made once, and those of versions gone stale dropped."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from services.common.model_repository import load_repository
from services.gateway.catalog import ResolvedModel, new_encoder
from services.gateway.model_inputs import BundleTokenizers
from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.unit


def test_one_tokenizer_per_current_version_and_stale_ones_dropped_when_one_is_made() -> None:
    (minilm,) = [v for v in load_repository(REPO_ROOT / "models") if v.config.name == "minilm"]
    encoder = new_encoder(minilm)
    current = {("minilm", "1", "a"), ("minilm", "2", "b")}
    seconds = Histogram("tokenize_seconds", "", ["model"], registry=CollectorRegistry())
    tokenizers = BundleTokenizers(lambda *key: key in current, seconds.labels)

    def resolved(version: str, fingerprint: str) -> ResolvedModel:
        return ResolvedModel(minilm.config, version, fingerprint, encoder)

    first = tokenizers.get(resolved("1", "a"), truncate=False)
    assert tokenizers.get(resolved("1", "a"), truncate=False) is first, "made once"
    made = first([["a short text"], ["and another"]])
    assert [len(rows) for rows in made] == [1, 1]
    tokenizers.get(resolved("1", "a"), truncate=True)
    assert len(tokenizers) == 2
    current.discard(("minilm", "1", "a"))  # version 1 retired
    tokenizers.get(resolved("2", "b"), truncate=False)
    assert len(tokenizers) == 1, "version 1's two went when version 2's was made"
