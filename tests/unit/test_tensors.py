"""Wire tensors (services.common.tensors): what `tensor_to_pb` writes reads back the same, and
a tensor whose dtype, shape and bytes disagree is refused."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidInput
from services.common.tensors import (
    MAX_DIMS,
    MAX_ELEMENTS,
    NUMPY_DTYPES,
    stack_rows,
    tensor_from_pb,
    tensor_to_pb,
)
from services.pb.inference.v1 import worker_pb2 as pb

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(NUMPY_DTYPES))
def test_every_wire_dtype_round_trips(name: str) -> None:
    array = np.arange(6).reshape(2, 3).astype(NUMPY_DTYPES[name])
    back = tensor_from_pb(tensor_to_pb(array))
    assert back.dtype == array.dtype and back.shape == (2, 3)
    assert np.array_equal(back, array)


@pytest.mark.parametrize(("numpy_dtype", "wire"), [(">f4", "<f4"), (">i8", "<i8"), (">i4", "<i4")])
def test_a_big_endian_array_goes_as_its_little_endian_twin(numpy_dtype: str, wire: str) -> None:
    array = np.array([[1, -2], [3, 40000]], dtype=numpy_dtype)
    back = tensor_from_pb(tensor_to_pb(array))
    assert back.dtype == np.dtype(wire)
    assert np.array_equal(back, array)


@pytest.mark.parametrize("numpy_dtype", [np.float64, np.uint8, object])
def test_a_dtype_with_no_wire_name_is_refused(numpy_dtype: type) -> None:
    with pytest.raises(TypeError, match="no wire dtype"):
        tensor_to_pb(np.zeros(2, dtype=numpy_dtype))


@pytest.mark.parametrize(
    ("shape", "num_bytes", "refusal"),
    [
        ([2, -1], 0, "negative dimension"),
        ([1] * (MAX_DIMS + 1), 4, "dimensions; at most"),
        ([MAX_ELEMENTS + 1], 0, "exceeds the limit"),
        ([0, MAX_ELEMENTS + 1], 0, "exceeds the limit"),  # no elements, one dimension too big
        ([2, 3], 20, "has 20 bytes; shape [2, 3] of FP32 needs 24"),
    ],
)
def test_a_tensor_whose_shape_and_bytes_disagree_is_refused(
    shape: list[int], num_bytes: int, refusal: str
) -> None:
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=shape, raw_data=b"\0" * num_bytes)
    with pytest.raises(InvalidInput, match=refusal.replace("[", r"\[").replace("]", r"\]")):
        tensor_from_pb(tensor)


@pytest.mark.parametrize(("shape", "count"), [([], 1), ([0, 5], 0), ([2, 3], 6)])
def test_a_scalar_and_an_empty_tensor_are_read(shape: list[int], count: int) -> None:
    data = np.arange(count, dtype="<f4")
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=shape, raw_data=data.tobytes())
    read = tensor_from_pb(tensor)
    assert read.shape == tuple(shape)
    assert read.ravel().tolist() == data.tolist()


@pytest.mark.parametrize("count", [1, 2, 27])
@pytest.mark.parametrize("dtype", ["<f4", "<i8", object])
def test_stack_rows_is_np_stack(count: int, dtype: str | type) -> None:
    rows = [np.arange(3 * n, 3 * n + 3).astype(dtype) for n in range(count)]
    stacked = stack_rows(rows)
    assert stacked.dtype == np.stack(rows).dtype and stacked.shape == (count, 3)
    assert np.array_equal(stacked, np.stack(rows))


def test_stack_rows_of_unlike_shapes_is_refused_as_np_stack_refuses_it() -> None:
    with pytest.raises(ValueError):
        stack_rows([np.zeros(3), np.zeros(4)])
