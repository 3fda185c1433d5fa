"""Triton's ModelConfig and ModelStatistics as the gateway builds them, from the models'
own configuration files and a tally fed with known requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import Unimplemented
from services.common.model_repository import parse_model_config
from services.gateway.triton_info import (
    UNIMPLEMENTED_RPCS,
    InferenceStatistics,
    WorkerTimes,
    model_config_message,
    unimplemented,
)
from services.pb.inference import model_config_pb2 as triton

pytestmark = pytest.mark.unit

MODELS = Path(__file__).resolve().parents[2] / "models"


def test_embedding_config_in_tritons_terms() -> None:
    config = model_config_message(parse_model_config("minilm", MODELS / "minilm" / "config.toml"))
    assert (config.name, config.platform, config.max_batch_size) == ("minilm", "pytorch", 64)
    assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == [
        ("text", triton.TYPE_STRING, [1], False)
    ]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("embedding", triton.TYPE_FP32, [384])
    ]
    batching = config.dynamic_batching
    assert batching.max_queue_delay_microseconds == 250_000  # the SLO bounds the linger
    assert (batching.priority_levels, batching.default_priority_level) == (3, 2)
    policy = batching.default_queue_policy
    assert policy.timeout_action == triton.ModelQueuePolicy.DELAY  # shed_past_slo = false
    assert policy.default_timeout_microseconds == 30_000_000 and policy.max_queue_size == 2048
    assert not config.model_transaction_policy.decoupled
    assert config.parameters["length_buckets"].string_value == "16,32,64,128,256"


def test_generation_config_is_decoupled_and_names_its_kv_cache(tmp_path: Path) -> None:
    text = (MODELS / "tiny-llama" / "config.toml").read_text()
    path = tmp_path / "config.toml"
    path.write_text("shed_past_slo = true\n" + text)
    config = model_config_message(parse_model_config("tiny-llama", path))
    assert config.model_transaction_policy.decoupled
    assert config.dynamic_batching.default_queue_policy.timeout_action == (
        triton.ModelQueuePolicy.REJECT
    )
    assert config.parameters["num_kv_blocks"].string_value == "512"
    assert "length_buckets" not in config.parameters
    # Its own input, then the optional ones of Triton's vLLM backend, which the gateway reads.
    assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == [
        ("text_input", triton.TYPE_STRING, [1], False),
        ("stream", triton.TYPE_BOOL, [1], True),
        ("exclude_input_in_output", triton.TYPE_BOOL, [1], True),
        ("sampling_parameters", triton.TYPE_STRING, [1], True),
    ]
    # One that the model declares itself is listed once, where it declares it, and optional
    # all the same (the gateway requires text_input alone).
    path.write_text(text + '\n[inputs.sampling_parameters]\ndtype = "BYTES"\ndims = [1]\n')
    config = model_config_message(parse_model_config("tiny-llama", path))
    assert [(i.name, i.optional) for i in config.input] == [
        ("text_input", False),
        ("sampling_parameters", True),
        ("stream", True),
        ("exclude_input_in_output", True),
    ]


def test_statistics_tally_successes_failures_and_rows() -> None:
    tally = InferenceStatistics()
    tally.record("m", "1", rows=3, is_ok=True, duration_s=0.010, finished_unix_s=100.0)
    tally.record("m", "1", rows=2, is_ok=True, duration_s=0.020, finished_unix_s=101.5)
    tally.record("m", "1", rows=4, is_ok=False, duration_s=0.005, finished_unix_s=101.0)
    tally.record("m", "", rows=1, is_ok=False, duration_s=0.001, finished_unix_s=102.0)
    stats = tally.message("m", "1", WorkerTimes(executions=2, queue_s=0.5, rows=5, compute_s=0.1))
    infer = stats.inference_stats
    assert (infer.success.count, infer.success.ns) == (2, 30_000_000)
    assert (infer.fail.count, infer.fail.ns) == (1, 5_000_000)
    assert stats.inference_count == 5 and stats.last_inference == 101_500
    assert (stats.execution_count, infer.compute_infer.count) == (2, 2)
    assert (infer.queue.count, infer.queue.ns) == (5, 500_000_000)
    assert infer.compute_infer.ns == 100_000_000
    assert tally.versions("m") == ["1"] and tally.versions("other") == []
    assert tally.message("m", "2", WorkerTimes()).inference_stats.success.count == 0


def test_every_undeclared_rpc_answers_with_its_reason() -> None:
    for rpc in UNIMPLEMENTED_RPCS:
        error = unimplemented(rpc)
        assert isinstance(error, Unimplemented) and str(error).startswith(f"{rpc} is not")
