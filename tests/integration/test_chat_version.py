"""The version a chat completion runs on follows its X-Request-Id, as a completion's does: one
id, one version while a canary's weights stand. The chat route chose its version (to build the
prompt with that version's template) without the id, so a conversation's turns were spread
over the canary's versions (review finding). The real catalog, over a repository of two
tiny-llama versions weighted 1:1, and the chat route's own choice."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.common.model_repository import load_repository
from services.common.model_routing import ModelRouting
from services.gateway.auth import Principal
from services.gateway.catalog import ModelCatalog, new_encoder
from services.gateway.http.openai_api import OpenAiApi
from services.gateway.metrics import GatewayMetrics
from services.gateway.tenants import TenantPolicy
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.models import tiny_llama_version

pytestmark = pytest.mark.integration


def test_one_request_id_gets_one_version_of_a_weighted_chat_model(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    tiny_llama_version(repository, "1")
    shutil.copytree(repository / "tiny-llama" / "1", repository / "tiny-llama" / "2")
    versions_on_disk = load_repository(repository)
    catalog = ModelCatalog(versions_on_disk)
    encoder = new_encoder(versions_on_disk[0])
    assert encoder is not None
    assert catalog.set_routing(
        "tiny-llama", ModelRouting({"a": 1, "b": 2}, {"a": 1.0, "b": 1.0}, revision=1)
    )
    fingerprint = encoder.fingerprint
    catalog.update_served(
        [
            pb.ModelVersionInfo(
                model_name="tiny-llama",
                model_version=v,
                is_ready=True,
                tokenizer_fingerprint=fingerprint,
            )
            for v in ("1", "2")
        ]
    )
    predictor: Any = SimpleNamespace(catalog=catalog)
    api = OpenAiApi(predictor, GatewayMetrics(CollectorRegistry()))
    principal = Principal("t", None, TenantPolicy("t"))

    def versions(request_ids: list[str]) -> set[str]:
        return {api._template("tiny-llama", principal, rid)[0] for rid in request_ids}

    for request_id in ("conversation-1", "conversation-2", "conversation-3"):
        assert len(versions([request_id] * 20)) == 1, request_id
    # Without one, each call draws its own (both versions in 40 draws but for 2**-39).
    assert versions([""] * 40) == {"1", "2"}
