"""A KServe ModelInfer request's checks before its rows are decoded (kserve_generate.check_inputs,
kserve_infer._values), and the rows they decode: what a stock Triton client sends, and each way
its tensors can be wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.models import write_affine_model
from services.common.errors import InvalidInput
from services.common.model_repository import ModelConfig, load_repository
from services.gateway.kserve_generate import check_inputs
from services.gateway.kserve_infer import _values
from services.gateway.triton_info import request_parameters
from services.pb.inference import grpc_service_pb2 as kserve

pytestmark = pytest.mark.unit

Tensor = kserve.ModelInferRequest.InferInputTensor


@pytest.fixture
def config(tmp_path: Path) -> ModelConfig:
    write_affine_model(tmp_path)  # one FP32 input x of dims [4]
    return next(iter(load_repository(tmp_path))).config


def request(*names: str, rows: int = 2, datatype: str = "FP32") -> kserve.ModelInferRequest:
    """Inputs of `names`, each `rows` rows of 4 values in `raw_input_contents`."""
    data = np.arange(4 * rows, dtype="<f4").tobytes()
    return kserve.ModelInferRequest(
        model_name="affine",
        inputs=[Tensor(name=name, datatype=datatype, shape=[rows, 4]) for name in names],
        raw_input_contents=[data for _ in names],
    )


def checked_values(config: ModelConfig, infer: kserve.ModelInferRequest) -> list[np.ndarray]:
    check_inputs(infer)  # as infer_one calls them
    return _values(config, infer, max_rows=64)


def test_the_one_input_decodes_to_its_rows(config: ModelConfig) -> None:
    rows = checked_values(config, request("x", rows=3))
    assert [row.tolist() for row in rows] == np.arange(12, dtype="<f4").reshape(3, 4).tolist()


@pytest.mark.parametrize(
    ("names", "refusal"),
    [
        (("x", "z"), "takes exactly one input named 'x', got ['x', 'z']"),
        (("z",), "takes exactly one input named 'x', got ['z']"),
        (("x", "x"), "input(s) ['x'] given more than once"),
        (("b", "a", "b", "a", "c"), "input(s) ['a', 'b'] given more than once"),
    ],
)
def test_inputs_other_than_the_models_one_are_refused_by_name(
    config: ModelConfig, names: tuple[str, ...], refusal: str
) -> None:
    with pytest.raises(InvalidInput) as raised:
        checked_values(config, request(*names))
    assert refusal in str(raised.value)


def test_a_tensor_of_another_dtype_is_refused(config: ModelConfig) -> None:
    with pytest.raises(InvalidInput, match="input x must be FP32, got INT32"):
        checked_values(config, request("x", datatype="INT32"))


def test_raw_contents_must_be_one_per_input(config: ModelConfig) -> None:
    infer = request("x")
    infer.raw_input_contents.append(b"")
    with pytest.raises(InvalidInput, match="2 raw_input_contents for 1 inputs"):
        checked_values(config, infer)


def test_no_parameters_and_a_timeout_parameter_read_alike() -> None:
    none = request_parameters(kserve.ModelInferRequest().parameters)
    assert (none.priority, none.timeout_s) == (None, None)
    infer = kserve.ModelInferRequest()
    infer.parameters["timeout"].int64_param = 250_000
    assert request_parameters(infer.parameters).timeout_s == 0.25
