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
from services.gpu_worker.repository_follower import read_pool_at_start
from tests.support.processes import REPO_ROOT

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
        # As many as the cache: no sequence admitted beside a running one (review finding).
        ("num_kv_blocks = 16\nwatermark_blocks = 16\n", "below num_kv_blocks"),
        ("block_size = 0\n", "sizes must be positive"),
        # A cache of one token serves no request (a prompt's token and one generated).
        ("num_kv_blocks = 1\nblock_size = 1\n", "hold 2 tokens or more"),
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
    for name in ("good", "bad", "empty", "huge"):
        (tmp_path / name).mkdir()
    (tmp_path / "good" / "config.toml").write_text(_GENERATION)
    (tmp_path / "good" / "1").mkdir()
    (tmp_path / "bad" / "config.toml").write_bytes(b'kind = "\xe9"\n')
    huge = "[labels]\nstable = 1\n[traffic]\nstable = 1" + "0" * 400 + "\n"
    (tmp_path / "huge" / "config.toml").write_text(_GENERATION + huge)
    (tmp_path / "empty" / "config.toml").write_text(_GENERATION)
    with pytest.raises(ModelConfigError, match="bad"):
        load_repository(tmp_path)
    errors: dict[str, ModelConfigError] = {}
    versions = load_repository(tmp_path, on_error=errors.__setitem__)
    assert [(v.config.name, v.version) for v in versions] == [("good", "1")]
    assert sorted(errors) == ["bad", "empty", "huge"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("max_batch_tokens = -1\n", "'max_batch_tokens' must be in"),
        ("max_batch_tokens = 2.5\n", "'max_batch_tokens' must be int"),
        ("max_queue_size = 1.5\n", "'max_queue_size' must be int"),
        ("default_timeout_ms = 4294967296\n", "'default_timeout_ms' must be in"),
        ("[labels]\ncanary = 1\n[traffic]\ncanary = inf\n", "finite weights"),
        ("[labels]\ncanary = 1\n[traffic]\ncanary = nan\n", "finite weights"),
        # Found by a review, each accepted before. A weight past 64 bits (TOML's reader takes
        # it) overflowed, which escaped the per-model errors and stopped the whole read:
        ("[labels]\ncanary = 1\n[traffic]\ncanary = 1" + "0" * 400 + "\n", "OverflowError"),
        # a label the gateway's routing refuses, which stopped the gateway:
        ("[labels]\nStable = 1\n", "'Stable' is not a label"),
        ('[labels]\n"canary.v2" = 1\n', "'canary.v2' is not a label"),
        ("[labels]\nstable = true\n", "values must be version numbers"),
        # a typo, which kept the setting's default silently:
        ("max_batch_token = 4096\n", r"unknown setting\(s\) \['max_batch_token'\]"),
        ('[preprocessing]\nnormalize = "false"\n', "normalize must be true or false"),
    ],
)
def test_settings_out_of_range_name_the_file(tmp_path: Path, extra: str, message: str) -> None:
    # Accepted before: a negative token cap failed the whole worker at start with a message
    # naming no model, and a count past uint32 broke the router's model list for every model.
    path = tmp_path / "config.toml"
    # Top-level keys before the first table, tables after the last.
    path.write_text(_GENERATION + extra if extra.startswith("[") else extra + _GENERATION)
    with pytest.raises(ModelConfigError, match=message) as error:
        parse_model_config("llm", path)
    assert "config.toml" in str(error.value)


def test_two_directories_of_one_version_number_are_refused(tmp_path: Path) -> None:
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.toml").write_text(_GENERATION)
    for version in ("1", "01", "\u00b2"):  # "²" is a digit, not a version
        (tmp_path / "llm" / version).mkdir()
    with pytest.raises(ModelConfigError, match=r"(1/ and 01/|01/ and 1/) are both version 1"):
        load_repository(tmp_path)
    (tmp_path / "llm" / "01").rmdir()
    assert [v.version for v in load_repository(tmp_path)] == ["1"]


@pytest.mark.parametrize(
    ("version_toml", "message"),
    [
        (b'weights = "package:json"\n', "gave no model path"),  # no get_model_path
        (b'weights = "caf\xe9"\n', "version.toml"),  # not UTF-8
    ],
)
def test_a_version_whose_weights_do_not_resolve_fails_its_model_alone(
    tmp_path: Path, version_toml: bytes, message: str
) -> None:
    for name in ("good", "bad"):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.toml").write_text(_GENERATION)
    (tmp_path / "bad" / "1" / "version.toml").write_bytes(version_toml)
    errors: dict[str, ModelConfigError] = {}
    versions = load_repository(tmp_path, on_error=errors.__setitem__)
    assert [v.config.name for v in versions] == ["good"]
    assert list(errors) == ["bad"] and message in str(errors["bad"])


def test_a_worker_starts_without_a_model_still_being_copied_unless_its_pool_names_it(
    tmp_path: Path,
) -> None:
    # Before, any model that did not read (one outside the worker's pool included) failed the
    # start of every worker.
    for name in ("good", "staged"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.toml").write_text(_GENERATION)
    (tmp_path / "good" / "1").mkdir()  # `staged` has no version yet
    assert [v.config.name for v in read_pool_at_start(tmp_path, ())] == ["good"]
    assert [v.config.name for v in read_pool_at_start(tmp_path, ("good",))] == ["good"]
    with pytest.raises(ModelConfigError, match=r"staged.*no version directories"):
        read_pool_at_start(tmp_path, ("good", "staged"))


@pytest.mark.parametrize("dims", ["[true]", "[2, false]", "[0]", "[1.5]"])
def test_a_dimension_that_is_not_a_positive_whole_number_is_refused(
    tmp_path: Path, dims: str
) -> None:
    """A TOML bool is a Python int: dims = [true] was read as a dimension of 1 (review
    finding)."""
    assert parse(tmp_path).max_model_len == 256  # as written, it reads
    path = tmp_path / "config.toml"
    path.write_text(_GENERATION.replace("dims = [1]", f"dims = {dims}", 1))
    with pytest.raises(ModelConfigError, match="dims must be a list of positive ints"):
        parse_model_config("llm", path)


def test_max_batch_tokens_below_the_longest_bucket_is_refused(tmp_path: Path) -> None:
    """A row of the longest bucket ran alone past the cap (batch_sizes: at least one row a
    batch), silently (review finding); 0 (no cap) and the bucket itself are fine."""
    text = (REPO_ROOT / "models" / "minilm" / "config.toml").read_text()
    assert "length_buckets" in text and "max_batch_tokens = 8192" in text
    path = tmp_path / "config.toml"
    for tokens, refused in ((0, False), (8192, False), (100, True)):
        path.write_text(text.replace("max_batch_tokens = 8192", f"max_batch_tokens = {tokens}"))
        if refused:
            with pytest.raises(ModelConfigError, match="longest length bucket"):
                parse_model_config("minilm", path)
        else:
            assert parse_model_config("minilm", path).max_batch_tokens == tokens
