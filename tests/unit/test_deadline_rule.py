"""The deadline rule: the caller's deadline, the model's default without one, opt-in shedding."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.model_repository import (
    DEFAULT_TIMEOUT_MS,
    ModelConfig,
    ModelConfigError,
    parse_model_config,
)
from services.gpu_worker.generation.first_token import predicted_first_token_s

pytestmark = pytest.mark.unit

_BASE = """kind = "torchscript"
slo_p99_ms = 250
max_batch_size = 8
[inputs.x]
dtype = "FP32"
dims = [4]
[outputs.y]
dtype = "FP32"
dims = [4]
"""


def make_config(tmp_path: Path, extra: str = "") -> ModelConfig:
    path = tmp_path / "config.toml"
    path.write_text(extra + _BASE)
    return parse_model_config("m", path)


def test_s08_the_callers_deadline_is_kept_even_far_past_the_slo(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    assert config.timeout_s_for(30.0) == 30.0
    assert config.timeout_s_for(0.01) == 0.01


def test_without_a_caller_deadline_the_models_default_applies(tmp_path: Path) -> None:
    assert make_config(tmp_path).timeout_s_for(None) == DEFAULT_TIMEOUT_MS / 1000
    configured = make_config(tmp_path, "default_timeout_ms = 1500\n")
    assert configured.timeout_s_for(None) == 1.5


def test_shedding_past_the_slo_is_opt_in(tmp_path: Path) -> None:
    assert make_config(tmp_path).shed_budget_s(0.02) is None
    shedding = make_config(tmp_path, "shed_past_slo = true\n")
    assert shedding.shed_budget_s(0.02) == pytest.approx(0.23)
    # Shedding bounds admission only: the deadline is still the caller's.
    assert shedding.timeout_s_for(30.0) == 30.0


@pytest.mark.parametrize(
    "extra", ["default_timeout_ms = 0\n", "default_timeout_ms = 1.5\n", 'shed_past_slo = "yes"\n']
)
def test_bad_deadline_settings_are_refused_with_the_file_named(tmp_path: Path, extra: str) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.toml"):
        make_config(tmp_path, extra)


def test_first_token_prediction_idle_engine_is_never_refused() -> None:
    assert (
        predicted_first_token_s(
            num_waiting_tokens=0,
            num_running=0,
            num_prompt_tokens=10_000,
            max_num_batched_tokens=512,
            step_s=1.0,
        )
        == 0.0
    )


def test_first_token_prediction_counts_the_prefill_backlog_ahead() -> None:
    # 2 running sequences leave 510 tokens a step for prefill: 1000 waiting + 100 own -> 3 steps.
    predicted = predicted_first_token_s(
        num_waiting_tokens=1000,
        num_running=2,
        num_prompt_tokens=100,
        max_num_batched_tokens=512,
        step_s=0.02,
    )
    assert predicted == pytest.approx(0.06)
    # Only decodes ahead (no backlog): the next step carries its prefill.
    assert predicted_first_token_s(
        num_waiting_tokens=0,
        num_running=4,
        num_prompt_tokens=8,
        max_num_batched_tokens=512,
        step_s=0.02,
    ) == pytest.approx(0.02)
