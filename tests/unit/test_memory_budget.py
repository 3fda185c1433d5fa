"""The hot-load memory check: a version loads only if its weights, times the load factor, fit
in the free memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.gpu_worker.memory_budget import (
    LOAD_MEMORY_FACTOR,
    InsufficientMemory,
    check_fits,
    weights_bytes,
)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
MIB = 1024 * 1024


def test_a_version_that_fits_with_its_load_factor_passes() -> None:
    check_fits(weights=100 * MIB, free=round(100 * MIB * LOAD_MEMORY_FACTOR), device=CPU)


def test_a_version_past_free_memory_is_refused_with_its_figures() -> None:
    with pytest.raises(InsufficientMemory) as refused:
        check_fits(weights=100 * MIB, free=150 * MIB, device=CPU)
    message = str(refused.value)
    assert "not enough memory on cpu" in message
    assert "100 MiB of weights" in message and "150 MiB free" in message


def test_weights_bytes_adds_every_file_under_the_directory(tmp_path: Path) -> None:
    (tmp_path / "nested").mkdir()
    (tmp_path / "model.pt").write_bytes(b"x" * 1000)
    (tmp_path / "nested" / "tokenizer.json").write_bytes(b"y" * 24)
    assert weights_bytes(tmp_path) == 1024
