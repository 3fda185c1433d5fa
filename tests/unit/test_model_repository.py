"""A model's `config.toml`: a generation model's `[generation]` table (sizes positive, the
watermark optional and >= 0, prefix caching one of its scopes), and configs that do not read."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.model_repository import (
    GenerationSettings,
    ModelConfigError,
    load_repository,
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


@pytest.mark.parametrize(
    "config",
    [
        _GENERATION.encode() + b"# caf\xe9\n",  # not UTF-8 (a half-copied file)
        _GENERATION.encode() + b"length_buckets = 5\n",  # a field of the wrong shape
        b"labels = 5\n" + _GENERATION.encode(),
    ],
)
def test_a_config_that_does_not_read_is_a_model_config_error(tmp_path: Path, config: bytes) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(config)
    with pytest.raises(ModelConfigError, match=r"config\.toml"):
        parse_model_config("llm", path)


def test_a_repository_read_can_leave_out_the_models_that_do_not_read(tmp_path: Path) -> None:
    for name in ("good", "bad", "empty"):
        (tmp_path / name).mkdir()
    (tmp_path / "good" / "config.toml").write_text(_GENERATION)
    (tmp_path / "good" / "1").mkdir()
    (tmp_path / "bad" / "config.toml").write_bytes(b'kind = "\xe9"\n')
    (tmp_path / "empty" / "config.toml").write_text(_GENERATION)
    with pytest.raises(ModelConfigError, match="bad"):
        load_repository(tmp_path)
    errors: dict[str, ModelConfigError] = {}
    versions = load_repository(tmp_path, on_error=errors.__setitem__)
    assert [(v.config.name, v.version) for v in versions] == [("good", "1")]
    assert sorted(errors) == ["bad", "empty"]
