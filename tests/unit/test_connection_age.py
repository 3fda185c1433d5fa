"""Every server ages its connections (clients re-resolve, so new replicas get traffic) with a
grace after GOAWAY that outlasts any call a shipped model allows: with 30 s, a generation
streaming longer on a connection that reached its age was cut partway, and neither the router
nor the gateway resends one that has begun (review finding)."""

from __future__ import annotations

import tomllib

import pytest

from services.common.lifecycle import CONNECTION_AGE_GRACE_MS, CONNECTION_AGE_MS
from services.common.model_repository import DEFAULT_TIMEOUT_MS
from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.unit


def test_the_grace_outlasts_every_shipped_models_deadline() -> None:
    deadlines = {
        path.parent.name: tomllib.loads(path.read_text()).get(
            "default_timeout_ms", DEFAULT_TIMEOUT_MS
        )
        for path in (REPO_ROOT / "models").glob("*/config.toml")
    }
    assert deadlines.keys() >= {"minilm", "tiny-llama"}
    assert max(deadlines.values()) == 300_000  # tiny-llama's generations
    assert max(deadlines.values()) < CONNECTION_AGE_GRACE_MS, deadlines
    assert CONNECTION_AGE_MS > 0
