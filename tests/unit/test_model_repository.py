"""A generation model's `[generation]` table: sizes positive, the watermark optional and >= 0,
prefix caching one of its scopes."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.model_repository import (
    GenerationSettings,
    ModelConfigError,
    parse_model_config,
)

pytestmark = pytest.mark.unit

_GENERATION = """kind = "generation"
slo_p99_ms = 2000
max_batch_size = 8
[inputs.text_input]
dtype = "BYTES"
dims = [1]
[outputs.text_output]
dtype = "BYTES"
dims = [1]
[generation]
max_model_len = 256
"""


def parse(tmp_path: Path, extra: str = "") -> GenerationSettings:
    path = tmp_path / "config.toml"
    path.write_text(_GENERATION + extra)
    generation = parse_model_config("llm", path).generation
    assert generation is not None
    return generation


def test_watermark_defaults_to_zero_and_can_be_set(tmp_path: Path) -> None:
    assert parse(tmp_path).watermark_blocks == 0
    assert parse(tmp_path, "watermark_blocks = 4\n").watermark_blocks == 4


def test_prefix_caching_is_shared_unless_scoped_per_tenant_or_off(tmp_path: Path) -> None:
    assert parse(tmp_path).prefix_caching == "shared"
    for scope in ("off", "per_tenant"):
        assert parse(tmp_path, f'prefix_caching = "{scope}"\n').prefix_caching == scope


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("watermark_blocks = -1\n", "watermark_blocks must be >= 0"),
        ("block_size = 0\n", "sizes must be positive"),
        ("num_kv_blocks = 1.5\n", "must be integers"),
        ("unknown_knob = 1\n", "unknown_knob"),
        ('prefix_caching = "on"\n', "prefix_caching must be one of"),
        ("prefix_caching = 1\n", "prefix_caching must be one of"),
    ],
)
def test_bad_generation_settings_name_the_file(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message) as error:
        parse(tmp_path, extra)
    assert "config.toml" in str(error.value)
